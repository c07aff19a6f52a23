"""Synchronous against asynchronous runs on this machine's cores, a model of the asynchronous epoch checked against
them, and a model of the speed-up at cluster scale.

For each config: the synchronous run (`--threads` threads), the synchronous run on the asynchronous mode's
allocation (each phase on the threads it gets there: the learner's update on `--threads - 1`, a worker's rollout
on one), then `run.mode: async` with W workers at staleness s for each `--pipelines` entry `W:s` (the learner and
the workers share the cores). `pipeline` predicts each asynchronous epoch from the measured phase times (rollout,
update, the rest of the epoch, publishing), and says whether the run is learner- or rollout-bound; the table puts
the prediction beside the measurement. Reported per run: samples per second over the epochs after the first (the
first pays Ray's and the workers' start), the learner's idle fraction and the final evaluation. From the
synchronous run's rollout and update seconds, `model` tabulates the step time on N devices at the best split
between rollout workers and learner, with and without a reward latency no device count shortens.

    python benchmarks/async_bench.py [--configs configs/digits/flow_grpo.yaml,configs/wan/tiny.yaml] [--epochs 12]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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


def run(config: str, epochs: int, mode: str, threads: int, folder: Path, workers: int = 1, staleness: int = 1) -> dict:
    """One run of `config` (`mode` sync or async with `workers` rollout workers at `staleness`) and its medians over
    the epochs after the first: the epoch, its rollout, update and the rest, the learner's wait, the publication."""
    from flowrl.run.async_rollouts import publication
    from flowrl.trainers import build_trainer, load_config

    overrides = [
        f"run.epochs={epochs}",
        f"run.output_dir={folder}",
        "run.log_with=[]",
        "run.save_every=0",
        "run.samples_every=0",
        f"eval.every={epochs}",
        f"run.threads={threads}",
    ]
    if mode == "async":
        overrides += [
            "run.mode=async",
            f"asynchrony.max_staleness={staleness}",
            "asynchrony.worker_threads=1",
            f"asynchrony.rollout_workers={workers}",
            "asynchrony.worker_cpus=0",
        ]
    start = time.perf_counter()
    trainer = build_trainer(load_config(config, overrides))
    summary = trainer.train(overwrite=True)
    wall = time.perf_counter() - start
    publish = []
    for _ in range(3):  # what publishing the trained state costs the learner (encoding; the object store's put aside)
        t0 = time.perf_counter()
        publication(trainer)
        publish.append(time.perf_counter() - t0)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    epochs_rows = [r for r in rows if r.get("epoch", 0) >= 1 and "time_s" in r]
    steady = epochs_rows[1:]
    samples = sum(r.get("trained_samples", 0) for r in steady)
    seconds = sum(r["time_s"] for r in steady)

    def rollout(r):  # sampling and rewards (in the asynchronous mode: the worker's, as it reports them)
        return r.get("time/sample_s", 0.0) + r.get("time/reward_s", 0.0) + r.get("time/collect_s", 0.0)

    def other(r):  # the learner's epoch outside the rollout (or its wait for the batch) and the update
        waited = r["async/wait_s"] if mode == "async" else rollout(r)
        return r["time_s"] - waited - r.get("time/train_s", 0.0)

    return {
        "mode": mode,
        "workers": workers if mode == "async" else 0,
        "max_staleness": staleness if mode == "async" else 0,
        "threads": threads,
        "wall_s": wall,
        "samples_per_s": samples / max(seconds, 1e-9),
        "epoch_s": statistics.median(r["time_s"] for r in steady),
        "learner_idle_frac": sum(r.get("async/wait_s", 0.0) for r in steady) / max(seconds, 1e-9),
        "rollout_s": statistics.median(rollout(r) for r in steady),
        "update_s": statistics.median(r.get("time/train_s", 0.0) for r in steady),
        "other_s": statistics.median(other(r) for r in steady),
        "publish_s": statistics.median(publish),
        "staleness": statistics.mean(r.get("async/staleness", 0.0) for r in steady),
        "eval_end": summary["eval_end"],
    }


@dataclasses.dataclass
class Phases:
    """One epoch's phases, in seconds, on the threads each gets."""

    rollout_s: float
    """Sampling and scoring the epoch's batch."""
    update_s: float
    """The update: every optimizer step and the algorithm's finish."""
    other_s: float = 0.0
    """The rest of the learner's epoch: advantages, behaviour log-probs, the metrics row."""


def pipeline(
    sync: Phases,
    learner: Phases,
    worker_rollout_s: float,
    publish_s: float,
    workers: int,
    staleness: int,
    cores: int | None = None,
    learner_threads: int = 1,
    worker_threads: int = 1,
) -> dict:
    """The epoch time of the synchronous run and of the asynchronous pipeline, from measured phase times.

    Synchronous: the phases one after another, `r + u + o` (`sync`, on all the threads). Asynchronous (`learner`:
    the update and the rest on the learner's threads, `L = u + o + p` with `p` = `publish_s`, publishing the weights
    once; `worker_rollout_s` = `r`: one worker's rollout on its threads): the workers may sample epoch `e` once
    `e - published <= max_staleness` (the dispatch rule of `flowrl.run.async_rollouts`), so while the learner waits
    for epoch `e` the epochs `e .. e + s` may be in flight: the rollout side delivers `a = min(W, s + 1)` batches
    per `r`. The epoch is the larger of `L` and `r / a`, and the pipeline is bound by that side. At staleness 0
    nothing overlaps: `r + L`. More workers stop paying once the rollout keeps up (`keep_up_workers =
    ceil(r / L)`, at staleness one less). The mode pays at all only where the learner's side is shorter than the
    synchronous epoch. Cores: per epoch the learner is busy `L` on its threads and the workers `r` in all on
    theirs; where that work is more than the `cores` give in the epoch, every phase slows by the ratio."""
    sync_s = sync.rollout_s + sync.update_s + sync.other_s
    learner_s = learner.update_s + learner.other_s + publish_s
    keep_up = math.ceil(worker_rollout_s / learner_s) if learner_s > 0 else 1
    if staleness == 0:
        async_s, bound, share = worker_rollout_s + learner_s, "serial", 1.0
    else:
        ahead = min(workers, staleness + 1)
        learner_side, rollout_side = learner_s, worker_rollout_s / ahead
        busy = learner_threads * learner_s + worker_threads * worker_rollout_s  # thread-seconds per epoch
        share = max(1.0, busy / (cores * max(learner_side, rollout_side))) if cores else 1.0
        async_s = max(learner_side, rollout_side) * share
        bound = "learner" if learner_side >= rollout_side else "rollout"
    return {
        "sync_s": sync_s,
        "async_s": async_s,
        "speedup": sync_s / async_s,
        "bound": bound,
        "keep_up_workers": keep_up,
        "pays": async_s < sync_s,
        "oversubscribed": share > 1,
    }


def phases(result: dict) -> Phases:
    return Phases(result["rollout_s"], result["update_s"], result["other_s"])


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
            out.append(
                {
                    "devices": n,
                    "latency_x": k,
                    "rollout_devices": best,
                    "train_devices": n - best,
                    "max_staleness": max(1, best - 1),
                    "sync_s": sync,
                    "async_s": asyn,
                    "speedup": sync / asyn,
                }
            )
    return out


def predict(record: dict, cores: int, learner_threads: int) -> None:
    """Each asynchronous run's `predicted` entry of a config's `record`, from its measured phases (`pipeline`)."""
    sync, learner, worker = record["sync"], record["learner"], record["worker"]
    for p in record["pipelines"]:
        m = p["measured"]
        p["predicted"] = pipeline(
            phases(sync),
            phases(learner),
            worker["rollout_s"],
            learner["publish_s"],
            m["workers"],
            m["max_staleness"],
            cores,
            learner_threads,
        )


def table(config: str, record: dict) -> None:
    """Print a config's prediction beside the measurement, and the cluster-scale model."""
    sync, learner, worker = record["sync"], record["learner"], record["worker"]
    print(
        f"\n{config}: phases (s) sync {phases(sync)}, learner {phases(learner)}, worker rollout "
        f"{worker['rollout_s']:.2f}, publish {learner['publish_s']:.3f}"
    )
    print(
        "| workers | max staleness | epoch s predicted | epoch s measured | bound | speed-up predicted | "
        "speed-up measured | learner idle | mean staleness |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| sync | - | {sync['rollout_s'] + sync['update_s'] + sync['other_s']:.2f} | {sync['epoch_s']:.2f} | "
        f"- | 1 | 1 | 0 | 0 |"
    )
    for p in record["pipelines"]:
        m, pr = p["measured"], p["predicted"]
        print(
            f"| {m['workers']} | {m['max_staleness']} | {pr['async_s']:.2f} | {m['epoch_s']:.2f} | {pr['bound']}"
            f"{' (oversubscribed)' if pr['oversubscribed'] else ''} | {pr['speedup']:.2f} | "
            f"{sync['epoch_s'] / m['epoch_s']:.2f} | {m['learner_idle_frac']:.2f} | {m['staleness']:.2f} |"
        )
    print(
        "| devices | reward latency (x sync compute step) | best split (rollout + train) | sync step s | "
        "async step s | speed-up |"
    )
    print("|---|---|---|---|---|---|")
    for m in record["model"]:
        print(
            f"| {m['devices']} | {m['latency_x']:g} | {m['rollout_devices']} + {m['train_devices']} | "
            f"{m['sync_s']:.3f} | {m['async_s']:.3f} | {m['speedup']:.2f} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="configs/digits/flow_grpo.yaml,configs/wan/tiny.yaml")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2, help="the synchronous run's torch threads")
    parser.add_argument("--pipelines", default="1:1,2:1,2:2", help="asynchronous runs, WORKERS:MAX_STALENESS each")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async_bench.json"))
    parser.add_argument(
        "--tabulate",
        action="store_true",
        help="run nothing: the tables of the runs stored in --out, their predictions made again by this model",
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.tabulate:
        results = json.loads(out.read_text())
        meta = results["meta"]
        for config, record in results["runs"].items():
            predict(record, meta["cpus"], max(1, meta["threads"] - 1))
            table(config, record)
        return
    cores = len(os.sched_getaffinity(0))
    stored = json.loads(out.read_text()) if out.is_file() else {}  # configs not run keep their stored results
    results = {
        "meta": {
            "cpus": cores,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "epochs": args.epochs,
            "threads": args.threads,
        },
        "runs": stored.get("runs", {}),
    }
    learner_threads = max(1, args.threads - 1)  # the asynchronous runs' learner; each worker takes one
    for config in args.configs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            sync = run(config, args.epochs, "sync", args.threads, Path(tmp) / "sync")
            # each phase on the threads the asynchronous mode gives it: the learner's, then one worker's
            learner = run(config, args.epochs, "sync", learner_threads, Path(tmp) / "learner")
            worker = learner if learner_threads == 1 else run(config, args.epochs, "sync", 1, Path(tmp) / "worker")
            pipelines = []
            for spec in args.pipelines.split(","):
                workers, staleness = (int(x) for x in spec.split(":"))
                folder = Path(tmp) / f"async-{workers}-{staleness}"
                measured = run(config, args.epochs, "async", learner_threads, folder, workers, staleness)
                pipelines.append({"measured": measured})
        record = {
            "sync": sync,
            "learner": learner,
            "worker": worker,
            "pipelines": pipelines,
            "model": model(sync["rollout_s"], sync["update_s"]),
        }
        predict(record, cores, learner_threads)
        results["runs"][config] = record
        table(config, record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
