"""AC-Flow: actor-critic fine-tuning of flow matching with intermediate feedback (Fan et al. 2025, arXiv:2510.18072).

AC-Flow extends ORW-CFM-W2 (Fan et al., ICLR 2025, arXiv:2502.06061), whose released loss is

    L(theta) = E_{t ~ U(0,1), x1 ~ q_old(.|c), x_t ~ p_t(.|x1)} [ exp(beta r(x1)) ||v_theta(x_t, t, c) - u_t||^2
                                                               + alpha ||v_theta(x_t, t, c) - v_ref(x_t, t, c)||^2 ],

with a critic on intermediate states. Only the abstract of AC-Flow is public; its three ingredients are
implemented as follows (the formulas are flowrl's reconstruction, see `docs/algorithms/acflow.md`):

1. **reward shaping**: `r~ = clip((r - mean) / (std + delta), -c_r, c_r)` over the batch or the prompt's group
   (the `advantage` section: `batch`, `group` or `raw` with `eps` = delta and `clip` = c_r);
2. a **critic** `V(x_t, t, c)` on states of the conditional path `x_t = (1 - t) x1 + t eps` of the generated
   samples, regressed on `r~`; the per-state advantage `A_t = clip(r~ - V(x_t, t, c), -c_A, c_A)`
   (**advantage clipping**, `critic_clip`); during a **critic warm-up** the actor ignores the critic (it is trained on
   ORW-CFM-W2's reward weights `g(r~)`, or frozen);
3. **generalized critic weighting** `w_t = g(A_t)` (`exp(beta A)`, its batch-normalised form, or a softplus;
   `weight_fn`, beta = `temperature`) of the flow-matching loss, plus the **W2 regulariser**
   `alpha ||v_theta - v_ref||^2` to the reference (`kl.beta` = alpha, `kl.form: w2`; the frozen base: a frozen
   copy, or the network with its LoRA disabled).

Each sample's elements are its `num_draws` stored `(t, eps)` draws (`CriticDraws` on the rollout), and the
per-draw loss `w ||v_theta - u_t||^2 + alpha ||v_theta - v_ref||^2` goes through the shared `[b, K]` update.

`V = 0`, `g = exp(beta .)` on raw rewards and no clipping give ORW-CFM-W2's loss exactly (tested).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from flowrl.config import AdvantageConfig, KLConfig
from flowrl.core.ratios import reduce_elements
from flowrl.policies.value import StateValueNet, pooled_text
from flowrl.trainers.matching import MatchingConfig, MatchingDraws, MatchingTrainer, conditional_path, draw_times
from flowrl.trainers.registry import TRAINERS
from flowrl.trainers.state import seeded
from flowrl.trainers.update import Terms


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
class ACFlowConfig(MatchingConfig):
    unused: ClassVar[tuple[str, ...]] = ("objective", "steps")
    renamed: ClassVar[dict[str, str]] = {
        "adv_clip": "critic_clip",
        "reward_clip": "advantage.clip",
        "shaping": "advantage.estimator (batch, group or raw)",
        "shaping_eps": "advantage.eps",
        "alpha": "kl.beta",
        "weighting": "weight_fn",
        "beta": "temperature",
    }

    trainer: str = "acflow"
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(estimator="batch", eps=1e-4, clip=3.0)
    )
    """The reward shaping `r~`: z-scored over the batch (`batch`), each prompt's group (`group`) or the raw
    weighted reward (`raw`), clipped to `[-c_r, c_r]` with `clip` = c_r = 3."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(beta=1.0, form="w2"))
    """alpha, the weight of the W2 regulariser `||v_theta - v_ref||^2` (ORW-CFM-W2's code: 1.0; 0 turns it off)."""
    critic_clip: float | None = 2.0
    """`c_A`: clip the advantage `r~ - V` to `[-c_A, c_A]` (None: off)."""
    weight_fn: Literal["exp", "exp_norm", "softplus"] = "exp_norm"
    """`g`: `exp` (`exp(beta A)`, ORW-CFM-W2), `exp_norm` (normalised to mean 1 over the epoch's draws),
    `softplus` (`softplus(beta A) / log 2`)."""
    temperature: float = 1.0
    """beta, the temperature of `g` (ORW-CFM-W2's code: 0.5 on raw rewards)."""
    critic_warmup_epochs: int = 5
    """Epochs during which only the critic learns to guide; the actor follows `warmup_actor`."""
    warmup_actor: Literal["reward_weighted", "frozen"] = "reward_weighted"
    """The actor during the warm-up: trained on `g(r~)` (ORW-CFM-W2's reward weighting), or not trained."""
    critic_lr: float = 1e-3
    """AdamW learning rate of the critic."""
    critic_hidden: int = 128
    """Width of the critic (`StateValueNet`)."""
    critic_steps: int = 4
    """Critic steps per epoch, each on every trained sample with a fresh `(t, eps)`."""

    def __post_init__(self):
        super().__post_init__()
        checks = [
            (self.critic_warmup_epochs >= 0, "critic_warmup_epochs must be >= 0"),
            (self.critic_steps >= 0, "critic_steps must be >= 0"),
            (self.critic_clip is None or self.critic_clip > 0, "critic_clip must be > 0 (or null)"),
            (self.advantage.estimator in ("batch", "group", "raw"),
             f"acflow shapes rewards with advantage.estimator batch, group or raw, not {self.advantage.estimator!r}"),
            (self.advantage.estimator != "group" or self.prompts.group_size >= 2,
             "advantage.estimator=group needs prompts.group_size >= 2 (a group of one has no spread)"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@TRAINERS.register(
    "acflow", description="AC-Flow: critic-weighted flow matching with W2 regularisation (arXiv:2510.18072)"
)
class ACFlowTrainer(MatchingTrainer):
    """AC-Flow; see the module docstring and `ACFlowConfig`."""

    config_class = ACFlowConfig
    uses_objective = False  # critic-weighted flow matching, not a ratio objective

    def setup(self):
        super().setup()
        c, s = self.config, self.config.sampling
        default_h, default_w = self.policy.adapter.default_size()
        probe = self.policy.adapter.initial_latents(1, s.height or default_h, s.width or default_w, torch.Generator())
        channels = probe.shape[1] if probe.ndim == 4 else probe.shape[-1]  # [C, h, w] or packed [L, D]
        text_dim = pooled_text(self.policy.encode([str(self.train_prompts[0])])).shape[-1]
        with torch.random.fork_rng(devices=[]):  # initial weights from run.seed, whatever ran before
            torch.manual_seed(c.run.seed)
            self.critic = StateValueNet(channels, text_dim, hidden=c.critic_hidden)

    def auxiliary_modules(self):
        return {"critic": (self.critic, self.config.critic_lr)}

    # ------------------------------------------------------------------------------------------
    # the pieces
    # ------------------------------------------------------------------------------------------

    def _text(self, rollout) -> torch.Tensor:
        return pooled_text(rollout.cond)[rollout.prompt_ids.to(rollout.latents.device)].float()

    def train_critic(self, rollout, shaped: torch.Tensor, epoch: int) -> dict:
        """`critic_steps` AdamW steps of `(V(x_t, t, c) - r~)^2` with a fresh `(t, eps)` per sample and step."""
        net, optimizer = self.aux["critic"]
        x1, text = rollout.latents[:, -1].float(), self._text(rollout)
        target = shaped.to(x1.device).float()
        generator = seeded(self.config.run.seed, epoch, 6, self.processes.rank)
        net.train()
        losses = []
        for _ in range(self.config.critic_steps):
            taus = draw_times(self.config.t_sampling, (len(x1), 1), generator, rollout.sigmas).flatten()
            noises = torch.randn(x1.shape, generator=generator)
            loss = (net(conditional_path(x1, taus, noises), taus.to(x1.device), text) - target).pow(2).mean()
            self.accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        net.eval()
        if not losses:
            return {}
        n = len(x1)  # the last step's loss over every process's samples: each process's mean, weighted by its rows
        return {"critic/loss": self.processes.sum(losses[-1] * n) / max(self.processes.sum(n), 1)}

    @torch.no_grad()
    def critic_advantages(self, rollout, shaped: torch.Tensor, draws: MatchingDraws) -> torch.Tensor:
        """`[B, N]` advantages `clip(r~ - V(x_t, t, c), -c_A, c_A)` at the draws."""
        net, _ = self.aux["critic"]
        b, n = draws.taus.shape
        x1 = rollout.latents[:, -1].float().repeat_interleave(n, dim=0)
        text = self._text(rollout).repeat_interleave(n, dim=0)
        x_t = conditional_path(x1, draws.taus.reshape(-1), draws.noises.reshape(b * n, *draws.noises.shape[2:]))
        values = net(x_t, draws.taus.reshape(-1).to(x1.device), text).reshape(b, n).cpu()
        adv = shaped[:, None] - values
        if self.config.critic_clip is not None:
            adv = adv.clamp(-self.config.critic_clip, self.config.critic_clip)
        return adv

    # ------------------------------------------------------------------------------------------
    # the loop's hooks
    # ------------------------------------------------------------------------------------------

    def update(self, rollout, shaped, trainable, epoch):
        """Critic steps, then (after the warm-up, or with `warmup_actor: reward_weighted`) the actor's weighted
        flow-matching steps on `num_draws` draws per sample."""
        c = self.config
        rows = trainable.nonzero().flatten()
        stats = self.train_critic(rollout.select(rows), shaped[rows], epoch)
        warm = epoch < c.critic_warmup_epochs
        stats["critic/warmup"] = float(warm)
        if warm and c.warmup_actor == "frozen":
            return stats
        draws, weigh_stats = self.weigh_draws(rollout, shaped, rows, epoch)
        rollout = dataclasses.replace(rollout, draws=draws)
        return {**stats, **weigh_stats, **super().update(rollout, shaped, trainable, epoch)}

    def weigh_draws(self, rollout, shaped: torch.Tensor, rows: torch.Tensor, epoch: int) -> tuple[MatchingDraws, dict]:
        """`num_draws` `(t, eps)` per sample, each weighed by `g(A)` (by `g(r~)` during the warm-up)."""
        c = self.config
        draws = self.make_draws(rollout, epoch)
        if epoch < c.critic_warmup_epochs:  # ORW-CFM-W2's reward weighting while the critic matures
            adv = shaped[:, None].expand(-1, c.num_draws).float()
        else:
            adv = self.critic_advantages(rollout, shaped.float(), draws)
        weights = torch.zeros_like(adv)
        weights[rows] = critic_weights(adv[rows], c.weight_fn, c.temperature)
        mine = torch.zeros(len(adv), dtype=torch.bool)
        mine[rows] = True
        a, w = self.processes.gather_rows(adv, mine), self.processes.gather_rows(weights, mine)  # every process's
        clipped = (a.abs() >= c.critic_clip).float().mean() if c.critic_clip is not None else 0.0
        stats = {"adv/critic_mean": a.mean(), "adv/critic_std": a.std(unbiased=False), "adv/critic_clip_frac": clipped,
                 "weight/max": w.max(), "weight/min": w.min()}  # fmt: skip
        return dataclasses.replace(draws, weights=weights), stats

    def draw_terms(self, batch, rows, draw, *, x1, x_t, taus, noises, v):
        """`w ||v_theta(x_t) - (eps - x1)||^2` at the draws (the W2 term is the base's `kl` penalty)."""
        weights = batch.draws.weights[rows, draw].to(x1.device)  # [n]
        cfm = reduce_elements((v.float() - (noises.to(x1.device) - x1)) ** 2, "mean")  # [n], as ORW-CFM-W2
        return Terms(loss=weights * cfm, logs={"cfm_loss": cfm.detach(), "weight_mean": weights})
