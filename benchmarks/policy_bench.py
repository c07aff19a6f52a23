"""Policy overheads, measured side by side in one process on the tiny SD3 and Flux models.

1. `DiffusionPolicy.rollout` (flow-SDE sampling that records every latent and per-step log-prob) against the
   diffusers pipeline's own sampling call with the same model, prompts, steps, guidance and image size.
   Reported cold (text-embedding cache cleared before each call, as the pipeline re-encodes every call)
   and warm (cache filled, as in training, where the same prompts come back).
2. `DiffusionPolicy.score` of one step (forward + step kernel + log-prob, with CFG) against one bare
   transformer forward on the same rows.

    python benchmarks/policy_bench.py [--repeats 20] [--batch 8] [--steps 10]
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


def interleaved(fns: dict, repeats: int) -> dict:
    for fn in fns.values():  # warm-up
        fn()
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_model(name, pipe, guidance, batch, steps, repeats):
    pipe.set_progress_bar_config(disable=True)
    policy = DiffusionPolicy.from_pipeline(pipe, max_sequence_length=16)
    prompts = [f"a photo of object {i % 4}" for i in range(batch)]
    size = dict(height=64, width=64)

    def pipeline_call():
        with torch.no_grad():
            pipe(
                prompts,
                num_inference_steps=steps,
                guidance_scale=guidance,
                output_type="pt",
                generator=torch.Generator().manual_seed(0),
                max_sequence_length=16,
                **size,
            )

    def rollout_warm():
        policy.rollout(
            prompts,
            num_steps=steps,
            guidance_scale=guidance,
            sampler="flow_sde",
            generator=torch.Generator().manual_seed(0),
            **size,
        )

    def rollout_cold():
        policy.clear_text_cache()
        rollout_warm()

    sample = interleaved(
        {"pipeline": pipeline_call, "rollout_cold": rollout_cold, "rollout_warm": rollout_warm}, repeats
    )

    generator = torch.Generator().manual_seed(0)
    rollout = policy.rollout(prompts, num_steps=steps, guidance_scale=guidance, generator=generator, **size)
    step = 2
    x = rollout.latents[:, step]
    t = rollout.timesteps[step].expand(batch)
    cond = {k: v[rollout.prompt_ids] for k, v in rollout.cond.items()}
    null = rollout.null_cond

    def bare_forward():
        with torch.no_grad():
            if null is None:
                policy.adapter.forward(x, t, cond, guidance, static=rollout.static)
            else:
                both = {k: torch.cat([null[k].expand(batch, *v.shape[1:]), v]) for k, v in cond.items()}
                policy.adapter.forward(torch.cat([x, x]), torch.cat([t, t]), both, guidance, static=rollout.static)

    def score_step():
        with torch.no_grad():
            policy.score(rollout, step)

    score = interleaved({"forward": bare_forward, "score": score_step}, repeats * 3)
    return {
        "model": name,
        "batch": batch,
        "steps": steps,
        "guidance": guidance,
        "pipeline_s": sample["pipeline"],
        "rollout_cold_s": sample["rollout_cold"],
        "rollout_warm_s": sample["rollout_warm"],
        "rollout_cold_ratio": sample["rollout_cold"] / sample["pipeline"],
        "rollout_warm_ratio": sample["rollout_warm"] / sample["pipeline"],
        "forward_ms": 1e3 * score["forward"],
        "score_ms": 1e3 * score["score"],
        "score_ratio": score["score"] / score["forward"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "policy_bench.json"))
    args = parser.parse_args()
    rows = [
        bench_model("tiny_sd3", tiny_sd3(), 4.5, args.batch, args.steps, args.repeats),
        bench_model("tiny_flux", tiny_flux(), 3.5, args.batch, args.steps, args.repeats),
    ]
    result = {
        "benchmark": "policy_bench",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"{'model':<10}{'pipeline s':>12}{'rollout cold':>14}{'ratio':>7}{'rollout warm':>14}{'ratio':>7}"
        f"{'forward ms':>12}{'score ms':>10}{'ratio':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:<10}{r['pipeline_s']:>12.4f}{r['rollout_cold_s']:>14.4f}{r['rollout_cold_ratio']:>7.3f}"
            f"{r['rollout_warm_s']:>14.4f}{r['rollout_warm_ratio']:>7.3f}{r['forward_ms']:>12.2f}"
            f"{r['score_ms']:>10.2f}{r['score_ratio']:>7.3f}"
        )
    print(f"targets: rollout <= 1.05 x pipeline, score <= 1.10 x forward; written to {args.out}")


if __name__ == "__main__":
    main()
