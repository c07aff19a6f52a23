"""Rollout speed of `env.vectorization: sync` against `async` (one worker process per environment).

    python benchmarks/vector_envs.py [--envs Pendulum-v1,HalfCheetah-v5] [--num-envs 2,8] [--epochs 6] [--pairs 3]

Times the collector alone (`ControlCollector.collect`: the policy acting, the environments stepping, the
normalisers, GAE) of the shipped `ppo` and `fpo` configs at each environment count, sync and async interleaved
(`--pairs` alternations, the first epoch of each run untimed), the learner on one torch thread. Writes
`benchmarks/results/vector_envs.{json,md}` with env-steps/s and the async/sync ratio (median over pairs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from control_finetune import write_result  # noqa: E402


CONFIG = {"Pendulum-v1": "pendulum", "HalfCheetah-v5": "halfcheetah", "Hopper-v5": "hopper"}


def steps_per_s(env_id: str, trainer: str, num_envs: int, mode: str, epochs: int, folder: Path) -> float:
    """env-steps/s of `epochs` collections after one untimed one."""
    from flowrl.trainers import build_trainer, load_config

    steps = max(2048 // num_envs, 64)
    overrides = [
        f"env.num_envs={num_envs}",
        f"env.steps_per_env={steps}",
        f"env.vectorization={mode}",
        "env.continue_episodes=true",
        "run.log_with=[]",
        "run.threads=1",
    ]
    config = load_config(ROOT / "configs" / "control" / f"{CONFIG[env_id]}_{trainer}.yaml", overrides)
    built = build_trainer(config, output_dir=folder)
    collector = built.collector
    try:
        collector.collect(0)
        start = time.perf_counter()
        for epoch in range(1, epochs + 1):
            collector.collect(epoch)
        return epochs * num_envs * steps / (time.perf_counter() - start)
    finally:
        collector.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default="Pendulum-v1,HalfCheetah-v5")
    parser.add_argument("--trainers", default="ppo,fpo")
    parser.add_argument("--num-envs", default="2,8")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vector_envs"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for env_id in args.envs.split(","):
            for trainer in args.trainers.split(","):
                for n in (int(v) for v in args.num_envs.split(",")):
                    times = {"sync": [], "async": []}
                    for pair in range(args.pairs):
                        for mode in ("sync", "async") if pair % 2 == 0 else ("async", "sync"):
                            folder = Path(tmp) / f"{env_id}-{trainer}-{n}-{mode}-{pair}"
                            times[mode].append(steps_per_s(env_id, trainer, n, mode, args.epochs, folder))
                    ratio = statistics.median(a / s for a, s in zip(times["async"], times["sync"]))
                    medians = {mode: statistics.median(v) for mode, v in times.items()}
                    row = {"env": env_id, "trainer": trainer, "num_envs": n, **medians, "ratio": ratio}
                    rows.append(row)
                    print(
                        f"{env_id} {trainer} x{n}: sync {row['sync']:.0f}, async {row['async']:.0f} env-steps/s "
                        f"({row['ratio']:.2f}x)",
                        flush=True,
                    )
    lines = [
        "| environment | trainer | envs | sync env-steps/s | async env-steps/s | async / sync |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['env']} | {r['trainer']} | {r['num_envs']} | {r['sync']:.0f} | {r['async']:.0f} | {r['ratio']:.2f} |"
        for r in rows
    ]
    meta = {"date": time.strftime("%Y-%m-%d"), "torch_threads": 1, "epochs": args.epochs, "pairs": args.pairs}
    write_result({"meta": meta, "rows": rows}, args.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
