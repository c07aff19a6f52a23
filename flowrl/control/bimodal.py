"""The bimodal point mass (`flowrl/BimodalPointMass-v0`): a multimodal, under-conditioned control task.

In the spirit of FPO's grid world (McAllister et al. 2025, arXiv:2507.21053 sec. 4.1, "two walls"): a point mass
in `[-1, 1]^2` earns +1 on entering either goal band, `y >= 0.9` or `y <= -0.9`, which ends the episode (50-step
limit). On the line `y = 0` both goals are equally far, so "up" and "down" are both optimal actions: a flow policy
can keep both modes, a Gaussian one has to pick one per state. Neither objective rewards keeping both, so
coverage is a reported metric, not a guarantee.

Probes (`bimodal_metrics`): `saddle_up`, the fraction of sampled actions at `(x, 0)` that point up (strictly
inside (0, 1) for a policy that keeps both modes), and `top_fraction`, the fraction of episodes from `(0, 0)` that
end in the top goal (FPO's Fig. 1 right as a number). `plot_bimodal` draws the action field and trajectories.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch


class BimodalPointMass(gym.Env):
    """A point mass `p` moved by `p <- clip(p + speed * clip(a, -1, 1), -1, 1)`; observation `p`.

    Reward +1 on entering a goal band (`y >= goal` or `y <= -goal`), which ends the episode; 0 otherwise. Starts
    are uniform over the non-goal region, or `start` when given (probes start at the saddle).
    """

    metadata = {"render_modes": []}

    def __init__(self, goal: float = 0.9, speed: float = 0.1, start: tuple[float, float] | None = None):
        self.goal, self.speed, self.start = float(goal), float(speed), start
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.p = np.zeros(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.start is not None:
            self.p = np.asarray(self.start, dtype=np.float64).copy()
        else:
            self.p = self.np_random.uniform([-1.0, -self.goal], [1.0, self.goal])
        return self.p.astype(np.float32), {}

    def step(self, action):
        a = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
        self.p = np.clip(self.p + self.speed * a, -1.0, 1.0)
        top, bottom = self.p[1] >= self.goal, self.p[1] <= -self.goal
        done = bool(top or bottom)
        return self.p.astype(np.float32), float(done), done, False, {"goal": 1 if top else (-1 if bottom else 0)}


@torch.no_grad()
def rollouts(
    act, starts: np.ndarray, *, generator: torch.Generator, goal: float = 0.9, speed: float = 0.1, max_steps: int = 50
):
    """Trajectories `[N, T + 1, 2]` (NaN after the end) and the goal reached `[N]` (+1 top, -1 bottom, 0 none).

    `act(raw_obs [N, 2], generator) -> actions [N, 2]` is the policy's stochastic action for raw observations.
    """
    p = np.asarray(starts, np.float64).copy()
    n = len(p)
    path = np.full((n, max_steps + 1, 2), np.nan)
    path[:, 0] = p
    reached = np.zeros(n, np.int64)
    alive = np.ones(n, bool)
    for t in range(max_steps):
        a = act(torch.as_tensor(p, dtype=torch.float32), generator).numpy().astype(np.float64)
        p = np.where(alive[:, None], np.clip(p + speed * np.clip(a, -1, 1), -1, 1), p)
        path[alive, t + 1] = p[alive]
        top, bottom = alive & (p[:, 1] >= goal), alive & (p[:, 1] <= -goal)
        reached[top], reached[bottom] = 1, -1
        alive &= ~(top | bottom)
        if not alive.any():
            break
    return path, reached


@torch.no_grad()
def bimodal_metrics(act, *, seed: int = 0, episodes: int = 100, probes: int = 1000) -> dict[str, float]:
    """`saddle_up`: P(a_y > 0) over `probes` actions at `(x, 0)`, x uniform; `top_fraction`: the share of the
    episodes from `(0, 0)` that reached the top goal; `saddle_success`: the share that reached either goal."""
    generator = torch.Generator().manual_seed(seed)
    xs = torch.rand(probes, generator=generator) * 1.6 - 0.8
    actions = act(torch.stack([xs, torch.zeros(probes)], dim=1), generator)
    _, reached = rollouts(act, np.zeros((episodes, 2)), generator=generator)
    done = reached != 0
    return {
        "saddle_up": float((actions[:, 1] > 0).float().mean()),
        "top_fraction": float((reached == 1).sum() / max(done.sum(), 1)),
        "saddle_success": float(done.mean()),
    }


def plot_bimodal(act, ax, *, seed: int = 0, title: str = "") -> None:
    """One sampled action per grid cell (arrows, coloured by direction) and 8 trajectories from each of 3 starts
    on the saddle line `y = 0`, on the matplotlib axes `ax`."""
    generator = torch.Generator().manual_seed(seed)
    g = np.linspace(-0.95, 0.95, 15)
    xx, yy = np.meshgrid(g, g)
    grid = torch.as_tensor(np.stack([xx.ravel(), yy.ravel()], 1), dtype=torch.float32)
    a = act(grid, generator).clamp(-1, 1).numpy()
    ax.axhspan(0.9, 1.0, color="tab:green", alpha=0.2)
    ax.axhspan(-1.0, -0.9, color="tab:green", alpha=0.2)
    ax.quiver(xx.ravel(), yy.ravel(), a[:, 0], a[:, 1], np.sign(a[:, 1]), cmap="coolwarm", scale=25, width=0.004)
    starts = np.repeat(np.array([[-0.5, 0.0], [0.0, 0.0], [0.5, 0.0]]), 8, axis=0)
    path, _ = rollouts(act, starts, generator=generator)
    for trajectory in path:
        ax.plot(trajectory[:, 0], trajectory[:, 1], color="black", alpha=0.5, linewidth=0.8)
    ax.plot(starts[:, 0], starts[:, 1], "k*", markersize=8)
    ax.set_xlim(-1, 1)
    ax.set_ylim(-1, 1)
    ax.set_aspect("equal")
    ax.set_title(title, fontsize=9)
