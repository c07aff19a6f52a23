"""Benchmark scripts that only run in full on a GPU still run end to end on the tiny models (their `--tiny` mode)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def _families_benchmarked() -> list[str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.FAMILIES)


SETTINGS = _families_benchmarked()


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
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
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
