"""AC-Flow: actor-critic fine-tuning of flow matching with intermediate feedback (Fan et al. 2025, arXiv:2510.18072).

AC-Flow extends ORW-CFM-W2 (Fan et al., ICLR 2025, arXiv:2502.06061), whose released loss is

    L(theta) = E_{t ~ U(0,1), x1 ~ q_old(.|c), x_t ~ p_t(.|x1)} [ exp(beta r(x1)) ||v_theta(x_t, t, c) - u_t||^2
                                                               + alpha ||v_theta(x_t, t, c) - v_ref(x_t, t, c)||^2 ],

with a critic on intermediate states. The AC-Flow paper is public (arXiv HTML v1 and PDF), but its method section
could not be read from the copies this project can reach (the stored arXiv page gives the abstract and the start of
the introduction only), so its equations have NOT been checked against this code: every formula below is flowrl's
reconstruction from the abstract, the project page and ORW-CFM-W2's released code (`docs/algorithms/acflow.md`
tabulates each against the paper: all "unverified"). Its three ingredients are implemented as follows:

1. **reward shaping**: `r~ = clip((r - mean) / (std + delta), -c_r, c_r)` over the batch or the prompt's group
   (the `advantage` section: `batch`, `group` or `raw` with `eps` = delta and `clip` = c_r);
2. a **critic** `V(x_t, t, c)` on states of the conditional path `x_t = (1 - t) x1 + t eps` of the generated
   samples, regressed on `r~` (the terminal reward is the only return; the abstract's remedy for unstable "direct
   regression on cumulative rewards" is to normalise it); the per-state advantage
   `A_t = clip(r~ - V(x_t, t, c), -c_A, c_A)` (**advantage clipping**, `critic.clip`); during a **critic warm-up**
   the actor ignores the critic (it is trained on ORW-CFM-W2's reward weights `g(r~)`, or frozen);
3. **generalized critic weighting** `w_t = g(A_t)` (`exp(beta A)`, its form normalised over the epoch's draws, or
   a softplus; `weight_fn`, beta = `temperature`) of the flow-matching loss, plus the **W2 regulariser**
   `alpha ||v_theta - v_ref||^2` to the reference (`kl.beta` = alpha, `kl.form: w2`; the frozen base: a frozen
   copy, or the network with its LoRA disabled).

Each sample's elements are its `num_draws` stored `(t, eps)` draws (`CriticDraws` on the rollout), and the
per-draw loss `w ||v_theta - u_t||^2 + alpha ||v_theta - v_ref||^2` goes through the shared `[b, K]` update.

`V = 0`, `g = exp(beta .)` on raw rewards and no clipping give ORW-CFM-W2's loss exactly (tested): the project
page's "ORW-CFM-W2 as a special case".
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from flowrl.core.ratios import reduce_elements
from flowrl.core.terms import Terms
from flowrl.policies.value import StateValueNet, pooled_text
from flowrl.run.registry import register
from flowrl.sections import AdvantageConfig, HasKL, KLConfig
from flowrl.trainers.shared.matching import (
    MatchingConfig,
    MatchingDraws,
    PerDrawAlgorithm,
    conditional_path,
    row_draws,
)


WEIGHTINGS = ("exp", "exp_norm", "softplus")


def critic_weights(adv: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """Generalized critic weights `w = g(A)` of the flow-matching loss (positive and finite for finite `A`).

    - `exp`: `exp(beta A)`, ORW-CFM-W2's reward weight (un-normalised, as released);
    - `exp_norm`: `exp(beta A) / mean(exp(beta A))` over all of `adv`: mean 1, computed as `n softmax(beta A)`;
    - `softplus`: `softplus(beta A) / log 2`: 1 at `A = 0`, linear rather than exponential for large `A`.
    """
    a = adv.float()
    if kind == "exp":
        return torch.exp(beta * a)
    if kind == "exp_norm":
        return a.numel() * torch.softmax(beta * a.flatten(), dim=0).reshape(a.shape)
    if kind == "softplus":
        return torch.nn.functional.softplus(beta * a) / torch.log(torch.tensor(2.0))
    raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {kind!r}")


@dataclasses.dataclass
class ACFlowCriticConfig:
    """AC-Flow's critic `V(x_t, t, c)` on states of the conditional path, regressed on the shaped reward."""

    lr: float = 1e-3
    """AdamW learning rate."""
    hidden: int = 128
    """Width (`StateValueNet`)."""
    steps: int = 4
    """Steps per epoch, each on every trained sample with a fresh `(t, eps)`."""
    clip: float | None = 2.0
    """`c_A`: clip the critic's advantage `r~ - V` to `[-c_A, c_A]` (None: off)."""
    warmup_epochs: int = 5
    """Epochs during which only the critic learns to guide; the actor follows `warmup_actor`."""


@dataclasses.dataclass
class ACFlowConfig(HasKL, MatchingConfig):
    kl_forms: ClassVar[tuple[str, ...]] = ("w2",)
    renamed: ClassVar[dict[str, str]] = {
        "adv_clip": "critic.clip",
        "critic_clip": "critic.clip",
        "critic_lr": "critic.lr",
        "critic_hidden": "critic.hidden",
        "critic_steps": "critic.steps",
        "critic_warmup_epochs": "critic.warmup_epochs",
        "reward_clip": "advantage.clip",
        "shaping": "advantage.estimator (batch, group or raw)",
        "shaping_eps": "advantage.eps",
        "alpha": "kl.beta",
        "weighting": "weight_fn",
        "beta": "temperature",
    }

    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(estimator="batch", eps=1e-4, clip=3.0)
    )
    """The reward shaping `r~`: z-scored over the batch (`batch`), each prompt's group (`group`) or the raw
    weighted reward (`raw`), clipped to `[-c_r, c_r]` with `clip` = c_r = 3."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(beta=1.0, form="w2"))
    """alpha, the weight of the W2 regulariser `||v_theta - v_ref||^2` (ORW-CFM-W2's code: 1.0; 0 turns it off)."""
    critic: ACFlowCriticConfig = dataclasses.field(default_factory=ACFlowCriticConfig)
    """The critic."""
    weight_fn: Literal["exp", "exp_norm", "softplus"] = "exp_norm"
    """`g`: `exp` (`exp(beta A)`, ORW-CFM-W2), `exp_norm` (normalised to mean 1 over the epoch's draws of every
    process), `softplus` (`softplus(beta A) / log 2`)."""
    temperature: float = 1.0
    """beta, the temperature of `g` (ORW-CFM-W2's code: 0.5 on raw rewards)."""
    warmup_actor: Literal["reward_weighted", "frozen"] = "reward_weighted"
    """The actor during the critic's warm-up: trained on `g(r~)` (ORW-CFM-W2's reward weighting), or not trained."""

    def checks(self):
        c = self.critic
        return [
            *super().checks(),
            (c.warmup_epochs >= 0, "critic.warmup_epochs must be >= 0"),
            (c.steps >= 0, "critic.steps must be >= 0"),
            (c.clip is None or c.clip > 0, "critic.clip must be > 0 (or null)"),
            (
                self.advantage.estimator in ("batch", "group", "raw"),
                "acflow shapes rewards with advantage.estimator batch, group or raw, not "
                f"{self.advantage.estimator!r}",
            ),
        ]


@register("acflow", description="AC-Flow: critic-weighted flow matching with W2 regularisation (arXiv:2510.18072)")
class ACFlow(PerDrawAlgorithm):
    """AC-Flow; see the module docstring and `ACFlowConfig`."""

    config_class = ACFlowConfig
    video = False  # the critic is a 2-D conv net over image latents

    def build(self):
        super().build()
        c, s = self.config, self.config.sampling
        default_h, default_w = self.policy.adapter.default_size()
        probe = self.policy.adapter.initial_latents(1, s.height or default_h, s.width or default_w, torch.Generator())
        channels = probe.shape[1] if probe.ndim == 4 else probe.shape[-1]  # [C, h, w] or packed [L, D]
        text_dim = pooled_text(self.policy.encode([str(self.modality.train_prompts[0])])).shape[-1]
        with torch.random.fork_rng(devices=[]):  # initial weights from run.seed, whatever ran before
            torch.manual_seed(c.run.seed)
            self.critic = StateValueNet(channels, text_dim, hidden=c.critic.hidden)

    def auxiliary_modules(self):
        return {"critic": (self.critic, self.config.critic.lr)}

    # ------------------------------------------------------------------------------------------
    # the pieces
    # ------------------------------------------------------------------------------------------

    def _text(self, rollout) -> torch.Tensor:
        return pooled_text(rollout.cond)[rollout.prompt_ids.to(rollout.latents.device)].float()

    def train_critic(self, rollout, rows: torch.Tensor, shaped: torch.Tensor, total: int, epoch: int) -> dict:
        """`critic.steps` AdamW steps of `(V(x_t, t, c) - r~)^2` over the trained samples of every process, each with
        a fresh `(t, eps)` per sample (drawn from its position `rows`): each process's share of the mean over
        `total` samples, so the step is the one-process step."""
        c = self.config
        net = self.engine.aux_module("critic")
        x1, text = rollout.latents[:, -1].float(), self._text(rollout)
        target = shaped.to(x1.device).float()
        net.train()
        losses = []
        for step in range(c.critic.steps):
            draws = row_draws(c.t_sampling, rows, 1, x1.shape[1:], (c.run.seed, epoch, 6, step), rollout.sigmas)
            taus = draws.taus[:, 0]
            x_t = conditional_path(x1, taus, draws.noises[:, 0])
            error = (net(x_t, taus.to(x1.device), text) - target).pow(2).sum()
            self.engine.aux_step("critic", error / max(total, 1))
            losses.append(self.processes.sum(float(error.detach())) / max(total, 1))
        net.eval()
        return {"critic/loss": losses[-1]} if losses else {}

    @torch.no_grad()
    def critic_advantages(self, rollout, shaped: torch.Tensor, draws: MatchingDraws) -> torch.Tensor:
        """`[B, N]` advantages `clip(r~ - V(x_t, t, c), -c_A, c_A)` at the draws."""
        net = self.engine.aux_module("critic")
        b, n = draws.taus.shape
        x1 = rollout.latents[:, -1].float().repeat_interleave(n, dim=0)
        text = self._text(rollout).repeat_interleave(n, dim=0)
        x_t = conditional_path(x1, draws.taus.reshape(-1), draws.noises.reshape(b * n, *draws.noises.shape[2:]))
        values = net(x_t, draws.taus.reshape(-1).to(x1.device), text).reshape(b, n).cpu()
        adv = shaped[:, None] - values
        clip = self.config.critic.clip
        if clip is not None:
            adv = adv.clamp(-clip, clip)
        return adv

    # ------------------------------------------------------------------------------------------
    # the loop's hooks
    # ------------------------------------------------------------------------------------------

    def prepare(self, collected, shaped, trainable, epoch):
        """Critic steps, then (after the warm-up, or with `warmup_actor: reward_weighted`) the actor's weighted
        flow-matching rows with `num_draws` draws per sample."""
        c = self.config
        rollout = collected.data
        mine = trainable[collected.rows]
        rows = mine.nonzero().flatten()
        local_shaped = shaped[collected.rows]
        stats = self.train_critic(
            rollout.select(rows), collected.rows[rows], local_shaped[rows], int(trainable.sum()), epoch
        )
        warm = epoch < c.critic.warmup_epochs
        stats["critic/warmup"] = float(warm)
        if warm and c.warmup_actor == "frozen":
            nothing = torch.zeros_like(trainable)
            return self.update_batch(collected, shaped, nothing), stats
        draws, weigh_stats = self.weigh_draws(collected, local_shaped, mine, epoch)
        rollout = dataclasses.replace(rollout, draws=draws)
        return self.update_batch(collected, shaped, trainable, data=rollout), {**stats, **weigh_stats}

    def weigh_draws(self, collected, shaped: torch.Tensor, mine: torch.Tensor, epoch: int):
        """`num_draws` `(t, eps)` per sample, each weighed by `g(A)` (by `g(r~)` during the warm-up); `exp_norm`
        normalises over the draws of every process's trained samples."""
        c = self.config
        rollout = collected.data
        draws = self.make_draws(rollout, collected.rows, epoch)
        if epoch < c.critic.warmup_epochs:  # ORW-CFM-W2's reward weighting while the critic matures
            adv = shaped[:, None].expand(-1, c.num_draws).float()
        else:
            adv = self.critic_advantages(rollout, shaped.float(), draws)
        every = self.processes.gather_rows(adv, mine)  # [n, N]: every process's trained samples, in rank order
        weights_every = critic_weights(every, c.weight_fn, c.temperature)
        offset = int(self.processes.gather(mine.long().sum()[None])[: self.processes.rank].sum())
        weights = torch.zeros_like(adv)
        weights[mine] = weights_every[offset : offset + int(mine.sum())]
        clip = c.critic.clip
        clipped = (every.abs() >= clip).float().mean() if clip is not None else 0.0
        stats = {
            "adv/critic_mean": every.mean(),
            "adv/critic_std": every.std(unbiased=False),
            "adv/critic_clip_frac": clipped,
            "weight/max": weights_every.max(),
            "weight/min": weights_every.min(),
        }
        return dataclasses.replace(draws, weights=weights), stats

    def draw_terms(self, batch, rows, draw, *, x1, x_t, taus, noises, v):
        """`w ||v_theta(x_t) - (eps - x1)||^2` at the draws (the W2 term is the base's `kl` penalty)."""
        weights = batch.draws.weights[rows, draw].to(x1.device)  # [n]
        cfm = reduce_elements((v.float() - (noises.to(x1.device) - x1)) ** 2, "mean")  # [n], as ORW-CFM-W2
        return Terms(loss=weights * cfm, logs={"cfm_loss": cfm.detach(), "weight_mean": weights})
