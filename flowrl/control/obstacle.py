"""Two routes around an obstacle (`flowrl/ObstaclePointMass-v0`): a task where the mean of the good actions fails.

A point mass starts near `(-0.8, 0)` and earns +1 on reaching `x >= 0.8`; a disc of radius 0.35 at the origin lies
between them, and touching it ends the episode with nothing. Going around above and going around below are equally
good; going straight, the average of the two, hits the disc. `scripted_demonstrations` is an expert that picks one
route per episode at random (waypoint `(0, +-0.6)`, then straight to the goal line), so its actions near the start
are bimodal: cloning them with a Gaussian (`bc`'s `actor: gaussian`) learns their mean, a flow policy can keep both.

`obstacle_metrics` samples the policy's stochastic actions from the start (`success`: the share of episodes that
reach the goal, `above`: the share of the successful ones that passed above the disc, `collided`).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from flowrl.control.envs import OBSTACLE_ID


RADIUS, GOAL_X, START, SPEED, MAX_STEPS = 0.35, 0.8, (-0.8, 0.0), 0.1, 60


class ObstaclePointMass(gym.Env):
    """`p <- clip(p + speed * clip(a, -1, 1), -1, 1)`, observation `p`; +1 and the end on `x >= 0.8`, the end with
    0 on entering the disc `|p| < 0.35`. Starts uniform within 0.05 of `(-0.8, 0)`."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.p = np.zeros(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.p = np.asarray(START) + self.np_random.uniform(-0.05, 0.05, size=2)
        return self.p.astype(np.float32), {}

    def step(self, action):
        self.p = np.clip(self.p + SPEED * np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0), -1.0, 1.0)
        reached, hit = self.p[0] >= GOAL_X, float(np.hypot(*self.p)) < RADIUS
        return self.p.astype(np.float32), float(reached), bool(reached or hit), False, {"collided": hit}


def expert_action(p: np.ndarray, route: np.ndarray) -> np.ndarray:
    """The scripted expert's unit action `[N, 2]` at positions `p [N, 2]` on its routes `[N]` (+1 above, -1 below):
    straight ahead to `x = -0.6` (both routes share the start), then towards the waypoint `(0, 0.6 route)` until
    past `x = -0.05`, then straight towards the goal line: the routes split 2 steps before the disc."""
    n = len(p)
    waypoint = np.stack([np.zeros(n), 0.6 * route], 1)
    ahead = np.stack([np.full(n, 1.0), p[:, 1]], 1)  # straight towards +x at the current height
    split = (p[:, 0] >= -0.6) & (p[:, 0] < -0.05)
    target = np.where(split[:, None], waypoint, ahead)
    direction = target - p
    return direction / np.maximum(np.linalg.norm(direction, axis=1, keepdims=True), 1e-6)


def scripted_demonstrations(episodes: int = 50, *, seed: int = 0, noise: float = 0.1):
    """`flowrl.control.demos.Demonstrations` of the scripted expert: one random route per episode, each action plus
    `noise * N(0, 1)`, whole episodes from the environment's starts."""
    from flowrl.control.demos import Demonstrations

    rng = np.random.default_rng(seed)
    p = np.asarray(START) + rng.uniform(-0.05, 0.05, size=(episodes, 2))
    route = rng.choice([-1.0, 1.0], size=episodes)
    alive, total = np.ones(episodes, bool), np.zeros(episodes)
    obs, actions = [], []
    for _ in range(MAX_STEPS):
        a = np.clip(expert_action(p, route) + noise * rng.standard_normal((episodes, 2)), -1, 1)
        obs.append(p[alive].astype(np.float32))
        actions.append(a[alive].astype(np.float32))
        p = np.where(alive[:, None], np.clip(p + SPEED * a, -1, 1), p)
        reached, hit = alive & (p[:, 0] >= GOAL_X), alive & (np.hypot(p[:, 0], p[:, 1]) < RADIUS)
        total[reached] = 1.0
        alive &= ~(reached | hit)
        if not alive.any():
            break
    return Demonstrations(
        torch.from_numpy(np.concatenate(obs)), torch.from_numpy(np.concatenate(actions)), total, OBSTACLE_ID
    )


@torch.no_grad()
def obstacle_metrics(act, *, seed: int = 0, episodes: int = 200) -> dict[str, float]:
    """`act(raw_obs [N, 2], generator) -> actions [N, 2]` (stochastic) from `episodes` starts: `success`, `collided`
    and `above` (the share of the successful episodes whose path passed above the disc)."""
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    p = np.asarray(START) + rng.uniform(-0.05, 0.05, size=(episodes, 2))
    alive, reached, hit = np.ones(episodes, bool), np.zeros(episodes, bool), np.zeros(episodes, bool)
    y_at_0 = np.zeros(episodes)
    for _ in range(MAX_STEPS):
        a = act(torch.as_tensor(p, dtype=torch.float32), generator).numpy().astype(np.float64)
        new = np.where(alive[:, None], np.clip(p + SPEED * np.clip(a, -1, 1), -1, 1), p)
        crossing = alive & (p[:, 0] < 0) & (new[:, 0] >= 0)
        y_at_0[crossing] = new[crossing, 1]
        p = new
        now_reached, now_hit = alive & (p[:, 0] >= GOAL_X), alive & (np.hypot(p[:, 0], p[:, 1]) < RADIUS)
        reached |= now_reached
        hit |= now_hit
        alive &= ~(now_reached | now_hit)
        if not alive.any():
            break
    done = max(int(reached.sum()), 1)
    return {
        "success": float(reached.mean()),
        "collided": float(hit.mean()),
        "above": float((reached & (y_at_0 > 0)).sum() / done),
    }
