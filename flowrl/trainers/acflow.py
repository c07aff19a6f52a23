"""AC-Flow: actor-critic fine-tuning of flow matching with intermediate feedback (Fan et al. 2025, arXiv:2510.18072).

AC-Flow extends ORW-CFM-W2 (Fan et al., ICLR 2025, arXiv:2502.06061), whose released loss is

    L(theta) = E_{t ~ U(0,1), x1 ~ q_old(.|c), x_t ~ p_t(.|x1)} [ exp(beta r(x1)) ||v_theta(x_t, t, c) - u_t||^2
                                                               + alpha ||v_theta(x_t, t, c) - v_ref(x_t, t, c)||^2 ],

with a critic on intermediate states. Only the abstract of AC-Flow is public; its three ingredients are
implemented as follows (the formulas are flowrl's reconstruction, see `docs/algorithms/acflow.md`):

1. **reward shaping**: `r~ = clip((r - mean) / (std + delta), -c_r, c_r)` over the batch or the prompt's group;
2. a **critic** `V(x_t, t, c)` on states of the conditional path `x_t = (1 - t) x1 + t eps` of the generated
   samples, regressed on `r~`; the per-state advantage `A_t = clip(r~ - V(x_t, t, c), -c_A, c_A)`
   (**advantage clipping**); during a **critic warm-up** the actor ignores the critic (it is trained on
   ORW-CFM-W2's reward weights `g(r~)`, or frozen);
3. **generalized critic weighting** `w_t = g(A_t)` (`exp(beta A)`, its batch-normalised form, or a softplus) of
   the flow-matching loss, plus the **W2 regulariser** `alpha ||v_theta - v_ref||^2` to the reference (the
   frozen base: a frozen copy, or the network with its LoRA disabled).

`V = 0`, `g = exp(beta .)` on raw rewards and no clipping give ORW-CFM-W2's loss exactly (tested).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.core import velocity_mse
from flowrl.core.ratios import reduce_elements
from flowrl.policies.value import StateValueNet, pooled_text
from flowrl.trainers.base import Trainer, TrainerConfig, seeded
from flowrl.trainers.registry import TRAINERS
from rewards import combine_advantages


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
class ACFlowConfig(TrainerConfig):
    trainer: str = "acflow"
    num_draws: int = 2
    """`(t, eps)` draws per sample and epoch on which the actor trains (the loop's "steps")."""
    t_sampling: Literal["uniform", "logit_normal"] = "uniform"
    """Noise levels of the draws: `uniform` on (0, 1) (ORW-CFM-W2), or `logit_normal` (SD3's training density)."""
    shaping: Literal["batch", "group", "none"] = "batch"
    """Reward shaping: z-score over the epoch's batch, over each prompt's group, or the raw weighted reward."""
    shaping_eps: float = 1e-4
    """Added to the std of the shaping z-score."""
    reward_clip: float | None = 3.0
    """`c_r`: clip the shaped reward to `[-c_r, c_r]` (None: off)."""
    adv_clip: float | None = 2.0
    """`c_A`: clip the advantage `r~ - V` to `[-c_A, c_A]` (None: off)."""
    weighting: Literal["exp", "exp_norm", "softplus"] = "exp_norm"
    """`g`: `exp` (`exp(beta A)`, ORW-CFM-W2), `exp_norm` (normalised to mean 1 over the epoch's draws),
    `softplus` (`softplus(beta A) / log 2`)."""
    beta: float = 1.0
    """Temperature of `g` (ORW-CFM-W2's code: 0.5 on raw rewards)."""
    alpha: float = 1.0
    """Weight of the W2 regulariser `||v_theta - v_ref||^2` (ORW-CFM-W2's code: 1.0; 0 turns it off)."""
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
            (self.num_draws >= 1, "num_draws must be >= 1"),
            (self.critic_warmup_epochs >= 0, "critic_warmup_epochs must be >= 0"),
            (self.critic_steps >= 0, "critic_steps must be >= 0"),
            (self.alpha >= 0, "alpha must be >= 0"),
            (self.reward_clip is None or self.reward_clip > 0, "reward_clip must be > 0 (or null)"),
            (self.adv_clip is None or self.adv_clip > 0, "adv_clip must be > 0 (or null)"),
            (self.shaping != "group" or self.prompts.group_size >= 2,
             "shaping: group needs prompts.group_size >= 2 (a group of one has no spread)"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@TRAINERS.register(
    "acflow", description="AC-Flow: critic-weighted flow matching with W2 regularisation (arXiv:2510.18072)"
)
class ACFlowTrainer(Trainer):
    """AC-Flow; see the module docstring and `ACFlowConfig`."""

    config_class = ACFlowConfig
    needs_sde = False  # the actor trains on final samples; ODE rollouts are fine

    def setup(self):
        c, s = self.config, self.config.sampling
        if self.policy.adapter.time_kind != "flow":
            family = self.policy.family
            raise ValueError(f"acflow needs a flow-matching (velocity) model; a {family} model predicts noise")
        if c.alpha and not (self.policy.has_lora or self.policy.reference_model is not None):
            self.policy.freeze_reference()  # full fine-tuning: the W2 reference is a frozen copy of the base
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

    def compute_advantages(self, rewards, group_ids, prompts=None):
        """The shaped reward `r~` (the critic's target and, in the warm-up, the actor's weight input)."""
        c = self.config
        if c.shaping == "none":
            shaped = self.combined_reward(rewards).float()
            if c.reward_clip is not None:
                shaped = shaped.clamp(-c.reward_clip, c.reward_clip)
            return shaped, {"shaped_mean": float(shaped.mean()), "shaped_std": float(shaped.std(unbiased=False))}
        groups = group_ids if c.shaping == "group" else torch.zeros_like(group_ids)
        return combine_advantages(rewards, self.reward_weights, groups, mode=self.config.reward_aggregation,
                                  std="group", eps=c.shaping_eps, clip=c.reward_clip)  # fmt: skip

    def draw_times(self, shape, generator: torch.Generator) -> torch.Tensor:
        """Noise levels `t` in (0, 1): uniform, or logit-normal (`sigmoid` of a standard normal)."""
        if self.config.t_sampling == "uniform":
            return torch.rand(shape, generator=generator)
        return torch.sigmoid(torch.randn(shape, generator=generator))

    def velocity(self, batch, x: torch.Tensor, t: torch.Tensor, *, reference: bool = False) -> torch.Tensor:
        """The conditional velocity `v(x_t, t, c)` of the trained network (through its prepared module) or of the
        reference: `DiffusionPolicy.velocity_fn` with one draw per sample (no CFG; Flux keeps its guidance)."""
        velocity = self.policy.velocity_fn(batch, 1, reference=reference)
        return velocity(x.to(device=self.policy.device, dtype=self.policy.dtype), t.float())

    def _text(self, rollout) -> torch.Tensor:
        return pooled_text(rollout.cond)[rollout.prompt_ids.to(rollout.latents.device)].float()

    @staticmethod
    def conditional_path(x1, taus, noises):
        """States `x_t = (1 - t) x1 + t eps` `[B, ...]` of the conditional path of samples `x1` at `taus [B]`
        (flowrl's convention, as SD3 and `flowrl.policies.fpo`: t = 1 is noise; target velocity `eps - x1`)."""
        t = taus.reshape(-1, *([1] * (x1.ndim - 1))).to(x1.device)
        return (1 - t) * x1 + t * noises.to(x1.device)

    def train_critic(self, rollout, shaped: torch.Tensor, epoch: int) -> dict:
        """`critic_steps` AdamW steps of `(V(x_t, t, c) - r~)^2` with a fresh `(t, eps)` per sample and step."""
        net, optimizer = self.aux["critic"]
        x1, text = rollout.latents[:, -1].float(), self._text(rollout)
        target = shaped.to(x1.device).float()
        generator = seeded(self.config.run.seed, epoch, 6, self.accelerator.process_index)
        net.train()
        losses = []
        for _ in range(self.config.critic_steps):
            taus = self.draw_times((len(x1),), generator)
            noises = torch.randn(x1.shape, generator=generator)
            loss = (net(self.conditional_path(x1, taus, noises), taus.to(x1.device), text) - target).pow(2).mean()
            self.accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        net.eval()
        return {"critic/loss": losses[-1]} if losses else {}

    @torch.no_grad()
    def critic_advantages(self, rollout, shaped: torch.Tensor) -> torch.Tensor:
        """`[B, N]` advantages `clip(r~ - V(x_t, t, c), -c_A, c_A)` at the stored draws."""
        net, _ = self.aux["critic"]
        taus, noises = rollout.extras["taus"], rollout.extras["noises"]
        b, n = taus.shape
        x1 = rollout.latents[:, -1].float().repeat_interleave(n, dim=0)
        text = self._text(rollout).repeat_interleave(n, dim=0)
        x_t = self.conditional_path(x1, taus.reshape(-1), noises.reshape(b * n, *noises.shape[2:]))
        values = net(x_t, taus.reshape(-1).to(x1.device), text).reshape(b, n).cpu()
        adv = shaped[:, None] - values
        if self.config.adv_clip is not None:
            adv = adv.clamp(-self.config.adv_clip, self.config.adv_clip)
        return adv

    # ------------------------------------------------------------------------------------------
    # the loop's hooks
    # ------------------------------------------------------------------------------------------

    def update(self, rollout, shaped, trainable, epoch):
        """Critic steps, then (after the warm-up, or with `warmup_actor: reward_weighted`) the actor's weighted
        flow-matching steps on `num_draws` stored `(t, eps)` per sample."""
        c = self.config
        rows = trainable.nonzero().flatten()
        stats = self.train_critic(rollout.select(rows), shaped[rows], epoch)
        warm = epoch < c.critic_warmup_epochs
        stats["critic/warmup"] = float(warm)
        if warm and c.warmup_actor == "frozen":
            return stats
        stats.update(self.weigh_draws(rollout, shaped, rows, epoch))
        return {**stats, **super().update(rollout, shaped, trainable, epoch)}

    def weigh_draws(self, rollout, shaped: torch.Tensor, rows: torch.Tensor, epoch: int) -> dict:
        """Draw `num_draws` `(t, eps)` per sample and weigh each by `g(A)` (by `g(r~)` during the warm-up);
        `taus [B, N]`, `noises [B, N, ...]` and `weights [B, N]` (0 on untrained rows) go to `rollout.extras`."""
        c = self.config
        x1 = rollout.latents[:, -1]
        generator = seeded(c.run.seed, epoch, 5, self.accelerator.process_index)
        taus = self.draw_times((len(rollout), c.num_draws), generator)
        noises = torch.randn((len(rollout), c.num_draws, *x1.shape[1:]), generator=generator)
        rollout.extras.update(taus=taus, noises=noises)
        if epoch < c.critic_warmup_epochs:  # ORW-CFM-W2's reward weighting while the critic matures
            adv = shaped[:, None].expand(-1, c.num_draws).float()
        else:
            adv = self.critic_advantages(rollout, shaped.float())
        weights = torch.zeros_like(adv)
        weights[rows] = critic_weights(adv[rows], c.weighting, c.beta)
        rollout.extras["weights"] = weights
        a, w = adv[rows], weights[rows]
        clipped = (a.abs() >= c.adv_clip).float().mean() if c.adv_clip is not None else 0.0
        return {"adv/critic_mean": a.mean(), "adv/critic_std": a.std(unbiased=False), "adv/critic_clip_frac": clipped,
                "weight/max": w.max(), "weight/min": w.min()}  # fmt: skip

    def train_steps(self, rollout, epoch):
        """The stored draws play the loop's steps: each sample trains on draws `0 .. num_draws - 1`."""
        return torch.arange(self.config.num_draws).expand(len(rollout), -1)

    def step_loss(self, batch, advantages, steps):
        c = self.config
        rows = torch.arange(len(batch))
        taus = batch.extras["taus"][rows, steps]  # [b]
        noises = batch.extras["noises"][rows, steps]  # [b, ...]
        weights = batch.extras["weights"][rows, steps]  # [b]
        x1 = batch.latents[:, -1].float()
        x_t = self.conditional_path(x1, taus, noises)
        target = noises.to(x1.device) - x1  # u_t = eps - x1
        v = self.velocity(batch, x_t, taus)
        cfm = reduce_elements((v.float() - target) ** 2, "mean")  # [b], mean over latent elements (as ORW-CFM-W2)
        # w_t ||v_theta - u_t||^2 + alpha ||v_theta - v_ref||^2, averaged over the samples
        per_sample = weights.to(cfm.device) * cfm
        metrics = {"cfm_loss": cfm.mean().detach(), "weight_mean": weights.mean()}
        if c.alpha:
            w2 = velocity_mse(v, self.velocity(batch, x_t, taus, reference=True))  # [b]
            per_sample = per_sample + c.alpha * w2
            metrics["w2_loss"] = w2.mean().detach()
        return per_sample.mean(), metrics
