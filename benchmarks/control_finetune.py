"""Fine-tuning a behaviour-cloned flow policy against training it from scratch, on Pendulum-v1.

    python benchmarks/control_finetune.py [--seeds 0,1,2,3,4] [--steps 40000] [--jobs 2] [--trainers fpo,dppo]

1. An expert: `configs/control/pendulum_ppo.yaml` (Gaussian PPO, 100k steps, seed 0).
2. Demonstrations: `flowrl demos` of the expert, `--episodes` episodes with action noise `--noise` (a noisy
   demonstrator), seed 0.
3. Per seed: `configs/control/pendulum_bc.yaml` on them (`--bc-epochs`), then each trainer's shipped Pendulum
   config twice for `--steps` environment steps: from the clone (`init_from`, `critic.warmup_epochs=2`) and from
   scratch; evaluation (10 deterministic episodes) every 2 epochs.

Writes `benchmarks/results/control_finetune.{json,md}`: per seed the clone's return, each run's evaluation curve,
the final returns and the environment steps each run needed to first beat the clone's return. Runs go `--jobs`
at a time (single-threaded each); the numbers are returns, not times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "control"


def flowrl(*args: str) -> None:
    """`python -m flowrl ARGS` on one torch thread; a failure ends the benchmark with its stderr's tail."""
    cmd = [sys.executable, "-m", "flowrl", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")


def mean_sd(values, digits: int = 1) -> str:
    """`mean ± sd` of the values that are not None (`n/a` without any)."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def write_result(result: dict, out: str, table: str) -> None:
    """`out.json` (the result) and `out.md` (the table), printed."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(result, indent=1))
    Path(out + ".md").write_text(table)
    print(table)


def curve(run: Path) -> list[tuple[int, float]]:
    """`(environment steps, eval/reward)` of a run's evaluations (steps 0: the start)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out, steps = [], 0
    for row in rows:
        steps = row.get("env_steps", steps)
        if "eval/reward" in row:
            out.append((steps if row.get("epoch", 0) else 0, float(row["eval/reward"])))
    return out


def first_reach(points: list[tuple[int, float]], level: float) -> int | None:
    return next((s for s, r in points if r > level), None)  # strictly: beating the clone


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--trainers", default="fpo,dppo")
    parser.add_argument("--steps", type=int, default=40000, help="environment steps of each fine-tuning run")
    parser.add_argument("--episodes", type=int, default=10, help="demonstration episodes")
    parser.add_argument("--noise", type=float, default=1.0, help="the demonstrator's action noise")
    parser.add_argument("--bc-epochs", type=int, default=300)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--runs", default="/tmp/flowrl-control-finetune")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "control_finetune"))
    args = parser.parse_args()
    runs, start = Path(args.runs), time.time()
    seeds, trainers = [int(s) for s in args.seeds.split(",")], args.trainers.split(",")
    expert, demos = runs / "expert", runs / "demos.npz"
    if not (expert / "summary.json").is_file():
        flowrl("train", str(CONFIGS / "pendulum_ppo.yaml"), "--output-dir", str(expert), "--overwrite")
    flowrl("demos", str(expert), "--episodes", str(args.episodes), "--noise", str(args.noise), "--out", str(demos))
    expert_return = curve(expert)[-1][1]

    def bc(seed):
        out = runs / f"bc_{seed}"
        flowrl(
            "train",
            str(CONFIGS / "pendulum_bc.yaml"),
            "--set",
            f"demonstrations={demos}",
            "--set",
            f"run.epochs={args.bc_epochs}",
            "--set",
            f"run.seed={seed}",
            "--output-dir",
            str(out),
            "--overwrite",
        )
        return seed, out

    def rl(seed, trainer, start_from):
        out = runs / f"{trainer}_{'finetune' if start_from else 'scratch'}_{seed}"
        extra = ["--set", f"init_from={start_from}", "--set", "critic.warmup_epochs=2"] if start_from else []
        flowrl(
            "train",
            str(CONFIGS / f"pendulum_{trainer}.yaml"),
            "--set",
            f"total_env_steps={args.steps}",
            "--set",
            f"run.seed={seed}",
            "--set",
            "eval.every=2",
            *extra,
            "--output-dir",
            str(out),
            "--overwrite",
        )
        return out

    with ThreadPoolExecutor(args.jobs) as pool:
        clones = dict(pool.map(bc, seeds))
        jobs = {
            (s, t, kind): pool.submit(rl, s, t, clones[s] if kind == "finetune" else None)
            for s in seeds
            for t in trainers
            for kind in ("finetune", "scratch")
        }
        folders = {key: job.result() for key, job in jobs.items()}

    rows = []
    for seed in seeds:
        clone = curve(clones[seed])[-1][1]
        for trainer in trainers:
            for kind in ("finetune", "scratch"):
                points = curve(folders[(seed, trainer, kind)])
                rows.append(
                    {
                        "seed": seed,
                        "trainer": trainer,
                        "start": kind,
                        "bc_return": clone,
                        "final_return": points[-1][1],
                        "curve": points,
                        "steps_to_beat_bc": first_reach(points[1:], clone),
                    }
                )
    result = {
        "benchmark": "control_finetune",
        "env": "Pendulum-v1",
        "expert_return": expert_return,
        "demonstrations": {"episodes": args.episodes, "noise": args.noise},
        "bc_epochs": args.bc_epochs,
        "steps": args.steps,
        "seeds": seeds,
        "wall_s": round(time.time() - start),
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
    }
    write_result(result, args.out, markdown(result))


def markdown(result: dict) -> str:
    rows, seeds = result["rows"], result["seeds"]
    clones = [next(r["bc_return"] for r in rows if r["seed"] == s) for s in seeds]
    lines = [
        f"Pendulum-v1: expert (Gaussian PPO, 100k steps) {result['expert_return']:.1f}; demonstrations: "
        f"{result['demonstrations']['episodes']} episodes with action noise {result['demonstrations']['noise']}; "
        f"behaviour cloning {result['bc_epochs']} epochs: {mean_sd(clones)} over seeds {seeds}. Then "
        f"{result['steps']} environment steps from the clone (critic warm-up 2 epochs) or from scratch. Mean ± std "
        "over seeds; 'beat BC': seeds whose evaluation (every 2 epochs) first exceeded the clone's own return, and "
        "the environment steps it took.",
        "",
        "| trainer | start | final return | final above the clone | beat BC | steps to beat BC |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for trainer in dict.fromkeys(r["trainer"] for r in rows):
        for kind in ("finetune", "scratch"):
            mine = [r for r in rows if r["trainer"] == trainer and r["start"] == kind]
            above = sum(r["final_return"] > r["bc_return"] for r in mine)
            reached = [r["steps_to_beat_bc"] for r in mine if r["steps_to_beat_bc"] is not None]
            start = "BC clone" if kind == "finetune" else "scratch"
            final = mean_sd([r["final_return"] for r in mine])
            lines.append(
                f"| {trainer} | {start} | {final} | {above}/{len(mine)} | {len(reached)}/{len(mine)} "
                f"| {mean_sd(reached)} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
