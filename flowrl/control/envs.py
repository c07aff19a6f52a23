"""Gymnasium environments for control: vector environments, running normalisers, and the bimodal point mass.

`make_vec_env` builds `num_envs` copies of any registered Gymnasium id (MuJoCo's `HalfCheetah-v5`,
`Pendulum-v1`, ...) as a `SyncVectorEnv` in same-step autoreset mode: when an episode ends, the returned
observation is already the next episode's first one and the last one is in `info["final_obs"]` (what SB3 does,
so a time-limit truncation can be bootstrapped with `V(final_obs)`).

flowrl registers its own environments here (`flowrl/BimodalPointMass-v0`: `flowrl.control.bimodal`;
`flowrl/ObstaclePointMass-v0`: `flowrl.control.obstacle`). Gymnasium is the `rl` extra and is imported only when an
environment is built.
"""

from __future__ import annotations

import functools

import numpy as np


BIMODAL_ID = "flowrl/BimodalPointMass-v0"
OBSTACLE_ID = "flowrl/ObstaclePointMass-v0"
"""Two routes around an obstacle (`flowrl.control.obstacle`)."""


def _gym():
    try:
        import gymnasium
    except ImportError as err:  # the `rl` extra
        raise ImportError("control trainers need Gymnasium: pip install 'flowrl-toolkit[rl]'") from err
    return gymnasium


def register_envs() -> None:
    """Register flowrl's own environments with Gymnasium (idempotent)."""
    gym = _gym()
    if BIMODAL_ID not in gym.registry:
        gym.register(BIMODAL_ID, entry_point="flowrl.control.bimodal:BimodalPointMass", max_episode_steps=50)
    if OBSTACLE_ID not in gym.registry:
        gym.register(OBSTACLE_ID, entry_point="flowrl.control.obstacle:ObstaclePointMass", max_episode_steps=60)


def _make_env(env_id: str, kwargs: dict):
    """One environment (in a worker process too: flowrl's own ids are registered there first)."""
    register_envs()
    return _gym().make(env_id, **kwargs)


def make_vec_env(env_id: str, num_envs: int, kwargs: dict | None = None, vectorization: str = "sync"):
    """`num_envs` copies of `env_id` in one vector environment with same-step autoreset: a `SyncVectorEnv`, or with
    `vectorization="async"` an `AsyncVectorEnv` (one worker process per environment)."""
    gym = _gym()
    register_envs()
    from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

    try:
        gym.spec(env_id)
    except gym.error.Error as err:
        raise ValueError(
            f"unknown Gymnasium environment {env_id!r} ({err}); MuJoCo ids need pip install 'flowrl-toolkit[rl]'"
        ) from None
    if vectorization not in ("sync", "async"):
        raise ValueError(f"env.vectorization must be 'sync' or 'async', got {vectorization!r}")
    fns = [functools.partial(_make_env, env_id, dict(kwargs or {})) for _ in range(num_envs)]
    vector = AsyncVectorEnv if vectorization == "async" else SyncVectorEnv
    envs = vector(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    space = envs.single_action_space
    if not isinstance(space, gym.spaces.Box):
        envs.close()
        raise ValueError(f"{env_id} has a {type(space).__name__} action space; control policies need a Box")
    return envs


class RunningMeanStd:
    """Running mean and variance (Chan et al.'s parallel update, as SB3's `RunningMeanStd`; float64)."""

    def __init__(self, shape=(), epsilon: float = 1e-4):
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = epsilon

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float64)
        batch_mean, batch_var, n = x.mean(0), x.var(0), x.shape[0]
        delta, total = batch_mean - self.mean, self.count + n
        self.mean = self.mean + delta * n / total
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.var, self.count = m2 / total, total

    def state(self) -> dict[str, np.ndarray]:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": np.asarray(self.count, np.float64)}

    def load(self, state: dict) -> None:
        self.mean = np.asarray(state["mean"], np.float64).copy()
        self.var = np.asarray(state["var"], np.float64).copy()
        self.count = float(np.asarray(state["count"]))


class Normalizer:
    """Observation normalisation and reward scaling as SB3's `VecNormalize` (eps 1e-8, clips 10).

    Observations: `clip((o - mean) / sqrt(var + eps), +-clip_obs)` with running statistics of the raw ones.
    Rewards: divided by the running std of the discounted return `R <- gamma R + r` (reset at episode ends),
    clipped to `+-clip_reward`. Both are off unless enabled; with both off every method is the identity.
    """

    def __init__(
        self,
        obs_dim: int,
        num_envs: int,
        *,
        obs: bool,
        reward: bool,
        gamma: float,
        clip_obs: float = 10.0,
        clip_reward: float = 10.0,
        eps: float = 1e-8,
    ):
        self.norm_obs, self.norm_reward = obs, reward
        self.obs_rms, self.ret_rms = RunningMeanStd((obs_dim,)), RunningMeanStd(())
        self.gamma, self.clip_obs, self.clip_reward, self.eps = gamma, clip_obs, clip_reward, eps
        self.returns = np.zeros(num_envs)

    def observe(self, obs: np.ndarray, update: bool) -> np.ndarray:
        if not self.norm_obs:
            return np.asarray(obs, np.float32)
        if update:
            self.obs_rms.update(obs)
        normed = (obs - self.obs_rms.mean) / np.sqrt(self.obs_rms.var + self.eps)
        return np.clip(normed, -self.clip_obs, self.clip_obs).astype(np.float32)

    def reward(self, rewards: np.ndarray, dones: np.ndarray) -> np.ndarray:
        if not self.norm_reward:
            return np.asarray(rewards, np.float32)
        self.returns = self.returns * self.gamma + rewards
        self.ret_rms.update(self.returns)
        scaled = np.clip(rewards / np.sqrt(self.ret_rms.var + self.eps), -self.clip_reward, self.clip_reward)
        self.returns[dones] = 0.0
        return scaled.astype(np.float32)

    def start_epoch(self) -> None:
        """Every epoch starts fresh episodes: the discounted-return accumulators start at 0."""
        self.returns[:] = 0.0

    def state(self) -> dict[str, np.ndarray]:
        out = {f"obs.{k}": v for k, v in self.obs_rms.state().items()}
        out.update({f"ret.{k}": v for k, v in self.ret_rms.state().items()})
        return out

    def load(self, state: dict) -> None:
        self.obs_rms.load({k[4:]: v for k, v in state.items() if k.startswith("obs.")})
        self.ret_rms.load({k[4:]: v for k, v in state.items() if k.startswith("ret.")})
