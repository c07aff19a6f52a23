"""Behaviour cloning of a flow policy from demonstrations: the pre-training that DPPO and ReinFlow fine-tune from.

The flow policy of `fpo` and `dppo` (`flowrl.control.policies.FlowPolicy`) is trained by conditional flow matching
on an expert's `(observation, action)` pairs (`flowrl.control.demos`: a `.npz` file, e.g. from `flowrl demos RUN`):
each epoch is `batch.inner_epochs` passes over every demonstration in shuffled mini-batches, and each pair gets
`num_draws` fresh `(tau, eps)` draws (flow times uniform on (0, 1), as FPO's),

    L(theta) = mean_i || v_theta((1 - tau_i) a + tau_i eps_i, tau_i | s) - (eps_i - a) ||^2     (FPO eq. 4)

the same per-draw loss (`flowrl.policies.fpo.cfm_losses`) FPO's ratio is built from. The core sees it as a
ratio-free per-element loss on `[b, N]` (the N draws of each pair). Evaluation runs the policy on the environment
as every control run does (`eval/reward`). A fine-tuning run starts from the cloned policy with
`init_from: RUN` (any control config whose policy has the same network: `fpo`, `dppo`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from flowrl.control.config import ControlConfig, ControlCriticConfig, GAEConfig
from flowrl.control.demos import load_demonstrations
from flowrl.control.modality import ControlModality
from flowrl.control.rollout import ControlRollout
from flowrl.core.terms import Terms
from flowrl.policies.fpo import FPODraws, cfm_losses, sample_taus
from flowrl.policies.rollout import Collected
from flowrl.run.registry import register
from flowrl.runtime import seeded
from flowrl.trainers.shared.control import ControlAlgorithm
from flowrl.trainers.shared.policies import FlowPolicyConfig, GaussianPolicyConfig


class DemoModality(ControlModality):
    """The control modality of a behaviour-cloning run: its budget is the demonstrations it trained on."""

    budget_key = "demo_transitions"

    def reward_discount(self) -> float:
        return GAEConfig().gamma  # (cloning steps no environment: the reward normaliser never updates)

    def critic_config(self) -> ControlCriticConfig:
        return ControlCriticConfig()  # the actor-critic's value network is built, and never trained

    def check(self, collected) -> tuple[torch.Tensor, dict]:
        return torch.ones(collected.size, dtype=torch.bool), {}


class DemoCollector:
    """Every demonstration each epoch, this process's share (`rows`: positions `rank, rank + world, ...`)."""

    def __init__(self, demos, processes=None):
        self.demos = demos
        world, rank = (processes.world, processes.rank) if processes is not None else (1, 0)
        self.mine = torch.arange(rank, len(demos), world)

    def close(self) -> None:
        return None

    def collect(self, epoch: int) -> Collected:
        obs, actions = self.demos.obs[self.mine], self.demos.actions[self.mine]
        zeros = torch.zeros(len(obs))
        data = ControlRollout(obs=obs, actions=actions, values=zeros, advantages=zeros, returns=zeros)
        return Collected(data=data, rows=self.mine, size=len(self.demos))

    def updated(self, epoch: int) -> None:
        return None


@dataclasses.dataclass
class BCConfig(ControlConfig):
    absent: ClassVar[dict[str, str]] = {
        "objective": "behaviour cloning fits the demonstrations by flow matching (or maximum likelihood), no ratio",
        "critic": "behaviour cloning trains no value network",
        "advantage": "behaviour cloning has no rewards, so no advantages",
        "vf_coef": "behaviour cloning trains no value network",
        "clip_vf": "behaviour cloning trains no value network",
    }

    demonstrations: str = ""
    """The `.npz` file of `(obs, actions)` pairs (`flowrl demos RUN --out FILE`; raw observations)."""
    actor: Literal["flow", "gaussian"] = "flow"
    """The cloned policy: `flow` (the `policy` section: `fpo`'s and `dppo`'s network, by flow matching) or
    `gaussian` (the `gaussian` section: `ppo`'s network, by maximum likelihood; a unimodal baseline)."""
    policy: FlowPolicyConfig = dataclasses.field(default_factory=FlowPolicyConfig)
    """The flow policy (the one a fine-tuning `fpo` / `dppo` run loads with `init_from`)."""
    gaussian: GaussianPolicyConfig = dataclasses.field(default_factory=GaussianPolicyConfig)
    """The Gaussian policy (`actor: gaussian`; the one a `ppo` run loads with `init_from`)."""
    num_draws: int = 8
    """`(tau, eps)` draws per demonstration and epoch."""

    def checks(self):
        return [
            *super().checks(),
            (bool(self.demonstrations), "demonstrations: the .npz file to clone (flowrl demos RUN --out FILE)"),
            (self.num_draws >= 1, "num_draws must be >= 1"),
            (not self.env.normalize_obs, "env.normalize_obs: demonstrations hold raw observations; clone on them"),
            (self.run.mode != "async", "behaviour cloning steps no environment: run.mode async does not apply"),
            (
                self.total_env_steps is None,
                "behaviour cloning steps no environment while it trains: set run.epochs "
                "(passes over the demonstrations), not total_env_steps",
            ),
        ]


@register("bc", description="Behaviour cloning of a flow policy from demonstrations (conditional flow matching)")
class BC(ControlAlgorithm):
    """Behaviour cloning; see the module docstring and `BCConfig`."""

    config_class = BCConfig
    modality_class: ClassVar[type] = DemoModality

    def __init__(self, config, modality, engine):
        super().__init__(config, modality, engine)
        self.demos = load_demonstrations(config.demonstrations, modality.obs_dim, modality.act_dim)

    def build_actor(self, obs_dim, act_dim):
        if self.config.actor == "gaussian":
            return self.config.gaussian.build(obs_dim, act_dim)
        return self.config.policy.build(obs_dim, act_dim)

    def collector(self):
        return DemoCollector(self.demos, self.processes)

    @torch.no_grad()
    def behaviour(self, rollout, rows, size):
        """The epoch's draws (per demonstration, the same on any process) and zero "log-probs" `[B, N]`."""
        if self.config.actor == "gaussian":
            return torch.zeros(len(rows), 1), None  # one element per pair: its log-likelihood
        n = self.config.num_draws
        generator = seeded(self.config.run.seed, self.epoch, 17, 0)
        taus = sample_taus((size, n), generator=generator)[rows]
        noises = torch.randn((size, n, rollout.actions.shape[1]), generator=generator)[rows]
        return torch.zeros(len(rows), n), FPODraws(taus, noises)

    def policy_terms(self, batch, index):
        """The cloning loss of the pairs `batch` at the elements `index`: per-draw flow matching `[b, N]`, or the
        Gaussian's negative log-likelihood per action dimension `[b, 1]`."""
        if self.config.actor == "gaussian":
            losses = -self.policy.actor.log_prob(batch.obs, batch.actions)[:, None] / batch.actions.shape[1]
        else:
            fn = self.policy.actor.velocity.velocity_fn(batch.obs, batch.draws.taus.shape[1])
            losses = cfm_losses(fn, batch.actions, batch.draws.taus, batch.draws.noises)  # [b, N]
        picked = losses.gather(1, index)
        return Terms(loss=picked, logs={"bc_loss": picked.detach()})
