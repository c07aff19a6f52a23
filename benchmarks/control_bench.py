"""Control side by side: flowrl FPO, flowrl denoising-MDP PPO (dppo), flowrl Gaussian PPO and stable-baselines3 PPO.

Every method gets the same environment-step budget, the same environments, discount, GAE, minibatch and epoch
settings (`configs/control/<env>_<method>.yaml`; SB3 PPO is given the `ppo` config's values, field for field),
one torch thread, and is evaluated the same way at the end: 10 episodes from fixed seeds with deterministic
actions (the Gaussian's mean; a flow's integration from zero noise; SB3's `deterministic=True`), observations
normalised with the frozen training statistics. Runs go in `--jobs` parallel processes (2 on a 2-core
machine: each job one core); wall time and env-steps/s are those of training alone (no evaluation).

    python benchmarks/control_bench.py                               # the full table (see docs/control.md)
    python benchmarks/control_bench.py --envs pendulum --seeds 0 --steps 20000   # a quick look

Writes `benchmarks/results/control_bench.json` (every run) and `control_bench.md` (mean +- std over seeds), and
`control_bench.png` (learning curves: training-episode return against env steps, mean over seeds with a band of one
standard error), and for the bimodal task `control_bimodal.png` (sampled actions and trajectories of each method,
seed 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ENVS = {
    "pendulum": 60_000,
    "bimodal": 30_000,
    "halfcheetah": 60_000,
    "hopper": 60_000,
    "halfcheetah_zoo": 300_000,
    "hopper_zoo": 300_000,
}
"""Default env-step budget per environment (2 CPU cores: see docs/control.md)."""
METHODS = ["fpo", "dppo", "ppo", "sb3"]
LABELS = {"fpo": "flowrl FPO", "dppo": "flowrl denoising-MDP PPO", "ppo": "flowrl Gaussian PPO", "sb3": "SB3 PPO"}


def config_path(env: str, method: str) -> Path:
    return ROOT / "configs" / "control" / f"{env}_{'ppo' if method == 'sb3' else method}.yaml"


def run_flowrl(env: str, method: str, seed: int, steps: int, out: Path) -> dict:
    import torch

    from flowrl.trainers import build_trainer, load_config

    overrides = [f"total_env_steps={steps}", f"run.seed={seed}", "run.log_with=[]", "run.threads=1", "eval.every=0"]
    config = load_config(config_path(env, method), overrides)
    torch.set_num_threads(1)
    trainer = build_trainer(config, output_dir=out)
    summary = trainer.train(overwrite=True)
    history = trainer.log.history
    train_s = sum(r.get("time_s", 0.0) for r in history if r.get("epoch", 0) > 0)
    per_epoch = config.env.num_envs * config.env.steps_per_env
    curve = [
        [r["epoch"] * per_epoch, r["reward/mean"]]
        for r in history
        if r.get("epoch", 0) > 0 and math.isfinite(r.get("reward/mean", float("nan")))
    ]
    row = {
        "return": summary["eval_end"]["eval/reward"],
        "train_s": train_s,
        "env_steps": trainer.state.samples_scored,
        "curve": curve,
    }
    if env == "bimodal":
        row.update(
            {
                k.removeprefix("eval/"): v
                for k, v in summary["eval_end"].items()
                if k in ("eval/saddle_up", "eval/top_fraction", "eval/saddle_success")
            }
        )
        _panel(trainer.evaluator.raw_stochastic_act, method, seed, out)
    return row


def run_sb3(env: str, seed: int, steps: int, out: Path) -> dict:
    """SB3 PPO with the flowrl `ppo` config's settings, field for field."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from flowrl.control.envs import register_envs
    from flowrl.trainers import load_config

    torch.set_num_threads(1)
    os.environ.setdefault("SB3_LOGDIR", str(out / "sb3_logs"))  # SB3 makes a log folder per run, in /tmp by default
    register_envs()
    c = load_config(config_path(env, "sb3"), [f"total_env_steps={steps}"])
    e = c.env
    venv = make_vec_env(e.id, n_envs=e.num_envs, seed=seed, env_kwargs=e.kwargs)
    if e.normalize_obs or e.normalize_reward:
        venv = VecNormalize(
            venv,
            norm_obs=e.normalize_obs,
            norm_reward=e.normalize_reward,
            clip_obs=e.clip_obs,
            clip_reward=e.clip_reward,
            gamma=c.advantage.gamma,
        )
    p = c.policy
    if (p.ortho_init, p.activation) != (c.critic.ortho_init, c.critic.activation):
        raise ValueError("SB3's MlpPolicy has one ortho_init and activation for both networks: set both alike")
    activation = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU, "silu": torch.nn.SiLU}[p.activation]
    model = PPO(
        "MlpPolicy",
        venv,
        learning_rate=c.optim.lr,
        n_steps=e.steps_per_env,
        batch_size=c.batch.mini_batch_size,
        n_epochs=c.batch.inner_epochs,
        gamma=c.advantage.gamma,
        gae_lambda=c.advantage.lam,
        clip_range=c.objective.clip_eps_low or 0.2,
        normalize_advantage=c.advantage.normalize,
        ent_coef=c.ent_coef,
        vf_coef=c.vf_coef,
        max_grad_norm=c.optim.max_grad_norm,
        target_kl=c.objective.target_kl,
        seed=seed,
        device="cpu",
        policy_kwargs={
            "net_arch": {"pi": [p.hidden] * p.depth, "vf": [c.critic.hidden] * c.critic.depth},
            "activation_fn": activation,
            "log_std_init": p.log_std_init,
            "ortho_init": p.ortho_init,
        },
    )
    budget = c.run.epochs * e.num_envs * e.steps_per_env  # whole rollouts, as flowrl's epochs
    curve = _curve_callback()
    start = time.time()
    model.learn(budget, callback=curve)
    train_s = time.time() - start
    row = {
        "return": _sb3_eval(model, venv, c),
        "train_s": train_s,
        "env_steps": int(model.num_timesteps),
        "curve": curve.points,
    }
    if env == "bimodal":
        from flowrl.control.bimodal import bimodal_metrics

        act = _sb3_act(model, venv)
        row.update(bimodal_metrics(act, seed=c.eval.seed))
        _panel(act, "sb3", seed, out)
    return row


def _curve_callback():
    """An SB3 callback: `points` = [env steps, mean raw return of the episodes that ended in the rollout]."""
    from stable_baselines3.common.callbacks import BaseCallback

    class Curve(BaseCallback):
        def __init__(self):
            super().__init__()
            self.points, self._returns = [], []

        def _on_step(self) -> bool:
            self._returns += [info["episode"]["r"] for info in self.locals["infos"] if "episode" in info]
            return True

        def _on_rollout_end(self) -> None:
            if self._returns:
                self.points.append([int(self.model.num_timesteps), float(np.mean(self._returns))])
            self._returns = []

    return Curve()


def _normalise(venv, obs):
    from stable_baselines3.common.vec_env import VecNormalize

    return venv.normalize_obs(obs) if isinstance(venv, VecNormalize) else obs


def _sb3_act(model, venv):
    import torch

    def act(raw_obs, generator):
        torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=generator)))
        actions, _ = model.predict(_normalise(venv, raw_obs.numpy()), deterministic=False)
        return torch.as_tensor(actions, dtype=torch.float32)

    return act


def _sb3_eval(model, venv, c) -> float:
    """flowrl's evaluation protocol: `eval.episodes` episodes from seed `eval.seed`, deterministic actions."""
    from flowrl.control.envs import make_vec_env

    envs = make_vec_env(c.env.id, c.eval.episodes, c.env.kwargs)
    space = envs.single_action_space
    raw, _ = envs.reset(seed=c.eval.seed)
    total, alive = np.zeros(c.eval.episodes), np.ones(c.eval.episodes, bool)
    while alive.any():
        actions, _ = model.predict(_normalise(venv, raw), deterministic=True)
        raw, reward, terminated, truncated, _ = envs.step(np.clip(actions, space.low, space.high))
        total[alive] += reward[alive]
        alive &= ~(terminated | truncated)
    envs.close()
    return float(total.mean())


def _panel(act, method: str, seed: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flowrl.control.bimodal import plot_bimodal

    fig, ax = plt.subplots(figsize=(3.2, 3.2))
    plot_bimodal(act, ax, seed=seed, title=f"{LABELS[method]} (seed {seed})")
    fig.tight_layout()
    fig.savefig(out / "bimodal.png", dpi=90)
    plt.close(fig)


def single(env: str, method: str, seed: int, steps: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    row = run_sb3(env, seed, steps, out) if method == "sb3" else run_flowrl(env, method, seed, steps, out)
    row.update(env=env, method=method, seed=seed, budget=steps)
    row["env_steps_per_s"] = row["env_steps"] / row["train_s"]
    (out / "result.json").write_text(json.dumps(row))
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| environment | budget | method | final return (mean ± std) | SE | seeds | train wall s | env-steps/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for env in dict.fromkeys(r["env"] for r in rows):
        for method in METHODS:
            group = [r for r in rows if r["env"] == env and r["method"] == method]
            if not group:
                continue
            ret = np.array([r["return"] for r in group])
            se = ret.std(ddof=1) / np.sqrt(len(ret)) if len(ret) > 1 else float("nan")
            lines.append(
                f"| {env} | {group[0]['budget'] // 1000}k | {LABELS[method]} | {ret.mean():.1f} ± "
                f"{ret.std():.1f} | {se:.1f} | {len(group)} | {np.mean([r['train_s'] for r in group]):.0f} | "
                f"{np.mean([r['env_steps_per_s'] for r in group]):.0f} |"
            )
    bimodal = [r for r in rows if r["env"] == "bimodal"]
    if bimodal:
        header = "| bimodal probes | saddle_up P(a_y > 0) at (x, 0) | top_fraction from (0, 0) | success from (0, 0) |"
        lines += ["", header, "|---|---|---|---|"]
        for method in METHODS:
            group = [r for r in bimodal if r["method"] == method]
            if group:
                keys = ("saddle_up", "top_fraction", "saddle_success")
                cells = [", ".join(f"{r[k]:.2f}" for r in group) for k in keys]
                lines.append(f"| {LABELS[method]} | {cells[0]} | {cells[1]} | {cells[2]} |")
    return "\n".join(lines)


def plot_curves(rows: list[dict], path: Path, bins: int = 30) -> None:
    """Training-episode return against env steps per environment: each method's mean over seeds with a band of one
    standard error (each seed's episodes averaged in `bins` equal windows of the budget first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = [
        env for env in dict.fromkeys(r["env"] for r in rows) if any(r.get("curve") for r in rows if r["env"] == env)
    ]
    if not envs:
        return
    fig, axes = plt.subplots(1, len(envs), figsize=(4.2 * len(envs), 3.2), squeeze=False)
    for ax, env in zip(axes[0], envs):
        for method in METHODS:
            group = [r for r in rows if r["env"] == env and r["method"] == method and r.get("curve")]
            if not group:
                continue
            edges = np.linspace(0, group[0]["budget"], bins + 1)
            per_seed = []
            for r in group:
                steps, ret = np.array(r["curve"], dtype=float).T
                idx = np.clip(np.searchsorted(edges, steps, side="left") - 1, 0, bins - 1)
                per_seed.append([ret[idx == b].mean() if (idx == b).any() else np.nan for b in range(bins)])
            y = np.array(per_seed)
            mid = (edges[:-1] + edges[1:]) / 2
            n = np.sum(np.isfinite(y), axis=0)
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # empty windows and single seeds give NaN
                mean = np.nanmean(y, axis=0)
                se = np.nan_to_num(np.nanstd(y, axis=0, ddof=1) / np.sqrt(np.maximum(n, 1)))
            keep = n > 0  # windows where no seed finished an episode are left out
            ax.plot(mid[keep], mean[keep], label=f"{LABELS[method]} ({len(group)} seeds)")
            ax.fill_between(mid[keep], (mean - se)[keep], (mean + se)[keep], alpha=0.25)
        ax.set_title(env)
        ax.set_xlabel("env steps")
        ax.set_ylabel("training episode return")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def stitch(rows: list[dict], runs: Path) -> None:
    """The seed-0 bimodal panels of every method side by side."""
    from PIL import Image

    panels = [runs / f"bimodal_{m}_seed0" / "bimodal.png" for m in METHODS]
    images = [Image.open(p) for p in panels if p.is_file()]
    if not images:
        return
    width, height = sum(i.width for i in images), max(i.height for i in images)
    canvas = Image.new("RGB", (width, height), "white")
    x = 0
    for image in images:
        canvas.paste(image, (x, 0))
        x += image.width
    canvas.save(RESULTS / "control_bimodal.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # halfcheetah_zoo and hopper_zoo (the zoo's tuned PPO settings) have ppo and sb3 configs only: --methods ppo,sb3
    parser.add_argument("--envs", default="pendulum,bimodal,halfcheetah,hopper")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, help="env-step budget for every environment (default: per environment)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs (one torch thread each)")
    parser.add_argument("--runs", default="/tmp/flowrl_control_bench", help="run folders")
    parser.add_argument("--out", default=str(RESULTS / "control_bench.json"))
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep runs whose result.json is already in --runs (rerun only the missing ones)",
    )
    parser.add_argument("--single", nargs=4, metavar=("ENV", "METHOD", "SEED", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    runs = Path(args.runs)
    if args.single:
        env, method, seed, steps = args.single
        single(env, method, int(seed), int(steps), runs / f"{env}_{method}_seed{seed}")
        return 0
    jobs = [
        (env, method, int(seed), args.steps or ENVS[env])
        for env in args.envs.split(",")
        for seed in args.seeds.split(",")
        for method in args.methods.split(",")
    ]
    # the slowest first, so the parallel slots stay busy
    order = sorted(jobs, key=lambda j: -j[3] * {"dppo": 3, "fpo": 2}.get(j[1], 1))
    pending, running, rows = list(order), [], []
    if args.reuse:
        done = [j for j in pending if (runs / f"{j[0]}_{j[1]}_seed{j[2]}" / "result.json").is_file()]
        rows = [json.loads((runs / f"{j[0]}_{j[1]}_seed{j[2]}" / "result.json").read_text()) for j in done]
        rows = [r for r, j in zip(rows, done) if r["budget"] == j[3]]
        pending = [j for j in pending if not any((r["env"], r["method"], r["seed"]) == j[:3] for r in rows)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOWRL_THREADING": "torch"}
    while pending or running:
        while pending and len(running) < args.jobs:
            job = pending.pop(0)
            cmd = [sys.executable, __file__, "--runs", str(runs), "--single", job[0], job[1], str(job[2]), str(job[3])]
            runs.mkdir(parents=True, exist_ok=True)
            log = open(runs / f"{job[0]}_{job[1]}_seed{job[2]}.log", "w")
            running.append((job, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        time.sleep(1.0)
        for item in list(running):
            job, proc, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            result = runs / f"{job[0]}_{job[1]}_seed{job[2]}" / "result.json"
            if proc.returncode != 0 or not result.is_file():
                print(f"FAILED {job} (see {log.name})", flush=True)
                continue
            row = json.loads(result.read_text())
            rows.append(row)
            print(
                f"{job[0]:12s} {job[1]:5s} seed {job[2]}: return {row['return']:9.1f}  {row['train_s']:6.0f} s  "
                f"{row['env_steps_per_s']:6.0f} steps/s",
                flush=True,
            )
    rows.sort(key=lambda r: (list(ENVS).index(r["env"]), METHODS.index(r["method"]), r["seed"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"jobs": args.jobs, "threads_per_job": 1, "cpu": _cpu(), "date": time.strftime("%Y-%m-%d")}
    out.write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
    text = table(rows)
    out.with_suffix(".md").write_text(text + "\n")
    stitch(rows, runs)
    plot_curves(rows, out.with_suffix(".png"))
    print(text)
    return 0 if not math.isnan(sum(r["return"] for r in rows)) else 1


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
