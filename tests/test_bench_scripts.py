"""Benchmark scripts that only run in full on a GPU still run end to end on the tiny models (their `--tiny` mode)."""

import json
import os
from pathlib import Path

import pytest

from . import launch


ROOT = Path(__file__).resolve().parents[1]


def _gpu_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPU_BENCH = _gpu_bench()
SETTINGS = list(GPU_BENCH.FAMILIES)


def test_the_bench_s_own_times_are_the_profiler_s_key_averages():
    """The profile's per-operator calls and own times, read from the raw events, are torch's `key_averages()` (which
    costs 70 us an event): nested operators (autograd, attention's math path) and one call the dispatcher records
    twice (`aten::sum` inside `aten::sum`) included."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU()) for _ in range(3)]
    net, x = torch.nn.Sequential(*blocks), torch.randn(2, 4, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            y = net(x)
            torch.nn.functional.scaled_dot_product_attention(y, y, y).sum().backward()
    rows = GPU_BENCH.own_times(prof, cuda=False)
    expected = {e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()}
    assert set(rows) == set(expected) and "aten::sum" in rows
    for name, (calls, micros) in expected.items():
        assert rows[name][0] == calls and rows[name][1] == pytest.approx(micros, abs=1e-3), name


@pytest.mark.models  # builds every benchmarked family's tiny model and trains it two epochs: the second CI tier
@pytest.mark.long
def test_gpu_bench_tiny_mode_writes_its_json(tmp_path):
    out = tmp_path / "gpu_bench.json"
    args = [
        "--tiny",
        "--group",
        "2",
        "--steps",
        "2",
        "--epochs",
        "1",
        "--minibatch",
        "1",
        "--forward-batch",
        "2",
        "--lora-rank",
        "4",
        "--models",
        ",".join(SETTINGS),
        "--out",
        str(out),
        "--profile",
        str(tmp_path / "profiles"),
        "--set",
        "sampling.uncond_grad=false",  # a lever side by side: the config override reaches the run
    ]
    # the script as `python benchmarks/gpu_bench.py ARGS` runs it, forked from the forkserver (tests/launch.py)
    script = str(ROOT / "benchmarks" / "gpu_bench.py")
    code = f"import runpy\nrunpy.run_path({script!r}, run_name='__main__')"
    launched = launch.start_code(code, dict(os.environ), tmp_path / "gpu_bench.log", argv=[script, *args])
    assert launched.wait(timeout=600) == 0, launched.log.read_text()[-3000:]
    report = json.loads(out.read_text())
    assert [r["model"] for r in report["results"]] == list(SETTINGS)  # every family the GPU run covers
    for row in report["results"]:  # flowrl's own loop ran: its phases' times and the plan's FLOPs beside them
        assert row["rollout_images_per_s"] > 0 and row["update_images_per_s"] > 0 and row["images_per_s"] > 0
        assert row["flops_per_sample"]["update"] > 0 and row["flops_per_sample"]["rollout"] > 0
        assert set(row["plan_gb"]) >= {"rollout", "update"} and row["epochs"][0]["train_s"] > 0
        assert row["settings"] == {"sampling.uncond_grad": False}
        for phase in ("rollout", "update"):  # one more epoch under torch.profiler: each phase's time split by kind
            profile = row["profile"][phase]
            assert 0 < profile["busy_s"] and profile["matmul_s"] > 0 and profile["kernels"] > 0
            assert profile["busy_s"] == pytest.approx(
                sum(profile[f"{k}_s"] for k in ("matmul", "attention", "convolution", "other"))
            )
        table = (tmp_path / "profiles" / f"profile_gpu_bench_{row['model']}.txt").read_text()
        assert "## rollout" in table and "## update" in table and table.count("\n") > 20
