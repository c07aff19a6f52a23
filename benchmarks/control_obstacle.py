"""Two routes around an obstacle: a flow policy and a Gaussian policy cloned from the same bimodal demonstrations.

    python benchmarks/control_obstacle.py [--seeds 0,1,2,3,4] [--episodes 50] [--jobs 2]

The scripted expert of `flowrl.control.obstacle` goes around the disc above or below at random (`--episodes`
demonstrations, seed 0); `configs/control/obstacle_bc.yaml` clones it with `actor: flow` and `actor: gaussian` for
every seed. Each clone is then run for 1000 episodes from the task's starts with sampled actions (and, as a second
reading, its deterministic action: the Gaussian's mean, the flow's integration from zero noise): the share that
reaches the goal, the share that hits the disc, and of the successful ones the share that went above. Writes
`benchmarks/results/control_obstacle.{json,md}`.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from control_finetune import flowrl, mean_sd, write_result  # noqa: E402

from flowrl.control.obstacle import obstacle_metrics, scripted_demonstrations  # noqa: E402


def train(demos: Path, actor: str, seed: int, out: Path) -> Path:
    config = str(ROOT / "configs" / "control" / "obstacle_bc.yaml")
    flowrl(
        "train",
        config,
        "--set",
        f"demonstrations={demos}",
        "--set",
        f"actor={actor}",
        "--set",
        f"run.seed={seed}",
        "--output-dir",
        str(out),
        "--overwrite",
    )
    return out


def measure(run: Path, episodes: int) -> dict:
    from flowrl.trainers import load_run

    actor = load_run(run, device="cpu").algorithm.policy.actor  # the demonstrations are raw observations

    def sampled(obs, generator):
        return actor.act(obs, generator, deterministic=False)

    def deterministic(obs, generator):
        return actor.act(obs, generator, deterministic=True)

    return {
        "sampled": obstacle_metrics(sampled, seed=1, episodes=episodes),
        "deterministic": obstacle_metrics(deterministic, seed=1, episodes=episodes),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--episodes", type=int, default=50, help="demonstration episodes")
    parser.add_argument("--eval-episodes", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--runs", default="/tmp/flowrl-control-obstacle")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "control_obstacle"))
    args = parser.parse_args()
    runs, start = Path(args.runs), time.time()
    seeds = [int(s) for s in args.seeds.split(",")]
    demos = scripted_demonstrations(args.episodes, seed=0)
    path = demos.save(runs / "demos.npz")

    with ThreadPoolExecutor(args.jobs) as pool:
        jobs = {(a, s): pool.submit(train, path, a, s, runs / f"{a}_{s}") for a in ("flow", "gaussian") for s in seeds}
        folders = {key: job.result() for key, job in jobs.items()}
    rows = [{"actor": a, "seed": s, **measure(folders[(a, s)], args.eval_episodes)} for (a, s) in folders]
    result = {
        "benchmark": "control_obstacle",
        "env": "flowrl/ObstaclePointMass-v0",
        "seeds": seeds,
        "demonstrations": {
            "episodes": args.episodes,
            "transitions": len(demos),
            "expert_success": float(demos.episode_returns.mean()),
        },
        "eval_episodes": args.eval_episodes,
        "rows": rows,
        "wall_s": round(time.time() - start),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_result(result, args.out, markdown(result))


def markdown(result: dict) -> str:
    def stat(values):
        return mean_sd(values, digits=3)

    demos = result["demonstrations"]
    lines = [
        f"flowrl/ObstaclePointMass-v0: {demos['episodes']} demonstrations of the scripted two-route expert "
        f"({demos['transitions']} transitions, {demos['expert_success']:.2f} of its episodes succeed), cloned by "
        f"`configs/control/obstacle_bc.yaml` per seed {result['seeds']}; {result['eval_episodes']} episodes per "
        "clone. Mean ± std over seeds; per seed in the JSON.",
        "",
        "| actor | actions | success | collided | above (of the successes) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for actor in ("flow", "gaussian"):
        for mode in ("sampled", "deterministic"):
            mine = [r[mode] for r in result["rows"] if r["actor"] == actor]
            lines.append(
                f"| {actor} | {mode} | {stat([m['success'] for m in mine])} | "
                f"{stat([m['collided'] for m in mine])} | {stat([m['above'] for m in mine])} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
