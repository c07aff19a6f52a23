"""One training epoch against the network work it cannot avoid (the digits world, CPU).

The reference is the bare transformer calls an epoch must make, with the same shapes: for each sampling step
and forward chunk one no-grad forward of `chunk` rows (`2 x chunk` under CFG), and for each trained step and
micro-batch one forward + backward of `min(chunk, mini-batch)` rows (doubled under CFG). Everything else (step
kernels, log-probs, rewards, advantages, the objective, optimizer steps, bookkeeping) is overhead. Both are
measured side by side in one process.

    python benchmarks/train_bench.py [--config configs/digits/grpo_guard.yaml] [--epochs 3]
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

from flowrl.trainers import build_trainer, load_config  # noqa: E402


def network_work(trainer, collected, optimizer_steps: int) -> float:
    """Seconds of the bare network calls one epoch makes (same shapes, same number of calls)."""
    from flowrl.run.scheduler import UpdateBatch

    cfg = trainer.config
    chunk, steps = cfg.batch.micro_batch_size, cfg.sampling.num_steps
    rollout = collected.data
    n = collected.size
    model = trainer.policy.model
    cond = {k: v[rollout.prompt_ids] for k, v in rollout.cond.items()}
    branches = 2 if rollout.null_cond is not None else 1

    def network_call(size: int):
        """A call on `size` rows (both CFG branches in one batch, as the policy makes it)."""
        rows = torch.arange(size) % n  # a batch smaller than the chunk is padded to it, as the policy pads
        x = rollout.latents[rows, 0].repeat(branches, 1, 1, 1)
        t = rollout.timesteps[:1].expand(branches * size)
        c = {k: v[rows].repeat(branches, *([1] * (v.ndim - 1))) for k, v in cond.items()}
        return lambda: trainer.policy.adapter.forward(x, t, c, cfg.sampling.guidance_scale, model=model)

    call = network_call(chunk)  # sampling: chunks of exactly `chunk` rows (padded)
    batch = UpdateBatch(
        data=rollout, rows=collected.rows, size=n, advantages=torch.zeros(n), trainable=torch.ones(n, dtype=torch.bool)
    )
    index, _ = trainer.algorithm.elements(batch, 0)
    trained_steps = index.shape[1]
    # each optimizer step's mini-batch in micro-batches of `chunk` rows
    mini = min(cfg.batch.mini_batch_size or n, n)
    train_calls = optimizer_steps * -(-mini // chunk)
    train_call = network_call(min(chunk, mini))  # the update's calls: a mini-batch smaller than a chunk is one call
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps * -(-n // chunk)):
            call()
    for _ in range(trained_steps * train_calls):
        train_call().float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "digits" / "grpo_guard.yaml"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_bench.json"))
    args = parser.parse_args()
    config = load_config(args.config, ["run.log_with=[]", "run.output_dir=/tmp/flowrl-train-bench", *args.set])
    trainer = build_trainer(config)
    epoch_times, work_times, phases = [], [], {}
    for epoch in range(args.epochs + 1):  # the first epoch warms up (and is not counted)
        start = time.perf_counter()
        record = trainer.train_epoch(epoch)
        elapsed = time.perf_counter() - start
        work = network_work(trainer, trainer.last_batch, record["optimizer_steps"])
        if epoch:
            epoch_times.append(elapsed)
            work_times.append(work)
            for key in ("time/sample_s", "time/reward_s", "time/train_s"):
                if key in record:
                    phases.setdefault(key.removeprefix("time/"), []).append(float(record[key]))
    epoch_s, work_s = statistics.median(epoch_times), statistics.median(work_times)
    result = {
        "benchmark": "train_bench",
        "config": str(Path(args.config).relative_to(ROOT)) if Path(args.config).is_relative_to(ROOT) else args.config,
        "overrides": args.set,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "samples_per_epoch": config.prompts.prompts_per_epoch * config.prompts.group_size,
        "epoch_s": epoch_s,
        "network_s": work_s,
        "overhead_ratio": epoch_s / work_s,
        **{name: statistics.median(times) for name, times in phases.items()},
        "epochs_measured": args.epochs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'epoch s':>10}{'network s':>12}{'ratio':>8}")
    print(f"{epoch_s:>10.3f}{work_s:>12.3f}{epoch_s / work_s:>8.3f}")
    print(f"target: ratio <= 1.15; written to {args.out}")


if __name__ == "__main__":
    main()
