"""Collecting transitions from vectorised Gymnasium environments, and evaluating a policy on them.

Every epoch starts fresh episodes from seeds `(run.seed, epoch)` (environment `e` from that seed plus `e`), so
an epoch's rollout depends only on the weights and normalisation statistics at its start: a resumed run
collects exactly what the uninterrupted one did (no environment state needs saving).

With several processes each steps its contiguous share of the `num_envs` environments. After every step the
processes exchange their environments' observations, rewards and ends (one all-gather), so every process
updates the normalisation statistics with every environment's data and runs the (small) policy on every
environment's observation with one shared noise stream, keeping the rows of its own environments: an epoch's
transitions are those of one process stepping all `num_envs` environments.

The episode still running at the epoch's end is bootstrapped with `V(s_T)`, as is a time-limit truncation
(`r_t + gamma V(final_obs)`, SB3's convention); a termination is not. Advantages are GAE over the environment
steps (`flowrl.core.gae`). The collector returns the transitions as a typed `Collected` batch; an algorithm adds
the behaviour log-probabilities it re-scores against (`ControlAlgorithm.prepare`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from flowrl.control.envs import Normalizer, make_vec_env
from flowrl.control.rollout import ControlRollout
from flowrl.core import gae
from flowrl.policies.rollout import Collected
from flowrl.runtime import seeded


def env_seed(*parts: int) -> int:
    """A 31-bit environment seed from integers."""
    return int(seeded(*parts).initial_seed() % (2**31 - 1))


def act(actor, obs: torch.Tensor, generator: torch.Generator, chain: bool = False):
    """`(actions [E, A], chain [E, K + 1, A] or None)`: the policy's sampled actions (with `chain`, a flow policy's
    whole stochastic denoising chain, whose last state is the action: the denoising MDP)."""
    if chain:
        steps = actor.chain(obs, generator)
        return steps[:, -1], steps
    return actor.act(obs, generator), None


class ControlCollector:
    """Steps `num_envs` environments for `steps_per_env` steps with the policy, then GAE.

    Args:
        env_id (`str`), num_envs (`int`), steps_per_env (`int`), env_kwargs (`dict`): the environments
            (`num_envs` of every process together).
        normalizer (`Normalizer`): observation / reward normalisation (updated while collecting).
        policy (`ActorCritic`): samples actions (`actor.act`, or `actor.chain` with `chain`) and values.
        chain (`bool`): keep a flow policy's denoising chain (`dppo`).
        gamma (`float`), lam (`float`): discount and GAE lambda.
        seed (`int`): seeds of the episodes and the action noise.
        processes (`Processes`, *optional*): this process's share of the environments (None: all of them).
        continue_episodes (`bool`): carry each environment's episode into the next `collect` (only the first one
            resets, from its epoch's seeds) instead of starting fresh episodes every epoch.
        vectorization (`str`): `"sync"` or `"async"` (`EnvConfig.vectorization`); `close()` ends async workers.
    """

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        steps_per_env: int,
        env_kwargs: dict,
        normalizer: Normalizer,
        policy,
        *,
        chain: bool = False,
        gamma: float,
        lam: float,
        seed: int,
        processes=None,
        continue_episodes: bool = False,
        vectorization: str = "sync",
    ):
        self.processes = processes
        world, rank = (processes.world, processes.rank) if processes is not None else (1, 0)
        if num_envs % world:
            raise ValueError(f"env.num_envs={num_envs} environments do not split over {world} processes")
        share = num_envs // world
        self.mine = slice(rank * share, (rank + 1) * share)  # this process's environments
        self.envs = make_vec_env(env_id, share, env_kwargs, vectorization)
        space = self.envs.single_action_space
        self.low, self.high = space.low.astype(np.float64), space.high.astype(np.float64)
        self.num_envs, self.steps = num_envs, steps_per_env
        self.normalizer, self.policy, self.chain = normalizer, policy, chain
        self.gamma, self.lam, self.seed = gamma, lam, seed
        self.continue_episodes = continue_episodes
        self.carry = None  # (raw observations [E, O], episode returns [E], lengths [E]) of the running episodes

    def close(self) -> None:
        """Close the environments (an `async` vector environment's worker processes)."""
        self.envs.close()

    def _everyone(self, *parts: np.ndarray) -> list[np.ndarray]:
        """This process's `[e, ...]` arrays -> every process's `[E, ...]` (one all-gather of them all)."""
        if self.processes is None or self.processes.world == 1:
            return [np.asarray(p, np.float64) for p in parts]
        flat = [np.asarray(p, np.float64).reshape(len(p), -1) for p in parts]
        widths = [f.shape[1] for f in flat]
        gathered = self.processes.gather(torch.from_numpy(np.concatenate(flat, 1))).numpy()
        out, at = [], 0
        for part, width in zip(parts, widths):
            out.append(gathered[:, at : at + width].reshape(-1, *np.shape(part)[1:]))
            at += width
        return out

    def rows(self) -> torch.Tensor:
        """`[T * e]` positions of this process's transitions in the whole epoch's time-major rollout."""
        envs = torch.arange(self.num_envs)[self.mine]
        return (torch.arange(self.steps)[:, None] * self.num_envs + envs).reshape(-1)

    @torch.no_grad()
    def collect(self, epoch: int) -> Collected:
        start = time.time()
        n, norm, mine = self.num_envs, self.normalizer, self.mine
        if self.carry is None:  # fresh episodes: every epoch, or the first with continue_episodes
            norm.start_epoch()
            first = env_seed(self.seed, epoch, 11, 0)  # environment e starts from first + e (gymnasium's convention)
            raw, _ = self.envs.reset(seed=[first + e for e in range(n)[mine]])
            (raw,) = self._everyone(raw)
            episode_return, episode_length = np.zeros(n), np.zeros(n, np.int64)
        else:
            raw, episode_return, episode_length = self.carry
        generator = seeded(self.seed, epoch, 12, 0)  # one stream, drawn for every environment on every process
        obs_t, actions_t, chains, rewards, dones, values = [], [], [], [], [], []
        returns, lengths = [], []
        for _ in range(self.steps):
            obs = torch.from_numpy(norm.observe(raw, update=True))  # [E, O]
            actions, chain = act(self.policy.actor, obs, generator, self.chain)
            value = self.policy.value(obs)
            local = np.clip(actions[mine].numpy(), self.low, self.high)
            raw, reward, terminated, truncated, info = self.envs.step(local)
            bootstrap = np.flatnonzero(truncated & ~terminated)
            final_value = None
            if len(bootstrap):  # a time limit is not a termination: r + gamma V(s_final)
                final = np.stack([info["final_obs"][e] for e in bootstrap])
                final_value = self.policy.value(torch.from_numpy(norm.observe(final, update=False)))
            raw, reward, terminated, truncated = self._everyone(raw, reward, terminated, truncated)
            terminated, truncated = terminated.astype(bool), truncated.astype(bool)
            done = terminated | truncated
            episode_return += reward
            episode_length += 1
            for e in np.flatnonzero(done):
                returns.append(float(episode_return[e]))
                lengths.append(int(episode_length[e]))
            episode_return[done], episode_length[done] = 0.0, 0
            scaled = torch.from_numpy(norm.reward(reward, done)).float()[mine]
            if final_value is not None:
                scaled[bootstrap] += self.gamma * final_value
            obs_t.append(obs[mine])
            actions_t.append(actions[mine])
            chains.append(chain[mine] if chain is not None else None)
            rewards.append(scaled)
            dones.append(torch.from_numpy(done[mine]))
            values.append(value[mine])
        last_value = self.policy.value(torch.from_numpy(norm.observe(raw, update=False)))[mine]
        if self.continue_episodes:  # the unfinished episodes go on next epoch (bootstrapped with V here)
            self.carry = (raw, episode_return, episode_length)
        collect_s = time.time() - start
        # GAE over [e, T]; rows are time-major [T * e]
        v = torch.stack(values, 1)  # [e, T]
        adv, ret = gae(torch.stack(rewards, 1), v, torch.stack(dones, 1), last_value, gamma=self.gamma, lam=self.lam)
        rollout = ControlRollout(
            obs=torch.cat(obs_t),
            actions=torch.cat(actions_t).float(),
            values=v.T.reshape(-1),
            advantages=adv.T.reshape(-1),
            returns=ret.T.reshape(-1),
            chain=torch.cat(chains) if chains[0] is not None else None,
        )
        info = {"episode_returns": returns, "episode_lengths": lengths}
        return Collected(
            data=rollout, rows=self.rows(), size=n * self.steps, times={"time/collect_s": collect_s}, info=info
        )


class ControlEvaluator:
    """`episodes` episodes from fixed seeds (the same at every evaluation) with the policy's evaluation actions
    (`deterministic`: the Gaussian's mean, a flow's integration from zero noise), observations normalised with the
    current statistics (not updated). `extra(act)` adds task probes (the bimodal task's `saddle_up`,
    `top_fraction`) computed with the stochastic policy (`chain`: its denoising chain) on raw observations."""

    def __init__(
        self,
        env_id: str,
        env_kwargs: dict,
        episodes: int,
        seed: int,
        normalizer: Normalizer,
        policy,
        *,
        deterministic: bool = True,
        chain: bool = False,
        extra: Callable | None = None,
    ):
        self.env_id, self.env_kwargs, self.episodes, self.seed = env_id, env_kwargs, episodes, seed
        self.normalizer, self.policy, self.extra = normalizer, policy, extra
        self.deterministic, self.chain = deterministic, chain
        self.envs = None

    def act(self, obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.policy.actor.act(obs, generator, deterministic=self.deterministic)

    def stochastic_act(self, obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return act(self.policy.actor, obs, generator, self.chain)[0]

    @torch.no_grad()
    def evaluate(self) -> dict:
        if self.envs is None:
            self.envs = make_vec_env(self.env_id, self.episodes, self.env_kwargs)
        space = self.envs.single_action_space
        raw, _ = self.envs.reset(seed=self.seed)
        generator = torch.Generator().manual_seed(self.seed)
        total, length = np.zeros(self.episodes), np.zeros(self.episodes, np.int64)
        alive = np.ones(self.episodes, bool)
        while alive.any():
            actions = self.act(torch.from_numpy(self.normalizer.observe(raw, update=False)), generator)
            raw, reward, terminated, truncated, _ = self.envs.step(np.clip(actions.numpy(), space.low, space.high))
            total[alive] += reward[alive]
            length[alive] += 1
            alive &= ~(terminated | truncated)
        out = {
            "eval/reward": float(total.mean()),
            "eval/reward_std": float(total.std()),
            "eval/episode_length": float(length.mean()),
        }
        if self.extra is not None:
            act = self.raw_stochastic_act
            out.update({f"eval/{k}": v for k, v in self.extra(act).items()})
        return out

    def raw_stochastic_act(self, raw_obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The stochastic policy on raw observations (normalised here): what probes and plots sample."""
        return self.stochastic_act(torch.from_numpy(self.normalizer.observe(raw_obs.numpy(), update=False)), generator)
