"""Rollout and training throughput of flowrl's policy on SD3.5-Medium- and Flux.1-sized transformers (GPU).

The transformers have the real models' widths and depths with random weights (no hub access needed); text
encoders and the VAE are flowrl's tiny test components, so the numbers are the transformer's cost, which
dominates: the transformer sees the latents of a 512 px image (16 x 64 x 64, 1024 image tokens) and the real
context lengths (SD3: 77 CLIP + 256 T5 tokens; Flux: 512 T5 tokens); the tiny VAE decodes them to 128 px.

- rollout: `DiffusionPolicy.rollout` of a group of `--group` samples (flow-SDE, `--steps` steps, CFG for SD3,
  Flux's guidance embedding), bf16 weights, SDPA attention;
- training: with a LoRA adapter (rank `--lora-rank`, alpha 2r, fp32 adapter weights), `DiffusionPolicy.score`
  of every step of every sample with gradient and one backward per minibatch of `--minibatch` samples (the
  per-step log-prob mean as the loss), then an AdamW step;
- images/s, peak GPU memory of each phase, and the model FLOP utilisation: FLOPs counted by
  `torch.utils.flop_counter` on one sample's forward (and forward+backward), times the calls, over the
  elapsed time and `--peak-tflops` (H100 SXM bf16 dense: 989).

    python benchmarks/gpu_bench.py [--models sd35m,flux] [--group 24] [--steps 10] [--repeats 3]
    python benchmarks/gpu_bench.py --tiny        # the tiny test models on the CPU: checks the script runs

Writes `benchmarks/results/gpu_bench.json` (or `--out`) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl.models import tiny_flux, tiny_sd3  # noqa: E402
from flowrl.policies import DiffusionPolicy  # noqa: E402


SD35M = dict(num_layers=24, attention_head_dim=64, num_attention_heads=24, caption_projection_dim=1536,
             pos_embed_max_size=384, sample_size=128, qk_norm="rms_norm",
             dual_attention_layers=tuple(range(13)))  # fmt: skip
"""SD3.5-Medium's transformer (2.5B parameters), apart from the text-side input widths."""
FLUX = dict(num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
            axes_dims_rope=(16, 56, 56))  # fmt: skip
"""Flux.1-dev's transformer (12B parameters), apart from the text-side input widths."""


def pipeline(name: str, tiny: bool):
    """The tiny pipeline, with its transformer replaced by a full-size one with random weights (unless tiny)."""
    if name == "sd35m":
        pipe = tiny_sd3()
        if not tiny:
            from diffusers import SD3Transformer2DModel

            small = pipe.transformer.config
            pipe.transformer = SD3Transformer2DModel(
                patch_size=2, in_channels=16, out_channels=16, joint_attention_dim=small.joint_attention_dim,
                pooled_projection_dim=small.pooled_projection_dim, **SD35M,
            )  # fmt: skip
        return pipe, 4.5, 256
    pipe = tiny_flux()
    if not tiny:
        from diffusers import FluxTransformer2DModel

        small = pipe.transformer.config
        pipe.transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, joint_attention_dim=small.joint_attention_dim,
            pooled_projection_dim=small.pooled_projection_dim, guidance_embeds=True, **FLUX,
        )  # fmt: skip
    return pipe, 3.5, 512


def count_flops(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def bench(name: str, args, device: torch.device) -> dict:
    dtype = torch.float32 if args.tiny else torch.bfloat16
    pipe, guidance, seq = pipeline(name, args.tiny)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device=device, dtype=dtype)
    policy = DiffusionPolicy.from_pipeline(pipe, max_sequence_length=16 if args.tiny else seq,
                                           forward_batch_size=args.forward_batch)  # fmt: skip
    params = sum(p.numel() for p in policy.model.parameters())
    size = dict(height=64, width=64) if args.tiny else dict(height=128, width=128)  # latents 16x(h/2)x(w/2)
    prompts = [f"a photo of object {i % 4}" for i in range(args.group)]

    def rollout(n=args.group):
        return policy.rollout(prompts[:n], num_steps=args.steps, guidance_scale=guidance, sampler="flow_sde",
                              generator=torch.Generator().manual_seed(0), **size)  # fmt: skip

    def timed(fn):
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        return time.perf_counter() - start, out

    def peak_reset():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def peak() -> float:
        return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")

    # rollout (base weights, no adapter yet)
    with torch.no_grad():
        rollout()  # warm-up: kernels, text-embedding cache
        peak_reset()
        rollout_s = statistics.median(timed(rollout)[0] for _ in range(args.repeats))
        rollout_peak = peak()
        one = rollout(1)
        steps = one.sde_mask.nonzero().flatten()
        fwd_flops = count_flops(lambda: policy.score(one, steps[None, :]))  # every step of one sample, CFG incl.

    # training: LoRA, every step of every sample with gradient
    policy.add_lora(rank=args.lora_rank, alpha=2 * args.lora_rank)
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    with torch.no_grad():
        batch = rollout()
    steps = batch.sde_mask.nonzero().flatten()

    def train():
        for start in range(0, args.group, args.minibatch):
            rows = torch.arange(start, min(start + args.minibatch, args.group))
            part = batch.select(rows)
            with torch.autocast(device.type, dtype=dtype, enabled=not args.tiny):
                out = policy.score(part, steps.expand(len(rows), -1))
            (-out.log_prob.float().mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train()  # warm-up
    peak_reset()
    train_s = statistics.median(timed(train)[0] for _ in range(args.repeats))
    train_peak = peak()

    def one_backward():
        out = policy.score(batch.select(torch.arange(1)), steps[None, :])
        (-out.log_prob.float().mean()).backward()

    with torch.autocast(device.type, dtype=dtype, enabled=not args.tiny):
        train_flops = count_flops(one_backward)
    optimizer.zero_grad(set_to_none=True)
    peak_flops = args.peak_tflops * 1e12
    return {
        "model": name,
        "transformer_params_b": params / 1e9,
        "group": args.group,
        "steps": args.steps,
        "lora_rank": args.lora_rank,
        "rollout_s": rollout_s,
        "rollout_images_per_s": args.group / rollout_s,
        "rollout_peak_gb": rollout_peak,
        "rollout_mfu": fwd_flops * args.group / rollout_s / peak_flops,
        "train_s": train_s,
        "train_images_per_s": args.group / train_s,
        "train_peak_gb": train_peak,
        "train_mfu": train_flops * args.group / train_s / peak_flops,
        "flops_per_sample_rollout": fwd_flops,
        "flops_per_sample_train": train_flops,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="sd35m,flux")
    parser.add_argument("--group", type=int, default=24, help="samples per rollout (one GRPO group)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--forward-batch", type=int, default=8, help="rows per transformer call in rollouts")
    parser.add_argument("--minibatch", type=int, default=4, help="samples per training backward")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM)")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (a smoke test of the script)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_bench.json"))
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (use --tiny for the CPU smoke run)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    if not args.tiny:
        torch.backends.cuda.matmul.allow_tf32 = True
    rows = [bench(name, args, device) for name in args.models.split(",")]
    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "tiny": args.tiny, "peak_tflops": args.peak_tflops}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print("| model | params (B) | rollout img/s | rollout peak GB | rollout MFU | train img/s | train peak GB | "
          "train MFU |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        print(f"| {r['model']} | {r['transformer_params_b']:.2f} | {r['rollout_images_per_s']:.2f} | "
              f"{r['rollout_peak_gb']:.1f} | {r['rollout_mfu']:.1%} | {r['train_images_per_s']:.2f} | "
              f"{r['train_peak_gb']:.1f} | {r['train_mfu']:.1%} |")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
