"""The staleness study: what training on batches sampled by older weights does to each objective.

Every run is `run.mode: async` with `asynchrony.backend: inline` (docs/async.md): epoch e is sampled with exactly
the weights of version e - s (s = `max_staleness`, published every update), which is what a pipeline whose
rollout workers keep s versions ahead trains on, deterministic (a Ray run's staleness depends on timing). s = 0 is
the synchronous run (tested). Everything else is the shipped recipe, unchanged: no objective is re-tuned for
staleness, which is the question (does the objective's trust region or truncation absorb it?).

Reported per objective and staleness, over seeds: the test metric at the start, at the end and at its peak, how
many seeds collapsed (ended below their start), the mean clip (or truncation) fraction over the epochs, and the
mean spread of the ratio (`ratio_std` over each epoch's steps: how far the policy trained is from the one that
sampled; at staleness 0 only the epoch's own updates move it).

    python benchmarks/staleness_study.py [--tasks digits,arith] [--staleness 0,1,2,4] [--seeds 0,1,2] [--jobs 2]

(staleness by default: 0, 1, 2, 4 on arith; 0, 1, 4 on digits.)

Runs go to `runs/staleness/` (a finished run is reused); results to `benchmarks/results/staleness_study.{json,md}`
and `benchmarks/results/staleness_study_<task>.png`. Each run is one process on one torch thread, `--jobs` at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

TASKS = {
    "digits": {
        "configs": {
            "flow_grpo": "configs/digits/flow_grpo.yaml",
            "grpo_guard": "configs/digits/grpo_guard.yaml",
            "diffusion_nft": "configs/digits/diffusion_nft.yaml",
        },
        # 30 epochs each (the shipped Flow-GRPO and Guard recipes run 50): the budget of 36 runs on 2 cores
        "set": ["run.epochs=30", "eval.every=5"],
        "staleness": [0, 1, 4],  # 27 runs: about an hour on 2 cores
        "metric": "eval/digits_alignment",
        "gold": "eval/digits_gold",
    },
    "arith": {
        "configs": {name: f"configs/llm/arith_{name}.yaml" for name in ("grpo", "dapo", "cispo", "bapo", "st_ppo")},
        "set": [],
        "staleness": [0, 1, 2, 4],
        "metric": "eval/arith_exact",
        "gold": None,
    },
}


def _folder(out: Path, task: str, objective: str, staleness: int, seed: int) -> Path:
    return out / task / objective / f"staleness{staleness}" / f"seed{seed}"


def train(config: str, extra: list[str], staleness: int, seed: int, folder: Path) -> float:
    """One run in its own process on one torch thread (skipped when `folder` holds a finished one); its seconds."""
    if (folder / "summary.json").is_file():
        return 0.0
    overrides = [
        *extra,
        "run.mode=async",
        "asynchrony.backend=inline",
        f"asynchrony.max_staleness={staleness}",
        f"run.seed={seed}",
        "run.save_every=0",
        "run.samples_every=0",
        "run.log_with=[]",
    ]
    cmd = [sys.executable, "-m", "flowrl", "train", str(ROOT / config), "--output-dir", str(folder), "--overwrite"]
    for item in overrides:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{folder}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else '?'}")
    return time.perf_counter() - start


def summarise(folder: Path, metric: str, gold: str | None) -> dict:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["epoch"], r[metric]) for r in rows if metric in r]
    train = [r for r in rows if "loss" in r]
    out = {
        "curve": evals,
        "start": evals[0][1],
        "end": evals[-1][1],
        "peak": max(v for _, v in evals),
        "clipfrac": statistics.fmean(r.get("clipfrac", 0.0) for r in train),
        "ratio_std": statistics.fmean(r.get("ratio_std", 0.0) for r in train),
        "nonfinite_steps": max(r.get("nonfinite_steps", 0) for r in train),
        "staleness": statistics.fmean(r["async/staleness"] for r in train),
    }
    if gold:
        golds = [r[gold] for r in rows if gold in r]
        out.update(gold_start=golds[0], gold_end=golds[-1])
    out["collapsed"] = out["end"] < out["start"] or out["nonfinite_steps"] > 0
    return out


def _ms(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def table(results: dict) -> str:
    lines = []
    for task, cells in results["tasks"].items():
        gold = TASKS[task]["gold"]
        metric = TASKS[task]["metric"].removeprefix("eval/")
        head = ["objective", "staleness", f"{metric} start", f"{metric} end (mean ± sd)", f"{metric} peak"]
        head += [f"{gold.removeprefix('eval/')} end"] if gold else []
        head += ["collapsed", "clip frac", "ratio std"]
        lines += [f"### {task}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for objective, by_staleness in cells.items():
            for staleness, runs in by_staleness.items():
                row = [
                    objective,
                    staleness,
                    _ms([r["start"] for r in runs]),
                    _ms([r["end"] for r in runs]),
                    _ms([r["peak"] for r in runs]),
                ]
                row += [_ms([r["gold_end"] for r in runs])] if gold else []
                clip, spread = (statistics.fmean(r[k] for r in runs) for k in ("clipfrac", "ratio_std"))
                row += [f"{sum(r['collapsed'] for r in runs)}/{len(runs)}", f"{clip:.4f}", f"{spread:.2e}"]
                lines.append("| " + " | ".join(str(c) for c in row) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task, cells in results["tasks"].items():
        fig, axes = plt.subplots(1, len(cells) + 1, figsize=(4 * (len(cells) + 1), 3.4))
        metric = TASKS[task]["metric"].removeprefix("eval/")
        for ax, (objective, by_staleness) in zip(axes[1:], cells.items()):
            for staleness, runs in by_staleness.items():
                epochs = [e for e, _ in runs[0]["curve"]]
                curves = [[v for _, v in r["curve"]] for r in runs]
                mean = [statistics.fmean(c[i] for c in curves) for i in range(len(epochs))]
                low = [min(c[i] for c in curves) for i in range(len(epochs))]
                high = [max(c[i] for c in curves) for i in range(len(epochs))]
                line = ax.plot(epochs, mean, label=f"s={staleness}")[0]
                ax.fill_between(epochs, low, high, color=line.get_color(), alpha=0.15)
            ax.set_title(objective)
            ax.set_xlabel("epoch")
            ax.legend(fontsize=7)
        for objective, by_staleness in cells.items():
            xs = [int(s) for s in by_staleness]
            ends = [[r["end"] for r in runs] for runs in by_staleness.values()]
            axes[0].errorbar(
                xs,
                [statistics.fmean(e) for e in ends],
                yerr=[statistics.stdev(e) if len(e) > 1 else 0 for e in ends],
                marker="o",
                capsize=3,
                label=objective,
            )
        axes[0].set_xlabel("staleness (versions)")
        axes[0].set_ylabel(f"final {metric}")
        axes[0].set_title(f"{task}: final {metric} (mean ± sd)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"staleness_study_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="digits,arith")
    parser.add_argument("--staleness", help="comma-separated versions (default: each task's own list)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--runs", default=str(ROOT / "runs" / "staleness"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    given = [int(s) for s in args.staleness.split(",")] if args.staleness else None
    stalenesses = {task: given or TASKS[task]["staleness"] for task in tasks}
    seeds = [int(s) for s in args.seeds.split(",")]
    runs_dir, out_dir = Path(args.runs), Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [
        (task, objective, config, s, seed)
        for task in tasks
        for objective, config in TASKS[task]["configs"].items()
        for s in stalenesses[task]
        for seed in seeds
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            job: pool.submit(
                train, job[2], TASKS[job[0]]["set"], job[3], job[4], _folder(runs_dir, job[0], job[1], job[3], job[4])
            )
            for job in jobs
        }
        for job, future in futures.items():
            seconds = future.result()
            print(f"{job[0]:7s} {job[1]:14s} staleness {job[3]} seed {job[4]}: {seconds:.0f} s", flush=True)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "jobs": args.jobs,
        "settings": {task: {"configs": TASKS[task]["configs"], "set": TASKS[task]["set"]} for task in tasks},
        "tasks": {
            task: {
                objective: {
                    str(s): [
                        summarise(
                            _folder(runs_dir, task, objective, s, seed), TASKS[task]["metric"], TASKS[task]["gold"]
                        )
                        for seed in seeds
                    ]
                    for s in stalenesses[task]
                }
                for objective in TASKS[task]["configs"]
            }
            for task in tasks
        },
    }
    (out_dir / "staleness_study.json").write_text(json.dumps(results, indent=1))
    (out_dir / "staleness_study.md").write_text(table(results))
    plot(results, out_dir)
    print(table(results))


if __name__ == "__main__":
    main()
