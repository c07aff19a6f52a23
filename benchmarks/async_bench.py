"""Synchronous against asynchronous runs on this machine's cores, and a model of the speed-up at cluster scale.

For each config: the synchronous run (all threads), then `run.mode: async` with one rollout worker at
`max_staleness` 1 (the worker and the learner split the threads). Reported per run: samples per second over the
epochs after the first (the first pays Ray's and the worker's start), the learner's idle fraction (time waiting
for a batch over the epoch's time) and the final evaluation. From the synchronous run's measured rollout and
update seconds per epoch, `model` tabulates the expected step time on N devices at the best split between
rollout workers and learner, with and without a reward latency no device count shortens (see `model`).

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
        "rollout_s": statistics.median(
            r.get("time/sample_s", 0.0) + r.get("time/reward_s", 0.0) + r.get("time/collect_s", 0.0) for r in steady
        ),  # fmt: skip
        "update_s": statistics.median(r.get("time/train_s", 0.0) for r in steady),
        "staleness": statistics.mean(r.get("async/staleness", 0.0) for r in steady),
        "eval_end": summary["eval_end"],
    }


def model(rollout_s: float, update_s: float, devices=(4, 8, 16, 64), latencies=(0.0, 1.0, 4.0)) -> list[dict]:
    """Expected step time on N devices, each phase scaling linearly over the devices it gets (rollout r, update u:
    one device's seconds per batch), with a reward latency L per batch that no device count shortens (a judge
    server's round trip), given as a multiple of the synchronous compute step (r + u) / N.

    Synchronous: `(r + u) / N + L`. Asynchronous with R one-device rollout workers, each sampling its own batch
    (staleness up to R - 1 versions, at least 1) and N - R learner devices: `max((r + L) / R, u / (N - R))`, at
    the best R. With L = 0 the split can at best match the synchronous step: the gain is the latency hidden."""
    out = []
    for n in devices:
        compute = (rollout_s + update_s) / n
        for k in latencies:
            latency = k * compute
            sync = compute + latency
            best = min(range(1, n), key=lambda r: max((rollout_s + latency) / r, update_s / (n - r)))
            asyn = max((rollout_s + latency) / best, update_s / (n - best))
            out.append({"devices": n, "latency_x": k, "rollout_devices": best, "train_devices": n - best,
                        "max_staleness": max(1, best - 1), "sync_s": sync, "async_s": asyn,
                        "speedup": sync / asyn})  # fmt: skip
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="configs/digits/flow_grpo.yaml,configs/control/pendulum_ppo.yaml")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2, help="the synchronous run's torch threads")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async_bench.json"))
    args = parser.parse_args()
    out = Path(args.out)
    stored = json.loads(out.read_text()) if out.is_file() else {}  # configs not run keep their stored results
    results = {"meta": {"cpus": os.cpu_count(), "machine": platform.machine(), "epochs": args.epochs,
                        "threads": args.threads}, "runs": stored.get("runs", {})}  # fmt: skip
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
        print("| devices | reward latency (x sync compute step) | best split (rollout + train) | sync step s | "
              "async step s | speed-up |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for m in results["runs"][config]["model"]:
            print(f"| {m['devices']} | {m['latency_x']:g} | {m['rollout_devices']} + {m['train_devices']} | "
                  f"{m['sync_s']:.3f} | {m['async_s']:.3f} | {m['speedup']:.2f} |")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
