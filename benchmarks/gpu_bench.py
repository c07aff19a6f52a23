"""Rollout and training throughput of flowrl's policy on real-sized networks of each model family (GPU).

The trained networks have the real models' widths and depths with random weights (no hub access needed;
`REAL_BODIES`); text encoders and the VAE are the family's tiny test components, so the numbers are the network's
cost, which dominates: it sees as many latent tokens as the real model at the peers' training resolution and the
real context lengths (`SETTINGS`: e.g. SD3 256 T5 tokens at 512 px, Flux 512 at 512 px, Wan 5 frames at 256 px).

- rollout: `DiffusionPolicy.rollout` of a group of `--group` samples (flow-SDE, `--steps` steps, CFG for SD3,
  Flux's guidance embedding), bf16 weights, SDPA attention;
- training: with a LoRA adapter (rank `--lora-rank`, alpha 2r, fp32 adapter weights), `DiffusionPolicy.score`
  of every step of every sample with gradient, one backward per step of each minibatch of `--minibatch` samples
  (flowrl's `batch.backward: per_step`; the per-step log-prob mean as the loss), then an AdamW step;
- images/s, peak GPU memory of each phase, and the model FLOP utilisation: FLOPs counted by
  `torch.utils.flop_counter` on one sample's forward (and forward+backward), times the calls, over the
  elapsed time and `--peak-tflops` (H100 SXM bf16 dense: 989).

    python benchmarks/gpu_bench.py [--models sd3,flux,qwen_image,...] [--group 24] [--steps 10] [--repeats 3]
    python benchmarks/gpu_bench.py --tiny        # the tiny test models on the CPU: checks the script runs

Writes `benchmarks/results/gpu_bench.json` (or `--out`) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl.policies import DiffusionPolicy  # noqa: E402


REAL_BODIES = {
    "sd3": dict(num_layers=24, attention_head_dim=64, num_attention_heads=24, caption_projection_dim=1536,
                pos_embed_max_size=384, sample_size=128, qk_norm="rms_norm", dual_attention_layers=tuple(range(13))),
    "flux": dict(num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                 axes_dims_rope=(16, 56, 56)),
    "qwen_image": dict(num_layers=60, attention_head_dim=128, num_attention_heads=24, axes_dims_rope=(16, 56, 56)),
    "z_image": dict(dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30, axes_dims=[32, 48, 48],
                    axes_lens=[1536, 512, 512]),
    "sana": dict(num_layers=20, num_attention_heads=70, attention_head_dim=32, num_cross_attention_heads=20,
                 cross_attention_head_dim=112, cross_attention_dim=2240, mlp_ratio=2.5),
    "sdxl": dict(block_out_channels=(320, 640, 1280), layers_per_block=2,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10), norm_num_groups=32),
    "wan": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
}  # fmt: skip
"""Each family's trained network at its real depth and width (SD3.5-Medium 2.2B, FLUX.1-dev 11.9B, Qwen-Image 20.4B,
Z-Image 6.2B, SANA-1.6B, SDXL's UNet 2.2B, Wan2.1-T2V-1.3B 1.4B counted here), from the published model configs as
recalled (not read from the hub: UNVERIFIED), with the tiny pipeline's input-side widths (latent channels, text
widths); random weights. The FLOPs per token are the real model's; the parameter counts come out within 15%."""
SETTINGS = {
    "sd3": dict(guidance=4.5, text=256, size=512), "flux": dict(guidance=3.5, text=512, size=512),
    "qwen_image": dict(guidance=4.0, text=512, size=512), "z_image": dict(guidance=5.0, text=512, size=512),
    "sana": dict(guidance=4.5, text=300, size=1024, vae=32), "sdxl": dict(guidance=5.0, text=None, size=1024),
    "wan": dict(guidance=5.0, text=512, size=256, frames=5),
}  # fmt: skip
"""Per family: CFG (or Flux's embedding), text tokens, the training resolution of the peers' recipes (the network sees
that many latent tokens: the tiny VAE's size is scaled to the real VAE's downsampling, `vae`, default 8) and
Wan's frames (Flow-Factory's wan21 t2v: 256 px, 5 frames)."""


def pipeline(name: str, tiny: bool, device=None, dtype=None):
    """`(pipeline, settings, image size)`: the tiny pipeline, its network replaced by a full-size one with random
    weights (unless tiny), built straight on `device` in `dtype` (a 20B network never exists in fp32 on the CPU)."""
    from flowrl.models.families import MODEL_FAMILIES

    cls = MODEL_FAMILIES.get(name)
    pipe = cls.tiny(seed=0)
    settings = SETTINGS[name]
    slot = cls.lora_prefix if cls.lora_prefix in pipe.components else "transformer"
    if not tiny:
        small = pipe.components[slot]
        config = {k: v for k, v in dict(small.config).items() if not k.startswith("_")}
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                setattr(pipe, slot, type(small)(**{**config, **REAL_BODIES[name]}))
        finally:
            torch.set_default_dtype(default)
    vsf = getattr(pipe, "vae_scale_factor_spatial", None) or pipe.vae_scale_factor
    size = 64 if tiny else settings["size"] * vsf // settings.get("vae", 8)
    return pipe, settings, size


def count_flops(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def bench(name: str, args, device: torch.device) -> dict:
    dtype = torch.float32 if args.tiny else torch.bfloat16
    from flowrl.models.families import MODEL_FAMILIES

    pipe, settings, side = pipeline(name, args.tiny, device, dtype)
    guidance = settings["guidance"]
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device=device, dtype=dtype)
    fields = MODEL_FAMILIES.get(name).Options.__dataclass_fields__
    options = {"max_sequence_length": 16 if args.tiny else settings["text"], "num_frames": settings.get("frames")}
    options = {k: v for k, v in options.items() if k in fields and v is not None}
    policy = DiffusionPolicy.from_pipeline(pipe, options=options, forward_batch_size=args.forward_batch)
    params = sum(p.numel() for p in policy.model.parameters())
    size = dict(height=side, width=side)
    sampler = MODEL_FAMILIES.get(name).default_sampler
    prompts = [f"a photo of object {i % 4}" for i in range(args.group)]

    def rollout(n=args.group):
        return policy.rollout(prompts[:n], num_steps=args.steps, guidance_scale=guidance, sampler=sampler,
                              noise_level=0.7, generator=torch.Generator().manual_seed(0), **size)  # fmt: skip

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
        # one sample's FLOPs: a rollout re-scores in its own chunks, so the counted one is sampled in chunks of 1
        policy.forward_batch_size = 1
        one = rollout(1)
        policy.forward_batch_size = args.forward_batch
        steps = one.sde_mask.nonzero().flatten()
        fwd_flops = count_flops(lambda: policy.score(one, steps[None, :]))  # every step of one sample, CFG incl.

    # training: LoRA, every step of every sample with gradient
    policy.add_lora(rank=args.lora_rank, alpha=2 * args.lora_rank)
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    # a training forward is one minibatch (flowrl: batch.micro_batch_size sets both), so no chunk is padded
    policy.forward_batch_size = args.minibatch
    with torch.no_grad():
        batch = rollout()
        policy.forward_batch_size = 1
        single = rollout(1)
    steps = batch.sde_mask.nonzero().flatten()

    def train():  # one backward per step of each minibatch (flowrl's batch.backward: per_step)
        for start in range(0, args.group, args.minibatch):
            rows = torch.arange(start, min(start + args.minibatch, args.group))
            part = batch.select(rows)
            for step in steps:
                with torch.autocast(device.type, dtype=dtype, enabled=not args.tiny):
                    out = policy.score(part, step.view(1, 1).expand(len(rows), -1))
                (-out.log_prob.float().mean() / len(steps)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train()  # warm-up
    peak_reset()
    train_s = statistics.median(timed(train)[0] for _ in range(args.repeats))
    train_peak = peak()

    def one_backward():
        for step in steps:
            out = policy.score(single, step.view(1, 1))
            (-out.log_prob.float().mean()).backward()

    with torch.autocast(device.type, dtype=dtype, enabled=not args.tiny):
        train_flops = count_flops(one_backward)
    optimizer.zero_grad(set_to_none=True)
    peak_flops = args.peak_tflops * 1e12
    return {
        "model": name,
        "image_size": side,
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
    parser.add_argument("--models", default="sd3,flux", help=f"families, comma-separated: {', '.join(SETTINGS)}")
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
    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "tiny": args.tiny, "peak_tflops": args.peak_tflops}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows, failed = [], []
    for name in args.models.split(","):
        try:
            rows.append(bench(name, args, device))
        except Exception as err:  # one family out of memory (say) still leaves the others' numbers
            if args.tiny:
                raise
            failed.append({"model": name, "error": f"{type(err).__name__}: {str(err)[:300]}"})
            print(f"{name}: {failed[-1]['error']}", file=sys.stderr)
            traceback.print_exc()
        gc.collect()  # a failed family's frames hold its model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # written after each family: a run cut short keeps what it measured
        Path(args.out).write_text(json.dumps({"meta": meta, "results": rows, "failed": failed}, indent=2))
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
