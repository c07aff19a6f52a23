"""Synchronous against asynchronous runs on this machine's cores, and a model of the speed-up at cluster scale.

For each config: the synchronous run (all threads), then `run.mode: async` with one rollout worker at
`max_staleness` 1 (the worker and the learner split the threads). Reported per run: samples per second over the
epochs after the first (the first pays Ray's and the worker's start), the learner's idle fraction (time waiting
for a batch over the epoch's time) and the final evaluation. From the synchronous run's measured rollout and
update seconds per epoch, `model` tabulates the expected step time with R devices sampling and T training:
synchronous on R + T devices `(rollout + update) / (R + T)`, asynchronous `max(rollout / R, update / T)`, both
assuming each phase scales linearly over devices (an upper bound on what splitting buys).

    python benchmarks/async_bench.py [--configs configs/digits/flow_grpo.yaml] [--epochs 12]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(config: str, epochs: int, mode: str, threads: int, folder: Path) -> dict:
    from flowrl.trainers import build_trainer, load_config

    overrides = [f"run.epochs={epochs}", f"run.output_dir={folder}", "run.log_with=[]", "run.save_every=0",
                 "run.samples_every=0", f"eval.every={epochs}", f"run.threads={threads}"]  # fmt: skip
    if mode == "async":
        overrides += ["run.mode=async", "asynchrony.max_staleness=1", "asynchrony.worker_threads=1",
                      "asynchrony.worker_cpus=0"]  # fmt: skip
    start = time.perf_counter()
    summary = build_trainer(load_config(config, overrides)).train(overwrite=True)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    epochs_rows = [r for r in rows if r.get("epoch", 0) >= 1 and "time_s" in r]
    steady = epochs_rows[1:]
    samples = sum(r.get("trained_samples", 0) for r in steady)
    seconds = sum(r["time_s"] for r in steady)
    return {
        "mode": mode,
        "wall_s": wall,
        "samples_per_s": samples / max(seconds, 1e-9),
        "epoch_s": statistics.median(r["time_s"] for r in steady),
        "learner_idle_frac": sum(r.get("async/wait_s", 0.0) for r in steady) / max(seconds, 1e-9),
        "rollout_s": statistics.median(r.get("time/sample_s", 0.0) + r.get("time/reward_s", 0.0) for r in steady),
        "update_s": statistics.median(r.get("time/train_s", 0.0) for r in steady),
        "staleness": statistics.mean(r.get("async/staleness", 0.0) for r in steady),
        "eval_end": summary["eval_end"],
    }


def model(rollout_s: float, update_s: float, devices=((1, 1), (2, 2), (4, 4), (6, 2), (2, 6), (12, 4))) -> list[dict]:
    """Expected step time with R rollout and T training devices (linear scaling within each phase)."""
    out = []
    for r, t in devices:
        sync = (rollout_s + update_s) / (r + t)
        asyn = max(rollout_s / r, update_s / t)
        out.append({"rollout_devices": r, "train_devices": t, "sync_s": sync, "async_s": asyn, "speedup": sync / asyn})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="configs/digits/flow_grpo.yaml,configs/control/pendulum_ppo.yaml")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2, help="the synchronous run's torch threads")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async_bench.json"))
    args = parser.parse_args()
    results = {"meta": {"cpus": os.cpu_count(), "machine": platform.machine(), "epochs": args.epochs,
                        "threads": args.threads}, "runs": {}}  # fmt: skip
    for config in args.configs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            sync = run(config, args.epochs, "sync", args.threads, Path(tmp) / "sync")
            asyn = run(config, args.epochs, "async", max(1, args.threads - 1), Path(tmp) / "async")
        results["runs"][config] = {"sync": sync, "async": asyn, "model": model(sync["rollout_s"], sync["update_s"])}
        print(f"\n{config}")
        print("| mode | samples/s | epoch s | learner idle | rollout s | update s | mean staleness |")
        print("|---|---|---|---|---|---|---|")
        for r in (sync, asyn):
            print(f"| {r['mode']} | {r['samples_per_s']:.1f} | {r['epoch_s']:.2f} | {r['learner_idle_frac']:.2f} | "
                  f"{r['rollout_s']:.2f} | {r['update_s']:.2f} | {r['staleness']:.2f} |")  # fmt: skip
        print(f"async / sync samples per second: {asyn['samples_per_s'] / sync['samples_per_s']:.2f}")
        print("| rollout devices | train devices | sync step s | async step s | speed-up |")
        print("|---|---|---|---|---|")
        for m in results["runs"][config]["model"]:
            print(f"| {m['rollout_devices']} | {m['train_devices']} | {m['sync_s']:.2f} | {m['async_s']:.2f} | "
                  f"{m['speedup']:.2f} |")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
