"""The denoising steps as the elements of an image rollout: which train, how much each weighs, their loss inputs.

`StepTerms` scores stored transitions `x_t -> x_{t+1}` under the current policy (the SDE or DDIM kernels' Gaussian
log-probabilities; GRPO-Guard's behaviour means; the `kl` regulariser to the reference in any of its forms), for
whole trajectories (`terms`) and for single transitions of a replay buffer (`transition_terms`, DPOK) alike, and
selects (`steps.selection`) and weighs (`steps.weighting`) the steps that train.
"""

from __future__ import annotations

import torch

from flowrl.core import gaussian_mean_kl, select_steps, step_weights
from flowrl.core.copies import to_device
from flowrl.core.ratios import reduce_elements
from flowrl.core.terms import Terms
from flowrl.image.config import StepConfig
from flowrl.policies.diffusion import DiffusionRollout
from flowrl.policies.sde import StepOutput
from flowrl.runtime import seeded
from flowrl.sections import KLConfig


STEP_KL_FORMS = ("gaussian", "gaussian_dt", "eps_mse")


def step_kl(
    form: str, out: StepOutput, ref: StepOutput, *, prediction=None, ref_prediction=None, dt=None, reduce: str = "mean"
) -> torch.Tensor:
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


class StepTerms:
    """See the module docstring.

    Args:
        policy (`DiffusionPolicy`): scores the transitions (its `forward_module` carries the gradient).
        steps (`StepConfig`, *optional*): the step selection and weighting (None: every stochastic step, uniform).
        kl (`KLConfig`, *optional*): the regulariser to the reference (None: none).
        store_means (`bool`): the rollouts keep behaviour means (GRPO-Guard's RatioNorm inputs).
        seed (`int`): `run.seed` (a `random` selection is drawn from `(seed, epoch, 4)` for every sample).
    """

    def __init__(self, policy, steps: StepConfig | None, kl: KLConfig | None, *, store_means: bool, seed: int):
        self.policy, self.steps, self.kl, self.store_means, self.seed = policy, steps, kl, store_means, seed

    # ------------------------------------------------------------------------------------------
    # which steps train and their weights
    # ------------------------------------------------------------------------------------------

    def select(self, rollout: DiffusionRollout, rows: torch.Tensor, size: int, epoch: int) -> torch.Tensor:
        """`[B, k]` trained steps of the rollout's rows (at positions `rows` of the epoch's `size` samples):
        `steps.selection` among the stochastic steps, the same for a sample on any number of processes."""
        sde = rollout.sde_steps
        s = self.steps
        if s is None:
            return sde.expand(len(rollout), len(sde))
        if s.selection == "random":  # drawn for every sample of the epoch, each process keeps its rows'
            chosen = select_steps("random", len(sde), size, k=s.k, generator=seeded(self.seed, epoch, 4))
            return sde[chosen[rows]]
        return sde[self._fixed(len(sde), len(rollout))]

    def _fixed(self, n: int, rows: int) -> torch.Tensor:
        s = self.steps
        kwargs = {"all": {}, "first_fraction": {"fraction": s.fraction}}.get(s.selection, {})
        if s.selection == "window":
            start, end = s.window or (0, n)
            kwargs = {"start": start, "end": end}
        return select_steps(s.selection, n, rows, **kwargs)

    def trainable_steps(self, rollout: DiffusionRollout) -> torch.Tensor:
        """The steps the selection trains in rollouts like `rollout` (for `random`: every stochastic step)."""
        sde = rollout.sde_steps
        if self.steps is None or self.steps.selection == "random":
            return sde
        return sde[self._fixed(len(sde), 1)[0]]

    def weight(self, rollout: DiffusionRollout, steps: torch.Tensor) -> torch.Tensor | None:
        """`[n]` `steps.weighting` of the steps `steps [n]` of rollouts like `rollout` (None: uniform), with
        `normalize_weights` scaled to mean 1 over the steps the selection trains (`trainable_steps`), so an
        untrained last step with a tiny `dt` does not shrink `inv_dt`'s trained weights."""
        s = self.steps
        if s is None or s.weighting == "uniform":
            return None
        weights = step_weights(s.weighting, rollout.sigmas.cpu(), **s.weighting_kwargs)
        if s.normalize_weights:
            weights = weights / weights[self.trainable_steps(rollout)].mean().clamp_min(1e-12)
        return weights[steps.cpu()]

    # ------------------------------------------------------------------------------------------
    # loss inputs
    # ------------------------------------------------------------------------------------------

    def terms(self, batch: DiffusionRollout, index: torch.Tensor, epoch: int) -> Terms:
        """The stored transitions at steps `index [b, c]` of the rows of `batch`, scored column-major (each
        column's b rows are one forward chunk)."""
        b, c = index.shape
        rows = torch.arange(b).repeat(c)
        steps = index.t().reshape(-1)
        device = batch.latents.device  # host indices, copied without waiting for the device
        r, s = to_device(rows, device), to_device(steps, device)
        states, next_states = batch.latents[r, s], batch.latents[r, s + 1]
        cond = batch.sample_cond(rows)  # the prompts' text conditioning (editing: and their source images')
        old_means = batch.means[r, s] if self.store_means else None
        terms = self.transition_terms(
            batch, states, next_states, steps, cond, _at(batch.log_probs, rows, steps), epoch, old_means
        )
        return Terms.from_tensors({k: v.reshape(c, b).t() for k, v in terms.tensors().items()})

    def transition_terms(
        self,
        settings: DiffusionRollout,
        states,
        next_states,
        steps: torch.Tensor,
        cond: dict,
        old_logp: torch.Tensor,
        epoch: int,
        old_means: torch.Tensor | None = None,
    ) -> Terms:
        """`Terms` (`[n]` each) of `n` transitions `states -> next_states` at `steps` sampled like `settings`.

        `logp` and `old_logp`; GRPO-Guard's `std` and `mean_diff_sq` (from the behaviour means `old_means`);
        the step weights; and the `kl` regulariser to the reference (`logs["kl"]`, and the penalty
        `beta * KL` once its warm-up is over).
        """
        kl = self.kl
        with_kl = kl is not None and kl.beta > 0
        predictions = with_kl and kl.form == "eps_mse"
        scored = self.policy.score_transitions(
            settings, states, next_states, steps, cond, return_prediction=predictions
        )
        out, prediction = scored if predictions else (scored, None)
        device = out.log_prob.device
        terms = Terms(logp=out.log_prob, old_logp=old_logp.to(device).float())
        if old_means is not None:
            diff = reduce_elements((out.mean - old_means.to(out.mean)) ** 2, settings.reduce)  # [n]
            terms.inputs = {"std": out.std, "mean_diff_sq": diff}
        weight = self.weight(settings, steps)
        if weight is not None:
            terms.weight = weight.to(device, non_blocking=True)
        if with_kl:
            scored = self.policy.score_transitions(
                settings, states, next_states, steps, cond, reference=True, return_prediction=predictions
            )
            ref, ref_prediction = scored if predictions else (scored, None)
            sigmas, host = settings.sigmas.cpu(), steps.cpu()  # the schedule is host data
            dt = (sigmas[host + 1] - sigmas[host]).to(device, non_blocking=True)
            value = step_kl(
                kl.form, out, ref, prediction=prediction, ref_prediction=ref_prediction, dt=dt, reduce=settings.reduce
            )
            terms.logs["kl"] = value.detach()
            coef = kl.coef(epoch)
            if coef:
                terms.penalty = coef * value
        return terms


def _at(values: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`values[rows, steps]` with the host indices copied to `values`' device first without waiting for it (indexing a
    GPU tensor with CPU indices copies them with a blocking copy)."""
    device = values.device
    return values[to_device(rows, device), to_device(steps, device)]
