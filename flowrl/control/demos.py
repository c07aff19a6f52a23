"""Demonstrations for behaviour cloning: `(observation, action)` pairs of an expert, in a `.npz` file.

`record` runs any control policy (a trained Gaussian PPO run, say) for whole episodes from fixed seeds and keeps
what it did, with Gaussian noise `noise * N(0, 1)` added to each action (a noisier, less skilled demonstrator);
`flowrl demos RUN` does it for a run folder. The file holds `obs [N, obs_dim]` (raw, unnormalised),
`actions [N, act_dim]` (as executed: clipped to the action box), `episode_returns [E]` and `env_id`, in numpy's
format without pickles. `load_demonstrations` reads it back and checks the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flowrl.control.envs import make_vec_env


@dataclass
class Demonstrations:
    """An expert's transitions (see the module docstring)."""

    obs: torch.Tensor
    """`[N, obs_dim]` raw observations."""
    actions: torch.Tensor
    """`[N, act_dim]` the actions taken, in the environment's units."""
    episode_returns: np.ndarray
    """`[E]` the return of each recorded episode."""
    env_id: str

    def __len__(self) -> int:
        return len(self.obs)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:  # (np.savez would add ".npz" to a name without it)
            np.savez(
                f,
                obs=self.obs.numpy(),
                actions=self.actions.numpy(),
                episode_returns=self.episode_returns,
                env_id=np.array(self.env_id),
            )
        return path


def load_demonstrations(path: str | Path, obs_dim: int | None = None, act_dim: int | None = None) -> Demonstrations:
    """The demonstrations in `path` (written by `Demonstrations.save` / `flowrl demos`), checked against the
    environment's sizes when given; a missing file, a file of another format or other sizes fail in one line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"demonstrations file {path} does not exist (write one with `flowrl demos RUN`)")
    try:
        with np.load(path, allow_pickle=False) as data:
            obs, actions = data["obs"], data["actions"]
            returns, env_id = data.get("episode_returns", np.zeros(0)), str(data.get("env_id", ""))
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path} is not a demonstrations file (.npz with obs and actions): {err}") from None
    if obs.ndim != 2 or actions.ndim != 2 or len(obs) != len(actions) or not len(obs):
        raise ValueError(f"{path}: obs {obs.shape} and actions {actions.shape} must be [N, obs_dim] and [N, act_dim]")
    for name, size, want in (("obs", obs.shape[1], obs_dim), ("actions", actions.shape[1], act_dim)):
        if want is not None and size != want:
            raise ValueError(f"{path}: {name} have {size} dimensions, the environment {want}")
    if not (np.isfinite(obs).all() and np.isfinite(actions).all()):
        raise ValueError(f"{path} holds non-finite observations or actions")
    return Demonstrations(
        torch.from_numpy(obs.astype(np.float32)), torch.from_numpy(actions.astype(np.float32)), returns, env_id
    )


@torch.no_grad()
def record(
    actor,
    normalizer,
    env_id: str,
    env_kwargs: dict | None = None,
    *,
    episodes: int = 20,
    noise: float = 0.0,
    seed: int = 0,
) -> Demonstrations:
    """`episodes` whole episodes of `actor` (its evaluation action, `act(obs, deterministic=True)`, on observations
    normalised by `normalizer` as in its training) plus `noise * N(0, 1)`, from seeds `seed, seed + 1, ...`."""
    if episodes < 1 or noise < 0:
        raise ValueError(f"episodes must be >= 1 and noise >= 0, got {episodes} and {noise}")
    envs = make_vec_env(env_id, episodes, env_kwargs or {})
    space = envs.single_action_space
    raw, _ = envs.reset(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    alive = np.ones(episodes, bool)
    total = np.zeros(episodes)
    obs, actions = [], []
    while alive.any():
        mean = actor.act(torch.from_numpy(normalizer.observe(raw, update=False)), generator, deterministic=True)
        taken = mean + noise * torch.randn(mean.shape, generator=generator)
        taken = np.clip(taken.numpy(), space.low, space.high)
        obs.append(raw[alive].astype(np.float32))
        actions.append(taken[alive].astype(np.float32))
        raw, reward, terminated, truncated, _ = envs.step(taken)
        total[alive] += reward[alive]
        alive &= ~(terminated | truncated)
    envs.close()
    return Demonstrations(
        torch.from_numpy(np.concatenate(obs)), torch.from_numpy(np.concatenate(actions)), total, env_id
    )
