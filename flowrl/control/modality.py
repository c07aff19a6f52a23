"""The control modality of a run: the environments' shapes, the normalisers, the actor-critic, and the collector and
evaluator it builds for an algorithm (whose `build_actor` makes the policy network: Gaussian or flow)."""

from __future__ import annotations

import numpy as np
import torch

from flowrl.control.collect import ControlCollector, ControlEvaluator
from flowrl.control.config import ControlConfig, ControlCriticConfig
from flowrl.control.envs import BIMODAL_ID, OBSTACLE_ID, Normalizer, make_vec_env
from flowrl.control.policies import ActorCritic
from flowrl.runtime import RunContext


class ControlModality:
    """See the module docstring.

    Args:
        config (`ControlConfig`): the run's config.
        context (`RunContext`): processes, device and the log.
        policy (`ActorCritic`, *optional*): use this actor-critic (else the algorithm's actor, `attach`).
        reward_fns, eval_fns: unused (the environment's reward is the reward); None.
        memory, scoring: unused.
    """

    budget_key = "env_steps"
    """The metrics row's count of environment steps so far."""

    def __init__(
        self,
        config: ControlConfig,
        context: RunContext,
        *,
        policy=None,
        reward_fns=None,
        eval_fns=None,
        memory=None,
        scoring: bool = True,
    ):
        if reward_fns or eval_fns:
            raise ValueError("control trainers take their reward from the environment: no reward functions")
        self.config, self.context = config, context
        self.obs_dim, self.act_dim = self.check_env()
        env = config.env
        self.normalizer = Normalizer(
            self.obs_dim,
            env.num_envs,
            obs=env.normalize_obs,
            reward=env.normalize_reward,
            gamma=self.reward_discount(),
            clip_obs=env.clip_obs,
            clip_reward=env.clip_reward,
        )
        self.policy = policy

    def reward_discount(self) -> float:
        """The discount of the running return that reward normalisation divides by: GAE's `gamma`."""
        return self.config.advantage.gamma

    def critic_config(self) -> ControlCriticConfig:
        """The value network's section."""
        return self.config.critic

    def check_env(self) -> tuple[int, int]:
        """The environment exists and has vector observations and a Box action space (before any network)."""
        env = self.config.env
        probe = make_vec_env(env.id, 1, env.kwargs)
        obs_shape, act_shape = probe.single_observation_space.shape, probe.single_action_space.shape
        limit = probe.envs[0].spec.max_episode_steps if probe.envs[0].spec is not None else None
        probe.close()
        if obs_shape is None or len(obs_shape) != 1:
            raise ValueError(f"{env.id} has observations of shape {obs_shape}; control policies take vectors")
        if limit is not None and limit > env.steps_per_env and self.context.log is not None:
            # every epoch starts fresh episodes: shorter rollouts never see the episode's later states
            self.context.log(
                f"warning: {env.id} episodes last up to {limit} steps but env.steps_per_env is "
                f"{env.steps_per_env}: training never sees an episode past step {env.steps_per_env} "
                "(raise env.steps_per_env, lower env.num_envs to keep the batch)"
            )
        return int(obs_shape[0]), int(np.prod(act_shape))

    def attach(self, actor: torch.nn.Module) -> ActorCritic:
        """The actor-critic of `actor` and a value MLP (`critic`), unless a policy was given."""
        if self.policy is None:
            c = self.critic_config()
            self.policy = ActorCritic(
                actor, self.obs_dim, hidden=c.hidden, depth=c.depth, activation=c.activation, ortho_init=c.ortho_init
            )
        return self.policy

    def ensure_reference(self, offload: bool = False) -> None:
        raise ValueError("control trainers have no reference policy (no KL)")

    # ------------------------------------------------------------------------------------------
    # the parts
    # ------------------------------------------------------------------------------------------

    def collector(self, *, chain: bool = False) -> ControlCollector:
        cfg, env = self.config, self.config.env
        return ControlCollector(
            env.id,
            env.num_envs,
            env.steps_per_env,
            env.kwargs,
            self.normalizer,
            self.policy,
            chain=chain,
            gamma=cfg.advantage.gamma,
            lam=cfg.advantage.lam,
            seed=cfg.run.seed,
            processes=self.context.processes,
            continue_episodes=env.continue_episodes,
            vectorization=env.vectorization,
        )

    def evaluator(self, *, chain: bool = False) -> ControlEvaluator:
        env, ev = self.config.env, self.config.eval
        extra = None
        if env.id == BIMODAL_ID:
            from flowrl.control.bimodal import bimodal_metrics

            extra = lambda act: bimodal_metrics(act, seed=ev.seed)  # noqa: E731
        elif env.id == OBSTACLE_ID:
            from flowrl.control.obstacle import obstacle_metrics

            extra = lambda act: obstacle_metrics(act, seed=ev.seed)  # noqa: E731
        return ControlEvaluator(
            env.id,
            env.kwargs,
            ev.episodes,
            ev.seed,
            self.normalizer,
            self.policy,
            deterministic=ev.deterministic,
            chain=chain,
            extra=extra,
        )

    # ------------------------------------------------------------------------------------------
    # an epoch's record and samples
    # ------------------------------------------------------------------------------------------

    def check(self, collected) -> tuple[torch.Tensor, dict]:
        """`(valid [N], record)`: every transition trains; the episodes that ended this epoch."""
        returns, lengths = collected.info["episode_returns"], collected.info["episode_lengths"]
        elapsed = sum(v for k, v in collected.times.items() if k.startswith("time/"))
        record = {
            "reward/mean": float(np.mean(returns)) if returns else float("nan"),
            "reward/std": float(np.std(returns)) if returns else float("nan"),
            "episodes": len(returns),
            "episode_length": float(np.mean(lengths)) if returns else float("nan"),
            "env_steps_per_s": collected.size / max(elapsed, 1e-9),
        }
        return torch.ones(collected.size, dtype=torch.bool), record

    def log_samples(self, collected, folder, epoch: int, trackers=()) -> None:
        """The bimodal task: the action field and trajectories from the saddle (`images/epoch_N.png`)."""
        if self.config.env.id != BIMODAL_ID:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from flowrl.control.bimodal import plot_bimodal

        evaluator = self.evaluator(chain=collected.data.chain is not None)
        fig, ax = plt.subplots(figsize=(4, 4))
        plot_bimodal(
            evaluator.raw_stochastic_act, ax, seed=self.config.eval.seed, title=f"{self.config.trainer}, epoch {epoch}"
        )
        fig.tight_layout()
        (folder / "images").mkdir(parents=True, exist_ok=True)
        fig.savefig(folder / "images" / f"epoch_{epoch:04d}.png", dpi=100)
        plt.close(fig)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The normalisers' statistics."""
        return {
            k: torch.from_numpy(np.asarray(v, np.float64).reshape(-1).copy())
            for k, v in self.normalizer.state().items()
        }

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        if tensors:
            vectors = ("obs.mean", "obs.var")  # the rest were scalars, saved as one-element tensors
            self.normalizer.load({k: v.numpy() if k in vectors else v.numpy().reshape(()) for k, v in tensors.items()})
