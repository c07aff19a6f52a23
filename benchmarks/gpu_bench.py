"""Throughput of flowrl's own training loop on real-size networks of each model family (GPU).

Each family runs flowrl's engine, collector, update scheduler and step kernels (`build_trainer(config, policy=...)`),
not a re-implementation: a LoRA run (rank `--lora-rank`, bf16 weights and mixed precision, the family's defaults:
attention backend `auto`, backward per step, text encoders offloaded from 8B) whose network is the published
architecture (`flowrl.models.published`) built on the GPU with random weights: no hub, no download. The reward is a
cheap function of the images on the GPU (their mean), so the update and the rollout are what is timed.

Per family and epoch: the seconds of each phase (rollout, reward, update; `time/*` of the metrics row, each ended by a
device synchronisation), the peak memory of each (`memory/*`), images per second per GPU end to end, and the model FLOP
utilisation two ways: executed FLOPs (`flowrl plan`'s count on meta tensors, matrix products, convolutions and
attention, no GPU memory spent) over the phase's time, and verl-omni's `6 N T` (2 N T for forward-only rollouts): `N`
the trained network's parameters, `T` its tokens (the latent tokens of every call, both CFG branches). Beside each the
peaks `flowrl plan` predicts for the same config, to check the plan against the GPU.

    python benchmarks/gpu_bench.py [--models sd3,flux,qwen_image,wan] [--group 8] [--steps 10] [--epochs 2]
    python benchmarks/gpu_bench.py --tiny       # the tiny families on the CPU: checks the script runs

Writes `benchmarks/results/gpu/gpu_bench.json` (or `--out`) after every phase, so a run cut short keeps what it
measured, and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = {
    "sd3": dict(name="stabilityai/stable-diffusion-3.5-medium", guidance=4.5, size=512, text=256),
    "flux": dict(name="black-forest-labs/FLUX.1-dev", guidance=3.5, size=512, text=512, checkpointing=True),
    "qwen_image": dict(name="Qwen/Qwen-Image", guidance=4.0, size=512, text=512, checkpointing=True),
    "z_image": dict(name="Tongyi-MAI/Z-Image", guidance=5.0, size=512, text=512),
    "sana": dict(name="Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers", guidance=4.5, size=1024, text=300),
    "sdxl": dict(name="stabilityai/stable-diffusion-xl-base-1.0", guidance=5.0, size=1024, sampler="ddim"),
    "wan": dict(name="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", guidance=5.0, size=256, text=512, frames=5),
}
"""Per family: the published checkpoint whose architecture is built, CFG (or FLUX's guidance embedding), the
training resolution of the peers' recipes, text tokens, the sampler where the flow SDE does not fit (SDXL's DDIM steps,
as configs/sdxl/ samples), Wan's frames (Flow-Factory's wan21 t2v: 256 px, 5 frames), and
gradient checkpointing where the recipes set it (a 12B+ network's activations at a micro-batch of 2)."""


def config_for(family: str, args) -> dict:
    """The run config of `family` at the bench's sizes."""
    from flowrl.models.families import MODEL_FAMILIES

    s = FAMILIES[family]
    fields = MODEL_FAMILIES.get(family).Options.__dataclass_fields__
    options = {"max_sequence_length": 16 if args.tiny else s.get("text"), "num_frames": s.get("frames")}
    options = {k: v for k, v in options.items() if k in fields and v is not None}
    return {
        "trainer": "flow_grpo",
        "model": {
            "name": f"tiny:{family}" if args.tiny else s["name"],
            "dtype": "fp32" if args.tiny else "bf16",
            "lora_rank": args.lora_rank,
            "lora_alpha": 2 * args.lora_rank,
            "options": options,
            "gradient_checkpointing": bool(s.get("checkpointing")) and not args.tiny,
            "compile": args.compile,
        },
        "sampling": {
            "num_steps": args.steps,
            "guidance_scale": s["guidance"],
            "noise_level": 0.7,
            "height": 64 if args.tiny else s["size"],
            "width": 64 if args.tiny else s["size"],
            "forward_batch_size": args.forward_batch or None,
            **({"sampler": s["sampler"]} if "sampler" in s else {}),
        },
        "prompts": {
            "train": "drawbench_style",
            "test": "drawbench_style",
            "prompts_per_epoch": 1,
            "group_size": args.group,
        },
        "batch": {"mini_batch_size": args.group, "micro_batch_size": args.minibatch},
        "rewards": [{"name": "jpeg_compressibility"}],
        "eval": {"every": 0, "max_prompts": 1, "samples_per_prompt": 1},
        "optim": {"lr": 1e-5},
        "run": {
            "epochs": 10_000,
            "log_with": [],
            "mixed_precision": "no" if args.tiny else "bf16",
            "check_memory": False,
        },
    }


def image_mean(images, prompts, **metadata):
    """The bench's reward: each image's (video's) mean, on its device (no host round trip to time)."""
    return images.float().flatten(1).mean(1)


def build_policy(config, device):
    """The family's pipeline at its published size with random weights, built on `device`, set up as a run sets it
    up (attention backend, LoRA, precision, checkpointing, text encoders offloaded for 8B+ networks)."""
    from flowrl.models.attention import configure_attention
    from flowrl.models.published import build_pipeline
    from flowrl.policies import DiffusionPolicy
    from flowrl.policies.build import DTYPES, offloads_text, prepare_training
    from flowrl.prompts import load

    m = config.model
    pipe = build_pipeline(m.name, family=m.family, dtype=DTYPES[m.dtype], device=device)
    pipe.to(device)
    policy = DiffusionPolicy.from_pipeline(pipe, options=m.options, forward_batch_size=config.batch.micro_batch_size)
    configure_attention(policy.model, m.attention_backend, family=policy.family)
    if offloads_text(m, policy, device):  # the prompts encoded once, the encoders to CPU memory
        policy.encode([str(p) for p in load(config.prompts.train)])
        policy.encode([policy.negative_prompt], negative=True)
        policy.offload_text_encoders()
    return prepare_training(policy, m, seed=config.run.seed, mixed_precision=config.run.mixed_precision)


def tokens_per_sample(policy, config, latents) -> float:
    """The trained network's tokens in one sample's call (its latent's patches; FLUX's packed latents are tokens
    already), both CFG branches counted: verl-omni's `T`."""
    import math

    shape = latents.shape[2:]  # one state: [C, h, w], [C, F, h, w] or packed [L, D]
    if len(shape) == 2:
        per_call = shape[0]
    else:
        spatial = shape[1:]
        patch = getattr(getattr(policy.model, "config", None), "get", lambda *a: 1)("patch_size", 1) or 1
        patch = tuple(patch) if isinstance(patch, (list, tuple)) else (patch,) * len(spatial)
        patch = (1,) * (len(spatial) - len(patch)) + patch
        per_call = math.prod(s // p for s, p in zip(spatial, patch))
    return per_call * (2 if policy.adapter.uses_cfg(config.sampling.guidance_scale) else 1)


def compile_drift(trainer, config) -> dict:
    """`model.compile`: a rollout (the compiled inference graphs) re-scored with gradient (the compiled training
    graphs) at the same weights: the largest |log-ratio|, against the shipped clip ranges (Flow-GRPO 1e-4 at SD3's
    latent size, GRPO-Guard 2e-6)."""
    policy, s = trainer.policy, config.sampling
    with trainer.engine.autocast():
        rollout = policy.rollout(
            ["a photo of a cat", "a photo of a dog"],
            num_steps=s.num_steps,
            guidance_scale=s.guidance_scale,
            noise_level=s.noise_level,
            height=s.height,
            width=s.width,
            generator=torch.Generator().manual_seed(0),
        )
        # one step per call, its graph freed at once (all steps' graphs together hold every activation: 139 GB)
        steps = rollout.sde_steps.tolist()
        logp = [policy.log_prob(rollout, torch.tensor([k]).expand(len(rollout), 1)).detach() for k in steps]
    drift = float((torch.cat(logp, 1) - rollout.log_probs[:, steps]).abs().max())
    return {"max_abs_log_ratio": drift, "of_flow_grpo_clip": drift / 1e-4, "of_grpo_guard_clip": drift / 2e-6}


KERNEL_KINDS = (
    ("matmul", ("gemm", "matmul", "cutlass", "xmma", "nvjet", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
    ("attention", ("flash", "fmha", "attention", "efficient", "scaled_dot_product")),
    ("convolution", ("conv", "cudnn")),
)
"""Where a profiled epoch's device time goes, by kernel (CUDA) or operator (CPU) name; the rest is `other`."""


_BOOKKEEPING = frozenset(  # the profiler's own records and autograd's attribute reads: left out of key_averages()
    "[memory] [OutOfMemory] profiler::_record_function_enter profiler::_record_function_enter_new "
    "profiler::_record_function_exit aten::is_leaf aten::output_nr aten::_version".split()
)


def own_times(prof, cuda: bool) -> dict[str, list]:
    """Each kernel's (CUDA) or operator's (CPU) name -> [calls, own us], as `key_averages()` counts them, from the raw
    events (it built an object per event, 70 us each). A kernel's own time is its duration (one stream); an operator's,
    its duration less its direct children's on its thread (one ending on another thread nests nothing)."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == kind
        and e.name() not in _BOOKKEEPING
        and not e.is_hidden_event()
        and (cuda or (not e.is_async() and e.start_thread_id() == e.end_thread_id()))
    ]
    own, calls = {id(e): e.duration_ns() for e in events}, {}
    if not cuda:  # nested operators: each one's children found by a stack per thread, in start order
        events.sort(key=lambda e: (e.start_thread_id(), e.start_ns(), -e.end_ns()))
        stack: list = []
        for e in events:
            while stack and (stack[-1].start_thread_id() != e.start_thread_id() or stack[-1].end_ns() <= e.start_ns()):
                stack.pop()
            if stack:
                own[id(stack[-1])] -= e.duration_ns()
                if stack[-1].name() == e.name():  # one call seen twice by the dispatcher: counted once, as torch does
                    calls[id(e)] = 0
            stack.append(e)
    rows: dict[str, list] = {}
    for e in events:
        row = rows.setdefault(e.name(), [0, 0.0])
        row[0] += calls.get(id(e), 1)
        row[1] += own[id(e)] / 1e3
    return rows


def _device_split(rows: dict[str, list]) -> dict:
    """One profiled phase: the device's busy time (the sum of its kernels' own times: one stream, so they do not
    overlap) split by `KERNEL_KINDS`, and the kernels launched (many short ones: launch-bound)."""
    split = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    for name, (_, micros) in rows.items():
        lower = name.lower()
        kind = next((k for k, words in KERNEL_KINDS if any(w in lower for w in words)), "other")
        split[kind] += micros / 1e6
    launches = sum(calls for calls, _ in rows.values())
    return {"busy_s": sum(split.values()), "kernels": launches, **{f"{k}_s": v for k, v in split.items()}}


def profile_epoch(trainer, epoch: int, device: torch.device) -> tuple[dict, str]:
    """One more epoch under `torch.profiler`, its two phases apart (the rollout with its reward, then the update):
    each phase's wall time, the device's busy share and its split (`_device_split`), and the top-25 tables. A busy
    share far below 1 means the GPU waits for the host (launches, syncs); a matmul share far below the busy time
    means small or memory-bound kernels. On the CPU the operators' own CPU times stand in for the kernels'."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]  # the host's events: slow, unused
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    summary, tables = {}, []
    trainer.engine.set_lr(trainer.config.optim.lr_at(epoch, trainer.config.run.epochs))
    phases = {
        "rollout": lambda: trainer.prepare_epoch(epoch),
        "update": lambda: trainer.scheduler.run(batch, epoch),
    }
    for phase, run in phases.items():
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            out = run()
            sync()
        wall = time.perf_counter() - start
        if phase == "rollout":
            batch = out[0]
        rows = own_times(prof, cuda)
        split = _device_split(rows)
        summary[phase] = {"wall_s": wall, "busy_share": split["busy_s"] / wall, **split}
        top = sorted(rows.items(), key=lambda item: -item[1][1])[:25]  # the kernels of most own time
        busy = max(split["busy_s"], 1e-9)
        body = "".join(f"\n| {n[:100]} | {c} | {us / 1e3:.2f} | {us / 1e6 / busy:.1%} |" for n, (c, us) in top)
        tables.append(f"## {phase}\n\n| kernel | calls | own ms | share |\n| --- | ---: | ---: | ---: |{body}")
    return summary, "\n\n".join(tables)


def bench(family: str, args, device: torch.device, write) -> dict:
    from flowrl.plan import plan
    from flowrl.trainers import build_trainer, load_config

    result = {"model": family}
    with tempfile.TemporaryDirectory() as folder:
        from flowrl.config import apply_overrides

        raw = apply_overrides(config_for(family, args), list(args.set))
        config = load_config(raw, [f"run.output_dir={folder}"])
        for override in args.set:  # each override as the loaded config holds it
            path, value = override.partition("=")[0], config
            for part in path.split("."):
                value = value[part] if isinstance(value, dict) else getattr(value, part)
            result.setdefault("settings", {})[path] = value
        key = json.dumps({"config": raw, "gpu_memory": args.gpu_memory}, sort_keys=True)
        cache = json.loads(Path(args.plans).read_text()) if args.plans and Path(args.plans).exists() else {}
        if key not in cache:  # meta tensors: FLOPs and peaks, no GPU memory (CPU work: cacheable off the GPU machine)
            predicted = plan(config, gpu_memory=args.gpu_memory)
            cache[key] = {
                "plan_gb": {p.name: round(p.bytes / 2**30, 2) for p in predicted.phases},
                "flops_per_sample": predicted.flops,
            }
            if args.plans:
                Path(args.plans).write_text(json.dumps(cache, indent=1, sort_keys=True))
        result.update(cache[key])
        write(result)
        if args.plan_only:
            return result
        policy = build_policy(config, device)
        params = sum(p.numel() for p in policy.model.parameters())
        result["params_b"] = params / 1e9
        trainer = build_trainer(config, policy=policy, reward_fns={"jpeg_compressibility": image_mean}, eval_fns={})
        trainer.engine.model.train()
        if args.compile:
            result["compile_drift"] = compile_drift(trainer, config)
            write(result)
        for epoch in range(args.epochs + 1):  # epoch 0: warm-up (kernels, caches, allocator)
            row = trainer.train_epoch(epoch)
            if epoch == 0:
                result["warmup_s"] = row["time_s"]
                write(result)
                continue
            times = {k.split("/")[1]: row[k] for k in ("time/sample_s", "time/reward_s", "time/train_s")}
            result.setdefault("epochs", []).append(
                {**times, "time_s": row["time_s"], **{k: row[k] for k in row if k.startswith("memory/")}}
            )
            write(result)
        if args.profile:  # one more epoch under the profiler: where the device's time goes
            summary, table = profile_epoch(trainer, args.epochs + 1, device)
            result["profile"] = summary
            folder = Path(args.profile)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"profile_{Path(args.out).stem}_{family}.txt").write_text(table)
            write(result)
        last = result["epochs"][-1]
        peak = args.peak_tflops * 1e12
        latents = trainer.last_batch.data.latents
        tokens = tokens_per_sample(policy, config, latents)
        steps, trained = config.sampling.num_steps, int(trainer.last_batch.data.mask[0].sum())
        total = last["sample_s"] + last["reward_s"] + last["train_s"]
        result.update(
            {
                "group": args.group,
                "images_per_s": args.group / total,
                "rollout_images_per_s": args.group / last["sample_s"],
                "update_images_per_s": args.group / last["train_s"],
                "rollout_mfu": result["flops_per_sample"]["rollout"] * args.group / last["sample_s"] / peak,
                "update_mfu": result["flops_per_sample"]["update"] * args.group / last["train_s"] / peak,
                "rollout_mfu_6nt": 2 * params * tokens * steps * args.group / last["sample_s"] / peak,
                "update_mfu_6nt": 6 * params * tokens * trained * args.group / last["train_s"] / peak,
                "measured_gb": {
                    k.removeprefix("memory/").removesuffix("_gb"): round(v, 2)
                    for k, v in last.items()
                    if k.startswith("memory/")
                },
            }
        )
        write(result)
        del trainer, policy
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="sd3,flux,qwen_image,wan", help=f"comma-separated: {', '.join(FAMILIES)}")
    parser.add_argument("--group", type=int, default=16, help="samples per epoch (one GRPO group)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--minibatch", type=int, default=4, help="batch.micro_batch_size: samples per training call")
    parser.add_argument(
        "--forward-batch", type=int, default=0, help="sampling.forward_batch_size (0: the micro-batch)"
    )
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs after one warm-up epoch")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU, for the plan beside")
    parser.add_argument("--compile", action="store_true", help="model.compile: also measure its ratio drift")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override (repeatable), e.g. model.lora_dtype=bf16 sampling.uncond_grad=false",
    )
    parser.add_argument(
        "--profile", default="", help="a folder: profile one more epoch, its top kernels in profile_<out>_<model>.txt"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny families on the CPU (a smoke test of the script)"
    )
    parser.add_argument(
        "--plans", default="", help="a JSON cache of flowrl plan's results per config (read; missing ones added)"
    )
    parser.add_argument(
        "--plan-only", action="store_true", help="only fill --plans (no GPU needed: plan on a CPU machine beforehand)"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu" / "gpu_bench.json"))
    args = parser.parse_args(argv)
    if not (args.tiny or args.plan_only) and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (use --tiny for the CPU smoke run)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny or args.plan_only else "cuda")
    meta = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "tiny": args.tiny,
        "peak_tflops": args.peak_tflops,
        "args": vars(args),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, failed = [], []

    def write(current=None) -> None:  # after every phase: a run cut short keeps what it measured
        if args.plan_only:  # nothing measured: the plans go to --plans
            return
        data = {"meta": meta, "results": rows + ([current] if current is not None else []), "failed": failed}
        out.write_text(json.dumps(data, indent=1, default=float))

    for name in args.models.split(","):
        start = time.perf_counter()
        try:
            rows.append(bench(name, args, device, write))
        except Exception as err:  # noqa: BLE001  (one family out of memory still leaves the others' numbers)
            if args.tiny or args.plan_only:
                raise
            failed.append({"model": name, "error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"})
            print(f"{name}: {failed[-1]['error']}", file=sys.stderr)
            traceback.print_exc()
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        gc.collect()
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        write()
    if args.plan_only:
        print(f"wrote {args.plans or '(no --plans file)'}: " + ", ".join(r["model"] for r in rows))
        return 0
    print(
        "| model | params (B) | images/s | rollout img/s | update img/s | rollout MFU (exec / 6NT) | update MFU "
        "(exec / 6NT) | peaks GiB measured (planned): rollout+decode, update |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        m, p = r.get("measured_gb", {}), dict(r.get("plan_gb", {}))
        # the run's rollout peak covers its decoding: the plan's larger of the two phases
        p["rollout"] = max(p.get("rollout", float("nan")), p.get("decode", 0.0))
        print(
            f"| {r['model']} | {r.get('params_b', 0):.2f} | {r['images_per_s']:.2f} | {r['rollout_images_per_s']:.2f} "
            f"| {r['update_images_per_s']:.2f} | {r['rollout_mfu']:.1%} / {r['rollout_mfu_6nt']:.1%} | "
            f"{r['update_mfu']:.1%} / {r['update_mfu_6nt']:.1%} | {m.get('rollout', float('nan')):.1f} "
            f"({p.get('rollout', float('nan')):.1f}), {m.get('update', float('nan')):.1f} "
            f"({p.get('update', float('nan')):.1f}) |"
        )
    for r in rows:
        for phase, f in r.get("profile", {}).items():
            print(
                f"{r['model']} profiled {phase}: {f['wall_s']:.1f} s, device busy {f['busy_share']:.0%}, "
                f"{f['kernels']} kernels (matmul {f['matmul_s']:.2f} s, attention {f['attention_s']:.2f} s, "
                f"convolution {f['convolution_s']:.2f} s, other {f['other_s']:.2f} s)"
            )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
