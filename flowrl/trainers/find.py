"""FIND: fine-tuning the initial noise distribution (Chen et al., ACM MM 2024, arXiv:2407.19453).

The diffusion model stays frozen; the policy is a Gaussian over the initial latent,
`pi_theta(z_T | c) = N(mu_theta(c), diag sigma_theta(c)^2)`, and the frozen sampler that turns `z_T` into an
image is the environment of a one-step MDP, so the log-probability of the action is exact. Per epoch:

1. `z_T ~ pi_theta(. | c)` for the epoch's prompts, the frozen sampler (ODE by default) from `z_T`, rewards;
2. the **dynamic reward calibration** network `V_psi(mu, sigma, e_c)` (an MLP on the flattened noise
   parameters and the prompt embedding) regresses the observed rewards by MSE;
3. the noise policy steps on `-lambda_r (r - V_psi) clamp(rho, 1 - eps, 1 + eps) + lambda_KL R(theta)`, with
   `rho = pi_theta(z_T) / pi_old(z_T)` (element-mean log-densities, as every image RL codebase), `pi_old` the
   initial `N(0, I)` (FIND's released code) or the policy that sampled this epoch, and `R` FIND's released
   proxy `mean(mu^2 + (sigma - 1)^2)` or the exact `KL(pi_theta || N(0, I))`; sigma is clamped to
   `>= min_std` after every optimizer step.

In flowrl's terms: the `advantage` estimator is `raw` (the calibration network is the baseline), the
`objective` the core's `clamp`, `kl` the proximity term (`proxy` or the exact `gaussian` KL to the prior),
and each sample has one element, its initial noise (kept as typed `NoiseDraws` on the rollout).
`docs/algorithms/find.md` records what is confirmed by the released code and what flowrl chose.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch
from torch import nn

from flowrl.config import AdvantageConfig, KLConfig, ObjectiveConfig, TrainerConfig
from flowrl.core import gaussian_log_prob
from flowrl.policies.noise import InitialNoisePolicy, NoiseDraws
from flowrl.policies.value import pooled_text
from flowrl.trainers.image import ImageTrainer
from flowrl.trainers.registry import TRAINERS
from flowrl.trainers.update import Terms


@dataclasses.dataclass
class FINDConfig(TrainerConfig):
    kl_forms: ClassVar[tuple[str, ...]] = ("proxy", "gaussian")
    unused: ClassVar[tuple[str, ...]] = ("steps",)

    trainer: str = "find"
    objective: ObjectiveConfig = dataclasses.field(
        default_factory=lambda: ObjectiveConfig(name="clamp", clip_eps_low=0.2)
    )
    """The ratio clamp `[1 - eps, 1 + eps]` with FIND's eps 0.2 (on element-mean log-densities)."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=lambda: AdvantageConfig(estimator="raw"))
    """The reward itself: FIND's baseline is the calibration network `V(mu, sigma, c)`."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(beta=0.01, form="proxy"))
    """`lambda_KL` 0.01 on FIND's released `mean(mu^2 + (sigma - 1)^2)` (`proxy`); `gaussian`: the exact
    `KL(pi_theta || N(0, I))`, element mean."""
    drop_zero_std_groups: bool = False
    """Off: the calibration network, not the group, is FIND's baseline, so equal rewards still carry signal."""
    noise_policy: Literal["per_prompt", "conditioned"] = "per_prompt"
    """`per_prompt`: a free `(mu, sigma)` table per prompt of the train and test sets (FIND's code; a test
    prompt's row never trains, so held-out prompts are evaluated at the prior); `conditioned`: an MLP on the
    prompt's pooled text embedding, which can move the noise of unseen phrasings."""
    noise_hidden: int = 256
    """Width of the `conditioned` noise policy's MLP."""
    min_std: float = 1e-4
    """Floor of sigma (FIND clamps the table after every optimizer step)."""
    old_policy: Literal["prior", "previous"] = "prior"
    """The ratio's denominator: `prior`, the initial `N(0, I)` as in FIND's released code (a trust region
    around the pretrained prior); `previous`, the policy that sampled the epoch (PPO-style: ratio 1 at the
    start of every epoch, exactly for tables, to the last bits for the MLP)."""
    reward_weight: float = 10.0
    """`lambda_r`, the scale of the calibrated advantage `r - V` (FIND: 10)."""
    calibration_hidden: int = 256
    """Width of the calibration MLP (FIND: three hidden layers of 256)."""
    calibration_lr: float = 1e-4
    """AdamW learning rate of the calibration network (FIND: 1e-4)."""
    calibration_steps: int = 5
    """Full-batch calibration steps per epoch, before the policy update (FIND: v_step 5)."""
    eval_noise: Literal["sample", "mean"] = "sample"
    """Evaluation latents: `sample`, `mu + sigma * eps` with the evaluation noise `eps` (at the prior this is
    exactly the base model's evaluation); `mean`, `mu` alone (one image per prompt under an ODE sampler)."""

    def __post_init__(self):
        super().__post_init__()
        checks = [
            (self.model.lora_rank == 0, "find keeps the diffusion model frozen: model.lora_rank must be 0"),
            (self.min_std > 0, "min_std must be > 0"),
            (self.calibration_steps >= 0, "calibration_steps must be >= 0"),
            (self.noise_hidden >= 1 and self.calibration_hidden >= 1, "hidden sizes must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class FINDNoisePolicy(InitialNoisePolicy):
    """`InitialNoisePolicy` with a `forward` (so a DDP-prepared module trains it): log-prob and regulariser."""

    def __init__(self, latent_shape, *, kl_form: str = "proxy", **kwargs):
        super().__init__(latent_shape, **kwargs)
        self.kl_form = kl_form

    def forward(self, z: torch.Tensor, condition: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(log pi(z | c) [B], R [B])` with `R` the proxy `mean(mu^2 + (sigma - 1)^2)` or the exact KL."""
        regulariser = self.proximity(condition) if self.kl_form == "proxy" else self.kl_to_prior(condition)
        return self.log_prob(z, condition), regulariser


class CalibrationNet(nn.Module):
    """FIND's dynamic reward calibration `V(mu, sigma, e_c) -> [B]`: an MLP on `[flat(mu), flat(sigma), e_c]`.

    FIND's `ValueInit` (`reward_model.py`): three ReLU layers of 256 on the flattened noise parameters and
    the CLIP text embedding. Its input grows with the latent (SD1.5: 2 x 16,384 + 768).
    """

    def __init__(self, latent_numel: int, text_dim: int, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2 * latent_numel + text_dim, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 1),
        )  # fmt: skip

    def forward(self, mean: torch.Tensor, std: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        x = torch.cat([mean.flatten(1).float(), std.flatten(1).float(), text.float()], dim=-1)
        return self.net(x).squeeze(-1)


@TRAINERS.register(
    "find", description="FIND: a Gaussian policy over the initial noise of a frozen sampler (arXiv:2407.19453)"
)
class FINDTrainer(ImageTrainer):
    """FIND; see the module docstring and `FINDConfig`."""

    config_class = FINDConfig
    requires_stochastic = False  # the policy is over the initial noise; the sampler may be the ODE
    kl_to_reference = False  # the regulariser compares the noise policy with the N(0, I) prior

    # ------------------------------------------------------------------------------------------
    # the pieces: noise policy, calibration network, conditions
    # ------------------------------------------------------------------------------------------

    def setup(self):
        c, s = self.config, self.config.sampling
        self.policy.model.requires_grad_(False).eval()  # the environment: frozen
        default_h, default_w = self.policy.adapter.default_size()
        probe = self.policy.adapter.initial_latents(1, s.height or default_h, s.width or default_w, torch.Generator())
        self.latent_shape = tuple(probe.shape[1:])
        texts = list(dict.fromkeys(str(p) for p in self.train_prompts + self.test_prompts))
        self.prompt_index = {text: i for i, text in enumerate(texts)}
        text_dim = pooled_text(self.policy.encode(texts[:1])).shape[-1]
        with torch.random.fork_rng(devices=[]):  # initial weights from run.seed, whatever ran before
            torch.manual_seed(c.run.seed)
            size = {"num_prompts": len(texts)} if c.noise_policy == "per_prompt" else {"embed_dim": text_dim}
            kl_form = "proxy" if c.kl.form == "proxy" else "exact"
            self.noise_policy = FINDNoisePolicy(self.latent_shape, kl_form=kl_form, hidden=c.noise_hidden,
                                                min_std=c.min_std, reduce=self.policy.reduce, **size)  # fmt: skip
            numel = int(torch.tensor(self.latent_shape).prod())
            self.calibration = CalibrationNet(numel, text_dim, hidden=c.calibration_hidden)
        self.noise_policy.to(self.accelerator.device)

    def trained_module(self):
        return self.noise_policy

    def auxiliary_modules(self):
        return {"calibration": (self.calibration, self.config.calibration_lr)}

    def conditions(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """`(condition, text)`: the noise policy's input (prompt ids `[B]` or embeddings `[B, E]`) and the
        pooled text embedding `[B, E]` the calibration network sees."""
        device = self.accelerator.device
        text = pooled_text(self.policy.encode(texts)).float().to(device)
        if self.config.noise_policy == "conditioned":
            return text, text
        missing = [t for t in texts if t not in self.prompt_index]
        if missing:
            raise KeyError(f"per-prompt noise tables cover the train and test prompts only; no row for {missing[:3]}")
        return torch.tensor([self.prompt_index[t] for t in texts], device=device), text

    @torch.no_grad()
    def initial_latents(self, condition, generator, height=None, width=None, mode: str = "sample") -> torch.Tensor:
        """`z_T = mu + sigma * eps` (`mode="sample"`) or `mu` (`"mean"`), with `eps` drawn exactly as the
        pipeline draws its initial noise; returned in the model's dtype (the action the sampler receives)."""
        adapter = self.policy.adapter
        default_h, default_w = adapter.default_size()
        eps = adapter.initial_latents(len(condition), height or default_h, width or default_w, generator)
        mean, std = self.noise_policy.params(condition)
        z = mean if mode == "mean" else mean + std * eps.to(mean)
        return z.to(self.policy.dtype)

    # ------------------------------------------------------------------------------------------
    # the loop's hooks
    # ------------------------------------------------------------------------------------------

    def sample_part(self, texts, generator, rows=None):
        """`texts` through the frozen sampler from `z_T ~ pi_theta`; the draws ride along as `rollout.noise`."""
        s = self.config.sampling
        condition, text = self.conditions(texts)
        z = self.initial_latents(condition, generator, s.height, s.width)
        with torch.no_grad(), self.accelerator.autocast():
            window = self.sde_window(self.state.epoch)
            rollout = self.policy.rollout(texts, latents=z, num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                                          noise_level=s.noise_level, sampler=s.sampler, sde_window=window,
                                          generator=generator, height=s.height, width=s.width)  # fmt: skip
            action = z.float()
            if self.config.old_policy == "prior":
                old = gaussian_log_prob(action, torch.zeros_like(action), 1.0, reduce=self.policy.reduce)
            else:
                old = self.noise_policy.log_prob(action, condition)
        return dataclasses.replace(rollout, noise=NoiseDraws(z=action, condition=condition, text=text,
                                                             log_probs=old.float()))  # fmt: skip

    def update(self, rollout, advantages, trainable, epoch):
        """Calibration steps on the epoch's rewards, then the policy update with `A = lambda_r (r - V)`."""
        c = self.config
        rewards, rows = advantages, trainable.nonzero().flatten()
        draws = rollout.noise.select(rows)
        with torch.no_grad():
            sample_mean, sample_std = self.noise_policy.params(rollout.noise.condition)  # [B, ...] every sample's
        mean, std = sample_mean[rows], sample_std[rows]
        target = rewards[rows].to(mean.device)
        # the calibration regresses on every process's samples (the same loss on each), as one process would
        per_sample = (sample_mean, sample_std, rollout.noise.text, rewards)
        all_mean, all_std, all_text, all_target = (self.processes.gather_rows(x, trainable).to(mean.device)
                                                   for x in per_sample)  # fmt: skip
        net, optimizer = self.aux["calibration"]
        net.train()
        losses = []
        for _ in range(c.calibration_steps):
            loss = (net(all_mean, all_std, all_text) - all_target).pow(2).mean()
            self.accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        net.eval()
        with torch.no_grad():
            baseline = net(mean, std, draws.text)
        calibrated = torch.zeros_like(rewards)
        calibrated[rows] = c.reward_weight * (target - baseline).cpu()
        stats = super().update(rollout, calibrated, trainable, epoch)
        with torch.no_grad():
            kl = self.noise_policy.kl_to_prior(draws.condition)
            mean, std = self.noise_policy.params(draws.condition)
        adv = self.processes.gather_rows(calibrated, trainable)  # every process's, like the other trainers'
        return {
            **stats,
            "calibration/loss": losses[-1] if losses else float("nan"),
            "calibration/baseline_mean": baseline.mean(),
            "adv/mean": adv.mean(),
            "adv/std": adv.std(unbiased=False),
            "noise/kl_to_prior": kl.mean(),
            "noise/mean_rms": mean.pow(2).mean().sqrt(),
            "noise/std_mean": std.mean(),
        }

    def num_elements(self, rollout) -> int:
        return 1

    def train_elements(self, rollout, epoch):
        """One element per sample: its initial noise."""
        return torch.zeros(len(rollout), 1, dtype=torch.long)

    def score(self, batch, index):
        """`log pi_theta(z | c)` against the stored `log pi_old`, and the regulariser `kl.beta * R` (`[b, 1]`)."""
        log_prob, regulariser = self.model(batch.noise.z, batch.noise.condition)  # [b], [b]
        old = batch.noise.log_probs.to(log_prob.device)
        terms = Terms(logp=log_prob[:, None], old_logp=old[:, None], logs={"regulariser": regulariser[:, None]})
        coef = self.config.kl.coef(self.state.epoch)
        if coef:
            terms.penalty = coef * regulariser[:, None]
        return terms

    def optimizer_step(self, reduction: str = "mean"):
        norm = super().optimizer_step(reduction)
        self.noise_policy.clamp_std_()  # FIND: sigma >= min_std after every optimizer step
        return norm

    # ------------------------------------------------------------------------------------------
    # evaluation: the shared evaluation, starting from the noise policy's latents
    # ------------------------------------------------------------------------------------------

    def evaluation_latents(self, prompts, generator, height, width):
        """The noise policy's latents for the evaluation prompts, drawn with the evaluation generator (so the
        evaluation keeps its fixed noise: at the prior it is exactly the base model's evaluation)."""
        condition, _ = self.conditions(list(prompts))
        return self.initial_latents(condition, generator, height, width, mode=self.config.eval_noise)
