"""Epoch time of the digits main job alone and on a shared CPU, for several threading settings.

    python benchmarks/contention_bench.py [--epochs 3] [--repeats 3] [--settings torch,flowrl,fixed=1,passive]

Each setting runs the README's main job (`configs/digits/grpo_guard.yaml`) in a fresh process for a few epochs
(the first is not counted) in three situations: alone (the settings interleaved over `--repeats` rounds, the
median kept); beside one CPU-bound process (a busy Python loop); and beside a second identical training. It
reports the median epoch seconds and the slowdowns against the same setting alone, and the targets: alone at
most 5% slower than torch's own default, at most 1.6x beside a busy process, at most 2.5x for two trainings
side by side. Writes `benchmarks/results/contention_bench.json`.

Settings: `torch` (`run.threads=torch`: torch's own threads), `flowrl` (the default `run.threads=auto`:
`flowrl.threads.ThreadGovernor`), `fixed=N` (`run.threads=N`), and torch's threads with an OpenMP setting:
`passive` (`OMP_WAIT_POLICY=PASSIVE`), `spin=N` (`GOMP_SPINCOUNT=N`), `threads=N` (`OMP_NUM_THREADS=N`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "digits" / "grpo_guard.yaml"


def worker(epochs: int) -> None:
    """One training process: `epochs` timed epochs after a first one (JSON on stdout)."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from flowrl.trainers import build_trainer, load_config

    threads = os.environ.get("BENCH_RUN_THREADS", "auto")
    config = load_config(
        CONFIG,
        ["run.log_with=[]", f"run.threads={threads}", f"run.output_dir=/tmp/flowrl-contention-bench-{os.getpid()}"],
    )
    trainer = build_trainer(config)
    times = []
    for epoch in range(epochs + 1):
        start = time.perf_counter()
        trainer.train_epoch(epoch)
        times.append(time.perf_counter() - start)
    print(json.dumps({"epoch_s": times[1:], "threads": torch.get_num_threads()}))
    shutil.rmtree(config.run.output_dir, ignore_errors=True)


def environment(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if setting == "torch":
        env["BENCH_RUN_THREADS"] = "torch"
    elif setting == "passive":
        env.update(BENCH_RUN_THREADS="torch", OMP_WAIT_POLICY="PASSIVE")
    elif setting.startswith("spin="):
        env.update(BENCH_RUN_THREADS="torch", GOMP_SPINCOUNT=setting.split("=", 1)[1])
    elif setting.startswith("threads="):
        env.update(BENCH_RUN_THREADS="torch", OMP_NUM_THREADS=setting.split("=", 1)[1])
    elif setting.startswith("fixed="):
        env["BENCH_RUN_THREADS"] = setting.split("=", 1)[1]
    elif setting != "flowrl":
        raise SystemExit(f"unknown setting {setting!r}")
    return env


def run(setting: str, situation: str, epochs: int) -> list[float]:
    """Median epoch seconds of each training process of one (setting, situation)."""
    command = [sys.executable, __file__, "--worker", "--epochs", str(epochs)]
    env = environment(setting)
    busy = None
    if situation == "busy":
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    copies = 2 if situation == "two" else 1
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    try:
        outputs = [p.communicate()[0] for p in procs]
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    results = []
    for out in outputs:
        record = json.loads(out.strip().splitlines()[-1])
        results.append(statistics.median(record["epoch_s"]))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--settings", default="torch,flowrl,fixed=1,passive")
    parser.add_argument("--situations", default="alone,busy,two", help="alone plus any of busy,two")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the alone runs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "contention_bench.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.epochs)
        return
    situations = args.situations.split(",")
    settings = args.settings.split(",")
    # alone: the settings interleaved, `--repeats` rounds, median (a shared VM drifts by 10-20% over minutes)
    alone_runs = {setting: [] for setting in settings}
    for _ in range(args.repeats):
        for setting in settings:
            alone_runs[setting].append(run(setting, "alone", args.epochs)[0])
    rows = []
    for setting in settings:
        alone = statistics.median(alone_runs[setting])
        busy = run(setting, "busy", args.epochs)[0] if "busy" in situations else None
        two = max(run(setting, "two", args.epochs)) if "two" in situations else None
        rows.append(
            {
                "setting": setting,
                "alone_s": alone,
                "alone_runs_s": alone_runs[setting],
                "busy_s": busy,
                "two_s": two,
                "busy_ratio": busy / alone if busy else None,
                "two_ratio": two / alone if two else None,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    base = next((r["alone_s"] for r in rows if r["setting"] == "torch"), None)
    for row in rows:
        row["alone_vs_torch"] = row["alone_s"] / base if base else None
    result = {
        "benchmark": "contention_bench",
        "config": str(CONFIG.relative_to(ROOT)),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "epochs_measured": args.epochs,
        "alone_repeats": args.repeats,
        "targets": {"alone_vs_torch": 1.05, "busy_ratio": 1.6, "two_ratio": 2.5},
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\n{'setting':<14}{'alone s':>9}{'vs torch':>10}{'busy x':>8}{'two x':>8}")

    def cell(value):
        return f"{value:.2f}" if value else "-"

    for r in rows:
        print(
            f"{r['setting']:<14}{r['alone_s']:>9.2f}{cell(r['alone_vs_torch']):>10}{cell(r['busy_ratio']):>8}"
            f"{cell(r['two_ratio']):>8}"
        )
    print("targets: alone vs torch <= 1.05, busy <= 1.6x, two side by side <= 2.5x each")


if __name__ == "__main__":
    main()
