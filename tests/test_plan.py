"""`flowrl plan`: live-memory tracing on `meta` tensors, CUDA's autocast and attention replayed, the plan of a run
checked against what a GPU measured, the CLI and the check `flowrl train` runs first."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flowrl.plan import WillNotFit, check_fits, plan
from flowrl.plan.host_values import HostValues, host_value
from flowrl.plan.trace import CudaAutocast, GiB, GpuAttention, LiveMemory
from flowrl.trainers import load_config


ROOT = Path(__file__).resolve().parents[1]


def test_live_memory_counts_each_storage_once_and_frees_it():
    mem = LiveMemory()
    with mem:
        a = torch.empty(1000, device="meta")  # 4,000 bytes
        view = a.view(10, 100)  # the same storage: not counted again
        b = a * 2  # 4,000 more
        assert mem.current == 8000 and view.shape == (10, 100)
        del b
        assert mem.current == 4000
        with mem.phase("p"):
            c = torch.empty(250, dtype=torch.float64, device="meta")  # 2,000 bytes, freed inside the phase
            del c
        assert (mem.phases["p"].start, mem.phases["p"].peak, mem.phases["p"].end) == (4000, 6000, 4000)
    assert mem.peak == 8000
    weights = torch.empty(100, dtype=torch.bfloat16, device="meta")
    mem.register([weights, weights[:10]])  # tensors made before: counted once each storage
    assert mem.current == 4200


def test_cuda_autocast_casts_as_cuda_does_and_autograd_keeps_the_casts():
    x = torch.randn(4, 8, device="meta")
    w = torch.randn(8, 8, device="meta", requires_grad=True)
    h = torch.randn(4, 8, device="meta", dtype=torch.bfloat16)
    with CudaAutocast(torch.bfloat16):
        y = F.linear(x, w)  # matrix products in bf16, from fp32 inputs
        assert y.dtype == torch.bfloat16 and (x @ w).dtype == torch.bfloat16
        # norms, softmax, exp, pow, losses in fp32 from bf16 inputs (CPU autocast keeps these in bf16)
        assert (
            F.layer_norm(h, (8,)).dtype == F.softmax(h, -1).dtype == h.exp().dtype == h.pow(2).dtype == torch.float32
        )
        assert F.gelu(h).dtype == torch.bfloat16 and h.sum().dtype == torch.bfloat16  # the others as they come
        assert F.softmax(h, -1, dtype=torch.bfloat16).dtype == torch.bfloat16  # an explicit dtype wins
    saved = [getattr(y.grad_fn, n) for n in dir(y.grad_fn) if n.startswith("_saved_")]
    saved = [t for t in saved if isinstance(t, torch.Tensor)]
    assert saved and all(t.dtype == torch.bfloat16 for t in saved)  # autograd saved the bf16 copies, as on a GPU


def test_gpu_attention_keeps_what_flash_attention_keeps():
    # the math path a CPU or meta tensor takes keeps the N x N attention for the backward (8 MiB here); the GPU's
    # kernels keep the output and its log-sum-exp (O(N)): the plan traces the GPU's
    q = torch.randn(1, 4, 1024, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    peaks = []
    for modes in ([], [GpuAttention()]):
        mem = LiveMemory()
        with mem:
            for mode in modes:
                mode.__enter__()
            out = F.scaled_dot_product_attention(q, q, q)
            mask = torch.ones(1, 1, 1024, 1024, dtype=torch.bool, device="meta")
            masked = F.scaled_dot_product_attention(q, q, q, attn_mask=mask) if modes else out
            (out.float().sum() + masked.float().sum()).backward()
            for mode in modes:
                mode.__exit__(None, None, None)
        peaks.append(mem.peak)
    matrix = 1024 * 1024 * 4 * 2  # one call's attention weights in bf16
    assert peaks[0] > 5 * matrix and peaks[1] < matrix  # both calls, the masked one with its bias, under one matrix


def _library_split(hidden: torch.Tensor, mask: torch.Tensor):
    """What diffusers' Qwen-Image 2.1 prompt encoding does: each row's tokens by its mask, split by the counts."""
    bool_mask = mask.bool()
    return torch.split(hidden[bool_mask], bool_mask.sum(dim=1).tolist(), dim=0)


def test_a_library_reads_back_small_host_made_tensors_and_flowrl_s_own_reads_still_raise():
    import flowrl

    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])  # a tokenizer's padding mask, on the host
    hidden = torch.zeros(2, 4, 8, device="meta")  # activations (made before the trace here): no host copy
    with HostValues():
        meta_mask = mask.to("meta")  # the run moves it to its device
        assert host_value(meta_mask) is not None and host_value(hidden) is None
        rows = _library_split(hidden, meta_mask)
        assert [r.shape for r in rows] == [(2, 8), (3, 8)]  # the mask's own counts, not every element
        positions = torch.arange(4, device="meta")  # made on the device from host values: known too
        assert int((positions * meta_mask[1]).sum()) == 3  # 0 + 1 + 2
        counts = torch.tensor([1, 2, 3], device="meta")
        assert torch.repeat_interleave(hidden[0, :3], counts, dim=0).shape == (6, 8)  # by counts the host knows
        written = torch.zeros(4, dtype=torch.long, device="meta")
        written[1:3] = 7  # in-place writes reach the copy
        assert written.tolist() == [0, 7, 7, 0]
        written[0] = hidden[0, 0, :1].long()  # ... unless what is written is not known: the copy is dropped
        assert host_value(written) is None
        # code in flowrl's package reads back as it would on a GPU: it must raise (a host sync)
        code = compile("def read(t):\n    return t.tolist()\n", str(Path(flowrl.__file__).parent / "x.py"), "exec")
        namespace = {}
        exec(code, namespace)
        with pytest.raises((RuntimeError, NotImplementedError)):
            namespace["read"](meta_mask)


def test_the_trace_modes_stay_on_in_a_checkpointed_block_s_recomputation():
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils.checkpoint import checkpoint

    seen = []
    linear = torch.nn.Linear(4, 4, device="meta")

    def block(t):
        seen.append(len(_get_current_function_mode_stack()))
        return linear(t).relu()

    x = torch.randn(2, 4, device="meta", requires_grad=True)
    with GpuAttention(), CudaAutocast():
        y = checkpoint(block, x, use_reentrant=False)
        y.float().sum().backward()  # the recomputation saves what the forward saved (bf16), or checkpoint raises
    assert seen == [2, 2] and linear.weight.grad.dtype == torch.float32


BENCH_SD3 = {
    "trainer": "flow_grpo",
    "model": {
        "name": "stabilityai/stable-diffusion-3.5-medium",
        "dtype": "bf16",
        "lora_rank": 32,
        "lora_alpha": 64,
        "offload_text_encoders": True,
        "options": {"max_sequence_length": 256},
    },
    "sampling": {"num_steps": 10, "guidance_scale": 4.5, "height": 512, "width": 512, "forward_batch_size": 8},
    "prompts": {"prompts_per_epoch": 1, "group_size": 16},
    "batch": {"mini_batch_size": 16, "micro_batch_size": 4, "backward": "per_step"},
    "rewards": [{"name": "jpeg_compressibility"}],
    "run": {"mixed_precision": "bf16", "log_with": []},
}
"""What `benchmarks/gpu_bench.py` measured on one H100 (2026-11-27, benchmarks/results/gpu/ and the GPU issue): SD3.5-M
LoRA r32 in bf16 at 512 px, 10 steps, group 16; rollouts in calls of 8 prompts (16 rows with CFG): peak 5.4 GiB;
training one step at a time on 4 samples (8 rows) with peft's fp32 input casts: peak 26.2 GiB. Its text encoders and
VAE were tiny (offloaded here: not on the GPU)."""


@pytest.mark.models  # two plans of a 2.2B network: about a minute (CI's second tier)
@pytest.mark.long
def test_the_plan_is_within_20_percent_of_what_an_h100_measured(monkeypatch):
    import flowrl.image.modality as modality

    config = load_config(BENCH_SD3)
    default = plan(config)  # today's default: no input casts under mixed precision
    original = modality.prepare_training
    monkeypatch.setattr(
        modality,
        "prepare_training",
        lambda policy, model, seed=0, mixed_precision="no": original(policy, model, seed, "no"),
    )  # the measurement kept peft's casts
    measured = plan(config)
    phases = {p.name: p.bytes / GiB for p in measured.phases}
    assert phases["rollout"] == pytest.approx(5.4, rel=0.2)
    assert phases["update"] == pytest.approx(26.2, rel=0.2)
    # the casts cost memory, their absence none of the numbers (tests/models/test_memory_modes.py)
    assert {p.name: p.bytes / GiB for p in default.phases}["update"] < phases["update"]


def test_flowrl_plan_prints_every_phase_and_what_fits(capsys, monkeypatch):
    from flowrl.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["plan", "configs/sd35m/tiny.yaml", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    for phase in ("load", "text encoding", "rollout", "decode", "update", "optimizer step"):
        assert re.search(rf"^\| {phase} \| \d+\.\d \|", out, re.M), out
    assert "on 2 GPUs of 80 GiB" in out and "fits; largest batch.micro_batch_size that fits:" in out
    assert main(["plan", "configs/sd35m/tiny.yaml", "--gpu-memory", "0.0001"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


def test_a_refused_setting_fails_as_the_run_would():
    config = load_config("configs/sd35m/tiny.yaml", ["run.shard=zero3", "ema_decay=0.9"])
    with pytest.raises(ValueError, match="run.shard: zero3 is not supported here: ema_decay"):
        plan(config, gpus=2)
    plan(config, gpus=1)  # one process shards nothing


def test_an_update_fitted_on_host_data_with_host_reads_is_refused_in_one_line():
    # DPOK fits its value network on its CPU replay buffer before each update and logs the loss (host reads there by
    # design, once per epoch): the plan says so rather than planning a different update
    with pytest.raises(ValueError, match=r"^dpok fits its auxiliary networks \(value\) on data in CPU memory"):
        plan(load_config("configs/sd15/tiny.yaml", ["trainer=dpok"]))


def test_the_docs_plan_table_is_the_benchmark_s_results():
    """docs/models.md's table of every recipe's plan is what benchmarks/plan_recipes.py wrote (rerun it, then paste
    its table, when a recipe or the planner changes)."""
    import importlib.util
    import json

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("plan_recipes", root / "benchmarks" / "plan_recipes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = json.loads((root / "benchmarks" / "results" / "plan_recipes.json").read_text())
    table = module.markdown(results["rows"], [1, 8], results["gpu_memory"])
    assert table in (root / "docs" / "models.md").read_text()
    shipped = {p.relative_to(root / "configs").as_posix() for p in module.recipes()}
    assert {r["recipe"] for r in results["rows"]} == shipped, "a recipe was added or removed: rerun the benchmark"


def test_train_checks_the_plan_first_on_a_gpu(monkeypatch):
    config = load_config("configs/sd35m/tiny.yaml")
    assert check_fits(config) is None  # no GPU here: nothing checked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=2**30))
    assert check_fits(config).fits()  # the tiny model fits in 1 GiB
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=2**16))
    with pytest.raises(WillNotFit, match=r"^the \w+( \w+)? phase needs .* GiB per GPU.*set .*run.check_memory: false"):
        check_fits(config)
    config.run.check_memory = False
    assert check_fits(config) is None


def test_train_traces_a_plan_once_and_reads_it_after(monkeypatch, tmp_path):
    """Every process of a launch and every resume checks the same plan: the first traces it, the others read it from
    the cache folder; another config, code or GPU traces anew, and a damaged file is traced again."""
    import flowrl.plan.plan_cache as plan_cache

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=2**30))
    traced = []
    original = plan_cache.plan
    monkeypatch.setattr(plan_cache, "plan", lambda *a, **k: traced.append(1) or original(*a, **k))
    config = load_config("configs/sd35m/tiny.yaml")
    first = check_fits(config)
    files = list((tmp_path / "plans").glob("*.json"))
    assert len(traced) == 1 and len(files) == 1
    config.run.output_dir = str(tmp_path / "another-run")  # a resume or another run folder: the same trace
    assert check_fits(config) == first and len(traced) == 1
    files[0].write_text("{")  # a process killed while writing (the write is atomic, but a disk can fail)
    assert check_fits(config) == first and len(traced) == 2
    config.batch.micro_batch_size = 4  # the trace reads it (8 in the file)
    check_fits(config)
    assert len(traced) == 3 and len(list((tmp_path / "plans").glob("*.json"))) == 2
    monkeypatch.setattr(plan_cache, "_source_digest", lambda: "edited")  # flowrl's code changed
    check_fits(config)
    assert len(traced) == 4
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")  # a cache folder that cannot be made: traced, not kept, no error
    assert check_fits(config).fits() and len(traced) == 5


def _stated_processes(path: Path) -> int:
    match = re.search(r"--(?:num_processes|nproc_per_node)[ =](\d+)", path.read_text())
    return int(match.group(1)) if match else 1


RECIPES = sorted(
    p
    for p in (ROOT / "configs").rglob("*.yaml")
    if p.parent.name not in ("digits", "control", "llm", "accelerate") and p.name != "tiny.yaml"
)


@pytest.mark.models
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.relative_to(ROOT / "configs").as_posix())
def test_every_shipped_recipe_assembles_at_its_process_count_without_weights(path, tmp_path):
    # the run's own checks at the process count the recipe states (sharding, EMA, groups over processes), the
    # policy at its published real size on meta with the recipe's LoRA, precision and options, the algorithm's
    # checks, its sampler and update scheduler: a refusal or an unknown option fails here, not on 8 GPUs
    from flowrl.plan.phases import Assembly

    config = load_config(path)
    parts = Assembly(config, _stated_processes(path), tmp_path)
    assert parts.params and all(p.device.type == "meta" for p in parts.params)
    assert sum(p.numel() for p in parts.policy.model.parameters()) > 5e8  # a real-size network


@pytest.mark.models  # a 20B network's plan: about a minute
@pytest.mark.long
def test_the_readme_s_plan_command_runs_as_printed(capsys, monkeypatch):
    import shlex

    from flowrl.cli import main

    monkeypatch.chdir(ROOT)
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith("flowrl plan "))
    args = shlex.split(line.split("#")[0])[1:]
    assert main(args) == 0  # Qwen-Image on 8 GPUs with FSDP2 fits
    assert "on 8 GPUs of 80 GiB" in capsys.readouterr().out
