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

In flowrl's terms: the `advantage` estimator is `raw` (the calibration network, `critic`, is the baseline), the
`objective` the core's `clamp`, `kl` the proximity term (`proxy` or the exact `gaussian` KL to the prior),
and each sample has one element, its initial noise (kept as typed `NoiseDraws` on the rollout), sampled by
`NoiseSampler` (the noise policy's draw, then the frozen sampler).
`docs/algorithms/find.md` records what is confirmed by the released code and what flowrl chose.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar, Literal

import torch
from torch import nn

from flowrl.core import gaussian_log_prob
from flowrl.core.terms import Terms
from flowrl.image import ImageConfig
from flowrl.policies.noise import InitialNoisePolicy, NoiseDraws
from flowrl.policies.value import pooled_text
from flowrl.run.registry import register
from flowrl.sections import AdvantageConfig, HasGroupFilter, HasKL, HasObjective, KLConfig, ObjectiveConfig
from flowrl.trainers.shared.image import ImageAlgorithm


logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CalibrationConfig:
    """FIND's dynamic reward calibration `V(mu, sigma, c)`, regressed on every epoch's rewards before the policy."""

    lr: float = 1e-4
    """AdamW learning rate (FIND: 1e-4)."""
    hidden: int = 256
    """Width of its three hidden layers (FIND: 256)."""
    steps: int = 5
    """Full-batch steps per epoch, before the policy update (FIND: v_step 5)."""


@dataclasses.dataclass
class FINDConfig(HasObjective, HasKL, HasGroupFilter, ImageConfig):
    kl_forms: ClassVar[tuple[str, ...]] = ("proxy", "gaussian")
    renamed: ClassVar[dict[str, str]] = {
        "calibration_lr": "critic.lr",
        "calibration_hidden": "critic.hidden",
        "calibration_steps": "critic.steps",
    }

    objective: ObjectiveConfig = dataclasses.field(
        default_factory=lambda: ObjectiveConfig(name="clamp", clip_eps_low=0.2)
    )
    """The ratio clamp `[1 - eps, 1 + eps]` with FIND's eps 0.2 (on element-mean log-densities)."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=lambda: AdvantageConfig(estimator="raw"))
    """The reward itself: FIND's baseline is the calibration network `V(mu, sigma, c)`."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(beta=0.01, form="proxy"))
    """`lambda_KL` 0.01 on FIND's released `mean(mu^2 + (sigma - 1)^2)` (`proxy`); `gaussian`: the exact
    `KL(pi_theta || N(0, I))`, element mean."""
    critic: CalibrationConfig = dataclasses.field(default_factory=CalibrationConfig)
    """The calibration network."""
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
    eval_noise: Literal["sample", "mean"] = "sample"
    """Evaluation latents: `sample`, `mu + sigma * eps` with the evaluation noise `eps` (at the prior this is
    exactly the base model's evaluation); `mean`, `mu` alone (one image per prompt under an ODE sampler)."""

    def checks(self):
        return [
            *super().checks(),
            (self.model.lora_rank == 0, "find keeps the diffusion model frozen: model.lora_rank must be 0"),
            (self.min_std > 0, "min_std must be > 0"),
            (self.critic.steps >= 0, "critic.steps must be >= 0"),
            (self.noise_hidden >= 1 and self.critic.hidden >= 1, "hidden sizes must be >= 1"),
        ]


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
            nn.Linear(2 * latent_numel + text_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, mean: torch.Tensor, std: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        x = torch.cat([mean.flatten(1).float(), std.flatten(1).float(), text.float()], dim=-1)
        return self.net(x).squeeze(-1)


class NoiseSampler:
    """FIND's sampling call: `z_T ~ pi_theta(. | c)`, then the frozen sampler from `z_T`; the draws ride along as
    `rollout.noise`."""

    def __init__(self, algorithm: FIND):
        self.algorithm = algorithm

    @torch.no_grad()
    def __call__(self, texts, generators, rows, epoch):
        algo = self.algorithm
        s, policy = algo.config.sampling, algo.policy
        condition, text = algo.conditions(texts)
        z = algo.initial_latents(condition, generators, s.height, s.width)
        with algo.modality.context.autocast():
            window = algo.base_sampler.window(epoch)
            rollout = policy.rollout(
                texts,
                latents=z,
                num_steps=s.num_steps,
                guidance_scale=s.guidance_scale,
                noise_level=s.noise_level,
                sampler=s.sampler,
                sde_window=window,
                generator=generators,
                height=s.height,
                width=s.width,
            )
            action = z.float()
            if algo.config.old_policy == "prior":
                old = gaussian_log_prob(action, torch.zeros_like(action), 1.0, reduce=policy.reduce)
            else:
                old = algo.noise_policy.log_prob(action, condition)
        return dataclasses.replace(
            rollout, noise=NoiseDraws(z=action, condition=condition, text=text, log_probs=old.float())
        )


@register("find", description="FIND: a Gaussian policy over the initial noise of a frozen sampler (arXiv:2407.19453)")
class FIND(ImageAlgorithm):
    """FIND; see the module docstring and `FINDConfig`."""

    config_class = FINDConfig
    edits = False  # its noise sampler takes no source images
    requires_stochastic = False  # the policy is over the initial noise; the sampler may be the ODE
    shard_refusal = "FIND trains a small noise table beside a frozen model: shard nothing, run DDP (run.shard: none)"
    kl_to_reference = False  # the regulariser compares the noise policy with the N(0, I) prior

    # ------------------------------------------------------------------------------------------
    # the pieces: noise policy, calibration network, conditions
    # ------------------------------------------------------------------------------------------

    def build(self):
        c, s = self.config, self.config.sampling
        self.policy.model.requires_grad_(False).eval()  # the environment: frozen
        default_h, default_w = self.policy.adapter.default_size()
        probe = self.policy.adapter.initial_latents(1, s.height or default_h, s.width or default_w, torch.Generator())
        self.latent_shape = tuple(probe.shape[1:])
        m = self.modality
        texts = list(dict.fromkeys(str(p) for p in m.train_prompts + m.test_prompts + m.val_prompts))
        self.prompt_index = {text: i for i, text in enumerate(texts)}
        text_dim = pooled_text(self.policy.encode(texts[:1])).shape[-1]
        with torch.random.fork_rng(devices=[]):  # initial weights from run.seed, whatever ran before
            torch.manual_seed(c.run.seed)
            size = {"num_prompts": len(texts)} if c.noise_policy == "per_prompt" else {"embed_dim": text_dim}
            kl_form = "proxy" if c.kl.form == "proxy" else "exact"
            self.noise_policy = FINDNoisePolicy(
                self.latent_shape,
                kl_form=kl_form,
                hidden=c.noise_hidden,
                min_std=c.min_std,
                reduce=self.policy.reduce,
                **size,
            )
            numel = int(torch.tensor(self.latent_shape).prod())
            self.calibration = CalibrationNet(numel, text_dim, hidden=c.critic.hidden)
        self.noise_policy.to(self.engine.device)
        self.base_sampler = self.modality.sampler(requires_stochastic=False)

    def trained_module(self):
        return self.noise_policy

    def auxiliary_modules(self):
        return {"calibration": (self.calibration, self.config.critic.lr)}

    def conditions(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """`(condition, text)`: the noise policy's input (prompt ids `[B]` or embeddings `[B, E]`) and the
        pooled text embedding `[B, E]` the calibration network sees."""
        device = self.engine.device
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

    def sampler(self):
        return NoiseSampler(self)

    def prepare(self, collected, advantages, trainable, epoch):
        """Calibration steps on the epoch's rewards (every process's samples: the one-process regression), then the
        policy update's advantages `A = lambda_r (r - V)`."""
        c, rollout = self.config, collected.data
        mine = trainable[collected.rows]  # [B] this process's trainable samples
        rows = mine.nonzero().flatten()
        with torch.no_grad():
            sample_mean, sample_std = self.noise_policy.params(rollout.noise.condition)  # [B, ...] every sample's
        local_rewards = advantages[collected.rows]
        # the calibration regresses on every process's samples (the same loss on each), as one process would
        per_sample = (sample_mean, sample_std, rollout.noise.text, local_rewards)
        device = sample_mean.device
        all_mean, all_std, all_text, all_target = (self.processes.gather_rows(x, mine).to(device) for x in per_sample)
        net = self.engine.aux_module("calibration")
        _, optimizer = self.engine.aux["calibration"]
        net.train()
        losses = []
        for _ in range(c.critic.steps):
            loss = (net(all_mean, all_std, all_text) - all_target).pow(2).mean()
            loss.backward()  # the same whole-batch loss on every process: no reduction
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        net.eval()
        with torch.no_grad():
            baseline = net(sample_mean[rows], sample_std[rows], rollout.noise.text[rows]).cpu()
        calibrated = torch.zeros(len(rollout))
        calibrated[rows] = c.reward_weight * (local_rewards[rows] - baseline)
        full = self.processes.gather_at(calibrated, collected.rows, collected.size)  # [N]
        draws = rollout.noise.select(rows)
        with torch.no_grad():
            kl = self.noise_policy.kl_to_prior(draws.condition)
            mean, std = self.noise_policy.params(draws.condition)
            in_band = self.in_band(draws)
        adv = full[trainable]
        frac = self.processes.sum(float(in_band.sum())) / max(int(trainable.sum()), 1)  # global fraction
        stats = {
            "calibration/loss": losses[-1] if losses else float("nan"),
            "calibration/baseline_mean": self.processes.sum(float(baseline.sum())) / max(int(trainable.sum()), 1),
            "adv/mean": adv.mean(),
            "adv/std": adv.std(unbiased=False),
            "noise/kl_to_prior": kl.mean(),
            "noise/mean_rms": mean.pow(2).mean().sqrt(),
            "noise/std_mean": std.mean(),
            "noise/in_band_frac": frac,
        }
        if frac == 0 and c.old_policy == "prior" and int(trainable.sum()) and not self._warned_out_of_band:
            self._warned_out_of_band = True
            logger.warning(
                "find: epoch %d: every sample's ratio to the N(0, I) prior is outside the clamp band, so the policy "
                "gradient is zero and only the regulariser trains (FIND's released code, old_policy: prior); "
                "old_policy: previous gives PPO's fresh trust region each epoch",
                epoch,
            )
        return self.update_batch(collected, full, trainable), stats

    _warned_out_of_band = False

    def in_band(self, draws) -> torch.Tensor:
        """`[b]` bool: the samples whose ratio `pi_theta(z) / pi_old(z)` at the weights before the update lies in the
        clamp band `[1 - eps_low, 1 + eps_high]`, the only ones the `clamp` objective gives a policy gradient.

        With `old_policy: prior` the ratio is about `exp(KL(pi_theta || N(0, I)))` per element, so past a KL of about
        `log(1 + eps)` (0.18 nats at eps 0.2) no sample is in the band (`noise/in_band_frac` 0, warned once)."""
        o = self.config.objective
        low, high = o.clip_eps_low, o.clip_eps_high if o.clip_eps_high is not None else o.clip_eps_low
        ratio = (self.noise_policy.log_prob(draws.z, draws.condition) - draws.log_probs.to(draws.z.device)).exp()
        return (ratio >= 1 - low) & (ratio <= 1 + high)

    def num_elements(self, data) -> int:
        return 1

    def elements(self, batch, epoch):
        """One element per sample: its initial noise."""
        return torch.zeros(len(batch.data), 1, dtype=torch.long), None

    def terms(self, batch, index):
        """`log pi_theta(z | c)` against the stored `log pi_old`, and the regulariser `kl.beta * R` (`[b, 1]`)."""
        noise = batch.data.noise
        log_prob, regulariser = self.engine.model(noise.z, noise.condition)  # [b], [b]
        old = noise.log_probs.to(log_prob.device)
        terms = Terms(logp=log_prob[:, None], old_logp=old[:, None], logs={"regulariser": regulariser[:, None]})
        coef = self.config.kl.coef(self.epoch)
        if coef:
            terms.penalty = coef * regulariser[:, None]
        return terms

    def after_step(self):
        self.noise_policy.clamp_std_()  # FIND: sigma >= min_std after every optimizer step

    # ------------------------------------------------------------------------------------------
    # evaluation: the shared evaluation, starting from the noise policy's latents
    # ------------------------------------------------------------------------------------------

    def evaluation_latents(self, prompts, generator, height, width):
        """The noise policy's latents for the evaluation prompts, drawn with the evaluation generator (so the
        evaluation keeps its fixed noise: at the prior it is exactly the base model's evaluation)."""
        condition, _ = self.conditions(list(prompts))
        return self.initial_latents(condition, generator, height, width, mode=self.config.eval_noise)
