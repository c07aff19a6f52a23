"""The image modality on the shared loop: a `DiffusionPolicy`, its collector and evaluator, denoising steps.

`ImageTrainer` builds the policy from `config.model` (`flowrl.models.build_policy`), collects with the
`ImageCollector` and evaluates with the `ImageEvaluator`. Its elements are the T denoising steps of each
trajectory (`[B, T]`): `steps.selection` picks which stochastic steps train, `steps.weighting` weighs them,
and `transition_terms` scores stored transitions `x_t -> x_{t+1}` under the current policy (the SDE or DDIM
kernels' Gaussian log-probabilities; GRPO-Guard's behaviour means; the `kl` regulariser to the reference in
any of its forms), for whole trajectories (`score`) and for replay-buffer transitions (DPOK) alike.
"""

from __future__ import annotations

import torch

from flowrl import prompts as prompt_sets
from flowrl.core import gaussian_mean_kl, get_objective, sde_window_at, select_steps, step_weights
from flowrl.core.ratios import reduce_elements
from flowrl.models import build_policy
from flowrl.policies.diffusion import DiffusionRollout
from flowrl.policies.sde import StepOutput
from flowrl.tracking import upscale
from flowrl.trainers.base import Trainer
from flowrl.trainers.collect import ImageCollector
from flowrl.trainers.evaluate import ImageEvaluator
from flowrl.trainers.state import seeded
from flowrl.trainers.update import Terms


STEP_KL_FORMS = ("gaussian", "gaussian_dt", "eps_mse")


def step_kl(form: str, out: StepOutput, ref: StepOutput, *, prediction=None, ref_prediction=None, dt=None,
            reduce: str = "mean") -> torch.Tensor:  # fmt: skip
    """`[n]` KL regulariser between the current and the reference kernels of `n` denoising steps.

    - `gaussian`: `KL(N(mu, s^2) || N(mu_ref, s^2)) = red_d (mu - mu_ref)^2 / (2 s^2)` (both share the std `s`;
      DPOK's eq. 9 per-step bound, the Flow-GRPO paper's KL);
    - `gaussian_dt`: that KL times `|dt|` (Flow-GRPO's code divides by `sigma_t^2 = s^2 / |dt|`);
    - `eps_mse`: `red_d (e - e_ref)^2` of the guided network predictions (DPOK's code, `kl_regularizer`); for a
      DDIM kernel it is the exact KL divided by `w_t = (sqrt(1 - a' - s^2) - sqrt(a' (1 - a) / a))^2 / (2 s^2)`.
    """
    if form == "gaussian":
        return gaussian_mean_kl(out.mean, ref.mean, out.std, reduce=reduce)
    if form == "gaussian_dt":
        return gaussian_mean_kl(out.mean, ref.mean, out.std, dt=dt, reduce=reduce)
    if form == "eps_mse":
        return reduce_elements((prediction.float() - ref_prediction.float()) ** 2, reduce)
    raise ValueError(f"kl form must be one of {', '.join(STEP_KL_FORMS)}, got {form!r}")


class ImageTrainer(Trainer):
    """Base of the image trainers; see the module docstring. Subclasses add their config and hooks."""

    image_scale = True
    requires_stochastic = True
    """Rollouts must have a stochastic step (log-ratio trainers); FIND and AC-Flow train on ODE samples."""
    kl_to_reference = True
    """The `kl` regulariser compares with the reference policy (FIND's compares with the N(0, I) prior)."""

    def __init__(self, config, **kwargs):
        self.train_prompts = prompt_sets.load(config.prompts.train)
        self.test_prompts = prompt_sets.load(config.prompts.test)
        super().__init__(config, **kwargs)
        if self.store_means and self.config.sampling.sampler == "cps":
            raise ValueError("grpo_guard's RatioNorm is defined on Gaussian step log-probs; with CPS use sampler "
                             "cps_gaussian (cps keeps Flow-GRPO's -mean (x' - mu)^2 log-prob)")  # fmt: skip
        if self.kl_to_reference and self.config.kl.beta and not self.has_reference():
            # full fine-tuning: the reference is a frozen copy of the base
            self.policy.freeze_reference(offload=self.config.kl.reference_offload)

    def check_inputs(self) -> None:
        """Every reward (and gold metric) that can judge prompts up front checks the train and test sets."""
        if not self.train_prompts or not self.test_prompts:
            raise ValueError("the training or test prompt set is empty")
        for name, fn in {**self.rewards.fns, **self.eval_fns}.items():
            check = getattr(fn, "check_prompts", None)
            if check is not None:
                for label, prompts in (("prompts.train", self.train_prompts), ("prompts.test", self.test_prompts)):
                    try:
                        check([str(p) for p in prompts])
                    except ValueError as err:
                        raise ValueError(f"{label} does not suit reward {name!r}: {err}") from None

    def has_reference(self) -> bool:
        return self.policy.has_lora or self.policy.reference_model is not None

    # ------------------------------------------------------------------------------------------
    # the modality's parts
    # ------------------------------------------------------------------------------------------

    def build_policy(self):
        log = print if self.is_main else None
        return build_policy(self.config.model, forward_batch_size=self.config.sampling.forward_batch_size,
                            device=self.accelerator.device, log=log)  # fmt: skip

    def build_collector(self) -> ImageCollector:
        c = self.config
        return ImageCollector(sample_part=self.sample_part, rewards=self.rewards, processes=self.processes,
                              train_prompts=self.train_prompts, prompts_per_epoch=c.prompts.prompts_per_epoch,
                              group_size=c.prompts.group_size, seed=c.run.seed,
                              reward_overlap=c.sampling.reward_overlap, memory=self.memory)  # fmt: skip

    def build_evaluator(self) -> ImageEvaluator:
        return ImageEvaluator(policy=self.policy, rewards=self.rewards, metrics=self.eval_fns,
                              processes=self.processes, test_prompts=self.test_prompts, eval_config=self.config.eval,
                              sampling=self.config.sampling, initial_latents=self.evaluation_latents,
                              autocast=self.accelerator.autocast)  # fmt: skip

    @property
    def store_means(self) -> bool:
        """Rollouts keep each step's behaviour mean when the objective needs it (GRPO-Guard's RatioNorm)."""
        return self.objective is not None and "mean_diff_sq" in get_objective(self.objective).required

    def sample_part(self, texts: list[str], generator, rows: range | None = None) -> DiffusionRollout:
        """One sampling call: the policy's samples of `texts` (at positions `rows` of the epoch's prompt list)
        with the configured sampler, noise from `generator` (one per text, or one for all); with
        `sampling.init_same_noise` a group's samples start from one noise."""
        s = self.config.sampling
        latents = self.group_noise(rows, s.height, s.width) if s.init_same_noise and rows is not None else None
        with self.accelerator.autocast():
            rollout = self.policy.rollout(texts, num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                                          noise_level=s.noise_level, sampler=s.sampler,
                                          sde_window=self.sde_window(self.state.epoch), latents=latents,
                                          generator=generator, height=s.height, width=s.width,
                                          store_means=self.store_means, post_window_solver=s.post_window_solver,
                                          post_window_ratio=s.post_window_ratio)  # fmt: skip
        if self.requires_stochastic and not rollout.sde_mask.any():
            raise ValueError(f"sampler {s.sampler!r} with noise_level {s.noise_level} has no stochastic step to train")
        return rollout

    def group_noise(self, rows, height: int | None, width: int | None, per_group: int = 1) -> torch.Tensor:
        """Initial latents `[len(rows), ...]` shared within each group of the epoch's prompt list (MixGRPO's and
        DanceGRPO's `--init_same_noise`): `per_group` draws per group (TempFlow-GRPO's seeds), draw `d` of group
        `g` seeded by `(seed, epoch, 8, g, d)`, so every process and a resumed run start from the same noise.
        Sample `i` of a group of `k` takes draw `i * per_group // k`."""
        k = self.config.prompts.group_size
        default_h, default_w = self.policy.adapter.default_size()
        height, width = height or default_h, width or default_w
        noises = {}
        for row in rows:
            key = (row // k, (row % k) * per_group // k)
            if key not in noises:
                generator = seeded(self.config.run.seed, self.state.epoch, 8, *key)
                noises[key] = self.policy.adapter.initial_latents(1, height, width, generator)
        return torch.cat([noises[(row // k, (row % k) * per_group // k)] for row in rows])

    def sde_window(self, epoch: int) -> tuple[int, int] | None:
        """The stochastic steps of epoch `epoch`'s rollouts (`sampling.sde_window_schedule`), the same on every
        process and on resume."""
        s = self.config.sampling
        generator = seeded(self.config.run.seed, epoch, 7)
        return sde_window_at(s.sde_window_schedule, epoch, s.num_steps, window=s.sde_window, size=s.window_size,
                             every=s.window_every, stride=s.window_stride, span=s.window_span,
                             generator=generator)  # fmt: skip

    evaluation_latents = None
    """`(texts, generator, height, width) -> latents` of evaluation samples (FIND), or None: the policy's noise."""

    def log_samples(self) -> None:
        if not self.is_main or self.last_epoch is None:
            return
        rollout, rewards = self.last_epoch
        path = self.output_dir / "images" / f"epoch_{self.epoch:04d}.png"
        images = self.evaluator.sample_grid(rollout, self.rewards.combined(rewards), self.config.prompts.group_size,
                                            path, title=f"epoch {self.epoch}")  # fmt: skip
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":  # small images (the digits' 8x8) upscaled so they can be seen
                tracker.writer.add_images("samples", upscale(images.float().clamp(0, 1)), self.epoch)

    # ------------------------------------------------------------------------------------------
    # elements: the denoising steps
    # ------------------------------------------------------------------------------------------

    def num_elements(self, rollout) -> int:
        return rollout.num_steps

    def train_elements(self, rollout, epoch: int) -> torch.Tensor:
        """`[B, k]` trained steps: `steps.selection` among the rollout's stochastic steps."""
        return self._select(rollout.sde_steps, len(rollout), epoch)

    def _select(self, sde: torch.Tensor, rows: int, epoch: int) -> torch.Tensor:
        s = self.config.steps
        kwargs = {"all": {}, "first_fraction": {"fraction": s.fraction}, "random": {"k": s.k}}.get(s.selection)
        if s.selection == "window":
            start, end = s.window or (0, len(sde))
            kwargs = {"start": start, "end": end}
        if s.selection == "random":
            kwargs["generator"] = seeded(self.config.run.seed, epoch, 4, self.processes.rank)
        return sde[select_steps(s.selection, len(sde), rows, **kwargs)]

    def trainable_steps(self, rollout) -> torch.Tensor:
        """The steps `steps.selection` trains in rollouts like `rollout` (for `random`: every stochastic step)."""
        sde = rollout.sde_steps
        return sde if self.config.steps.selection == "random" else self._select(sde, 1, 0)[0]

    def step_weight(self, rollout, steps: torch.Tensor) -> torch.Tensor | None:
        """`[n]` `steps.weighting` of the steps `steps [n]` of rollouts like `rollout` (None: uniform), with
        `normalize_weights` scaled to mean 1 over the steps the selection trains (so an untrained last step with
        a tiny `dt` does not shrink `inv_dt`'s trained weights)."""
        s = self.config.steps
        if s.weighting == "uniform":
            return None
        weights = step_weights(s.weighting, rollout.sigmas.cpu(), **s.weighting_kwargs)
        if s.normalize_weights:
            weights = weights / weights[self.trainable_steps(rollout)].mean().clamp_min(1e-12)
        return weights[steps.cpu()]

    def score(self, batch: DiffusionRollout, index: torch.Tensor) -> Terms:
        """The stored transitions at steps `index [b, c]` of the minibatch, column-major."""
        b, c = index.shape
        rows = torch.arange(b).repeat(c)  # column-major: each column's b rows are one forward chunk
        steps = index.t().reshape(-1)
        r, s = rows.to(batch.latents.device), steps.to(batch.latents.device)
        states, next_states = batch.latents[r, s], batch.latents[r, s + 1]
        cond = {k: v[batch.prompt_ids[rows].to(v.device)] for k, v in batch.cond.items()}
        old_means = batch.means[r, s] if self.store_means else None
        terms = self.transition_terms(batch, states, next_states, steps, cond, batch.log_probs[rows, steps], old_means)
        return Terms.from_tensors({k: v.reshape(c, b).t() for k, v in terms.tensors().items()})

    def transition_terms(self, settings: DiffusionRollout, states, next_states, steps: torch.Tensor, cond: dict,
                         old_logp: torch.Tensor, old_means: torch.Tensor | None = None) -> Terms:  # fmt: skip
        """`Terms` (`[n]` each) of `n` transitions `states -> next_states` at `steps` sampled like `settings`.

        `logp` and `old_logp`; GRPO-Guard's `std` and `mean_diff_sq` (from the behaviour means `old_means`);
        the step weights; and the `kl` regulariser to the reference (`logs["kl"]`, and the penalty
        `beta * KL` once its warm-up is over).
        """
        kl = self.config.kl
        predictions = kl.beta > 0 and kl.form == "eps_mse"
        scored = self.policy.score_transitions(settings, states, next_states, steps, cond,
                                               return_prediction=predictions)  # fmt: skip
        out, prediction = scored if predictions else (scored, None)
        device = out.log_prob.device
        terms = Terms(logp=out.log_prob, old_logp=old_logp.to(device).float())
        if old_means is not None:
            diff = reduce_elements((out.mean - old_means.to(out.mean)) ** 2, settings.reduce)  # [n]
            terms.inputs = {"std": out.std, "mean_diff_sq": diff}
        weight = self.step_weight(settings, steps)
        if weight is not None:
            terms.weight = weight.to(device)
        if kl.beta > 0:
            scored = self.policy.score_transitions(settings, states, next_states, steps, cond, reference=True,
                                                   return_prediction=predictions)  # fmt: skip
            ref, ref_prediction = scored if predictions else (scored, None)
            sigmas = settings.sigmas.to(device)
            dt = sigmas[steps.to(device) + 1] - sigmas[steps.to(device)]
            value = step_kl(kl.form, out, ref, prediction=prediction, ref_prediction=ref_prediction, dt=dt,
                            reduce=settings.reduce)  # fmt: skip
            terms.logs["kl"] = value.detach()
            coef = kl.coef(self.state.epoch)
            if coef:
                terms.penalty = coef * value
        return terms
