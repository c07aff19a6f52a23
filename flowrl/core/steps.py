"""Which denoising steps are trained, and how much each one weighs: the axis users ablate.

A **step selection** returns step indices `[B, k]` (sorted; the same count k for every sample, so the
trainer can batch one step across samples). A **step weighting** maps the sampler's noise levels
`sigmas[T + 1]` (flow-matching convention: 1 = pure noise, `x_s = (1 - s) x0 + s eps`) to per-step
weights `[T]`, which `compute_policy_loss(..., weights=...)` multiplies onto the per-step loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flowrl.registry import Registry, check_kwargs


STEP_SELECTIONS: Registry = Registry("step selection")
STEP_WEIGHTINGS: Registry = Registry("step weighting")


def _rows(steps: torch.Tensor, batch_size: int) -> torch.Tensor:
    return steps.unsqueeze(0).expand(batch_size, -1).clone()


@STEP_SELECTIONS.register("all")
def select_all(num_steps: int, batch_size: int) -> torch.Tensor:
    """Every step."""
    return _rows(torch.arange(num_steps), batch_size)


@STEP_SELECTIONS.register("first_fraction")
def select_first_fraction(num_steps: int, batch_size: int, *, fraction: float = 0.99) -> torch.Tensor:
    """The first `int(T * fraction)` steps (Flow-GRPO's `timestep_fraction`: 0.99 of 10 -> 9)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    count = max(1, int(num_steps * fraction))
    return _rows(torch.arange(count), batch_size)


@STEP_SELECTIONS.register("window")
def select_window(num_steps: int, batch_size: int, *, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Steps `start <= t < end` (an SDE window, MixGRPO / Flow-GRPO-Fast)."""
    end = num_steps if end is None else end
    if not 0 <= start < end <= num_steps:
        raise ValueError(f"window must satisfy 0 <= start < end <= {num_steps}, got start={start}, end={end}")
    return _rows(torch.arange(start, end), batch_size)


@STEP_SELECTIONS.register("random")
def select_random(
    num_steps: int, batch_size: int, *, k: int = 1, generator: torch.Generator | None = None
) -> torch.Tensor:
    """`k` distinct random steps per sample, seeded by `generator` (DDPO's per-sample permutation)."""
    if not 1 <= k <= num_steps:
        raise ValueError(f"k must be in [1, {num_steps}], got {k}")
    keys = torch.rand(batch_size, num_steps, generator=generator)
    return keys.argsort(dim=-1)[:, :k].sort(dim=-1).values


def select_steps(name: str, num_steps: int, batch_size: int, **kwargs) -> torch.Tensor:
    """Step indices `[B, k]` from the selection `name` (`all`, `first_fraction`, `window`, `random`)."""
    fn = STEP_SELECTIONS.get(name)
    check_kwargs("step selection", name, kwargs, fn)
    if num_steps < 1 or batch_size < 0:
        raise ValueError(f"need num_steps >= 1 and batch_size >= 0, got {num_steps}, {batch_size}")
    return fn(num_steps, batch_size, **kwargs)


SDE_WINDOW_SCHEDULES = ("fixed", "progressive", "random")
"""How the stochastic window of the rollouts moves over training (`sde_window_at`)."""


def sde_window_at(
    schedule: str,
    epoch: int,
    num_steps: int,
    *,
    window: tuple[int, int] | None = None,
    size: int = 4,
    every: int = 1,
    stride: int = 1,
    span: tuple[int, int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[int, int] | None:
    """The stochastic steps `[start, end)` of the rollouts of epoch `epoch` (0-based); the others are ODE steps.

    - `fixed`: `window` every epoch (None: every step is stochastic);
    - `progressive` (MixGRPO, arXiv:2507.21802, `sample_strategy="progressive"`): the start moves by `stride`
      every `every` epochs through `span = [lo, hi)` and wraps back to `lo`; the window is
      `[start, min(start + size, hi))` (MixGRPO: size 4, every 25 iterations, stride 1, span `[0, T - 2)`);
      `stride=0` freezes it at `lo` (MixGRPO-Flash*);
    - `random` (Flow-GRPO-Fast, `train_sd3_fast.py`): a start drawn uniformly from `[lo, hi - size]` each epoch
      with `generator` (seed it by the epoch, the same on every process), the window `[start, start + size)`
      (Flow-GRPO-Fast: size 3, span `[0, T // 2)`).

    `span` defaults to `[0, T - 1)`: the last step, which Flow-GRPO's 0.99 fraction never trains, stays ODE.
    """
    if schedule not in SDE_WINDOW_SCHEDULES:
        from flowrl.registry import unknown_name_error

        raise unknown_name_error("sde window schedule", schedule, list(SDE_WINDOW_SCHEDULES))
    if schedule == "fixed":
        return window
    lo, hi = span if span is not None else (0, max(num_steps - 1, 1))
    if not 0 <= lo < hi <= num_steps:
        raise ValueError(f"window span must satisfy 0 <= lo < hi <= num_steps={num_steps}, got {(lo, hi)}")
    if size < 1 or every < 1 or stride < 0:
        raise ValueError(f"need window size >= 1, every >= 1 and stride >= 0, got {size}, {every}, {stride}")
    if schedule == "progressive":
        starts = [lo] if stride == 0 else list(range(lo, hi, stride))
        start = starts[(epoch // every) % len(starts)]
        return start, min(start + size, hi)
    if hi - lo < size:
        raise ValueError(f"a random window of size {size} does not fit in the span {(lo, hi)}")
    start = lo + int(torch.randint(hi - lo - size + 1, (1,), generator=generator))
    return start, start + size


def steps_to_mask(indices: torch.Tensor, num_steps: int) -> torch.Tensor:
    """Boolean `[B, T]` mask with the selected steps set."""
    mask = torch.zeros(indices.shape[0], num_steps, dtype=torch.bool, device=indices.device)
    return mask.scatter_(1, indices, True)


def _dt(sigmas: torch.Tensor) -> torch.Tensor:
    return (sigmas[..., 1:] - sigmas[..., :-1]).abs()


@STEP_WEIGHTINGS.register("uniform")
def weight_uniform(sigmas: torch.Tensor) -> torch.Tensor:
    """Every step weighs 1 (Flow-GRPO, DDPO)."""
    return torch.ones_like(sigmas[..., :-1])


@STEP_WEIGHTINGS.register("inv_dt")
def weight_inv_dt(sigmas: torch.Tensor) -> torch.Tensor:
    """1 / |dt|, removing the step-size factor from the step's gradient (GRPO-Guard, arXiv:2510.22319 sec. 3.2)."""
    dt = _dt(sigmas)
    if (dt == 0).any():
        raise ValueError("inv_dt weighting needs strictly monotone sigmas (a step has dt = 0)")
    return 1.0 / dt


def _snr(sigmas: torch.Tensor) -> torch.Tensor:
    """SNR `((1 - s) / s)^2` of `x_s = (1 - s) x0 + s eps` at each step's start."""
    s = sigmas[..., :-1].clamp(1e-6, 1.0)  # clamp: s = 0 has infinite SNR, which min(., gamma) caps anyway
    return ((1 - s) / s) ** 2


@STEP_WEIGHTINGS.register("min_snr")
def weight_min_snr(sigmas: torch.Tensor, *, gamma: float = 5.0) -> torch.Tensor:
    """Min-SNR, epsilon form: `min(SNR, gamma) / SNR` (Hang et al. 2023, arXiv:2303.09556, eq. 8 for eps-prediction).

    1 on every step whose SNR is at most gamma (all noisy steps, the first at s = 1 included), `gamma / SNR`
    on low-noise steps: it only tempers the late steps. This is the form for flow matching (see
    docs/core.md): the velocity-type form below vanishes at pure noise.
    """
    snr = _snr(sigmas)
    # SNR = 0 (s = 1): min(SNR, gamma) / SNR -> 1, its limit
    return torch.where(snr <= gamma, torch.ones_like(snr), gamma / snr.clamp_min(1e-12))


@STEP_WEIGHTINGS.register("min_snr_v")
def weight_min_snr_v(sigmas: torch.Tensor, *, gamma: float = 5.0) -> torch.Tensor:
    """Min-SNR, v-prediction form: `min(SNR, gamma) / (SNR + 1)` (arXiv:2303.09556, sec. 3.4); 0 at s = 1."""
    snr = _snr(sigmas)
    return snr.clamp(max=gamma) / (snr + 1)


@STEP_WEIGHTINGS.register("sigma")
def weight_sigma(sigmas: torch.Tensor) -> torch.Tensor:
    """The step's starting noise level s: emphasises early, high-noise steps."""
    return sigmas[..., :-1].clone()


@STEP_WEIGHTINGS.register("noise_aware")
def weight_noise_aware(sigmas: torch.Tensor) -> torch.Tensor:
    """The flow-SDE step's noise `sqrt(t / (1 - t)) sqrt(t - t')` (its std at a = 1; at t = 1 the denominator uses
    the next level, as Flow-GRPO's kernel): TempFlow-GRPO's noise-aware weight (arXiv:2508.04324 eq. 7), which
    its code scales to mean 1 over the trained steps (`normalize_weights`)."""
    t, t_next = sigmas[..., :-1], sigmas[..., 1:]
    # t = 1 would divide by zero: the kernel's own guard replaces 1 - t by 1 - t_next there
    denominator = 1 - torch.where(t >= 1, t_next, t)
    return torch.sqrt(t / denominator.clamp_min(1e-12)) * torch.sqrt((t - t_next).clamp_min(0))


@STEP_WEIGHTINGS.register("inv_noise_aware")
def weight_inv_noise_aware(sigmas: torch.Tensor) -> torch.Tensor:
    """1 / `noise_aware`: one over the flow-SDE step's std at a = 1. GRPO-Guard's RatioNorm multiplies each step's
    log-ratio by its std `s`, which reweights the step's gradient by `s`; this weighting undoes that, so GRPO-Guard
    trains every step at Flow-GRPO's gradient scale (the ablation of docs/studies.md, study 2)."""
    noise = weight_noise_aware(sigmas)
    if (noise <= 0).any():
        raise ValueError("inv_noise_aware weighting needs every step to have noise (a step has std 0)")
    return 1.0 / noise


@STEP_WEIGHTINGS.register("early")
def weight_early(sigmas: torch.Tensor, *, boundary: float = 0.5) -> torch.Tensor:
    """1 on the steps that start at noise level s >= `boundary` (the layout-forming, high-noise steps), 0 after."""
    return (sigmas[..., :-1] >= boundary).to(sigmas.dtype)


@STEP_WEIGHTINGS.register("late")
def weight_late(sigmas: torch.Tensor, *, boundary: float = 0.5) -> torch.Tensor:
    """1 on the steps that start below noise level `boundary` (the detail-forming, low-noise steps), 0 before."""
    return (sigmas[..., :-1] < boundary).to(sigmas.dtype)


def step_weights(
    name: str | Callable[[torch.Tensor], torch.Tensor],
    sigmas: torch.Tensor,
    *,
    normalize: bool = False,
    **kwargs,
) -> torch.Tensor:
    """Per-step weights `[T]` (or `[B, T]` for per-sample `sigmas[B, T + 1]`).

    Args:
        name (`str` or `Callable`): a registered weighting (`uniform`, `inv_dt`, `min_snr`, `min_snr_v`, `sigma`,
            `noise_aware`, `early`, `late`), a `package.module:function` path, or a function
            `sigmas -> weights[T]`.
        sigmas (`torch.Tensor`): the sampler's noise levels `[T + 1]`, from 1 (noise) towards 0.
        normalize (`bool`, defaults to `False`): rescale to mean 1 over the steps, so switching weightings
            does not change the effective learning rate.
    """
    sigmas = sigmas.to(torch.float64 if sigmas.dtype == torch.float64 else torch.float32)
    if sigmas.shape[-1] < 2:
        raise ValueError(f"sigmas needs T + 1 >= 2 entries, got shape {tuple(sigmas.shape)}")
    if isinstance(name, str) and ":" in name:
        name = STEP_WEIGHTINGS.resolve(name)
    if callable(name):
        weights = torch.as_tensor(name(sigmas, **kwargs), dtype=sigmas.dtype)
        label = getattr(name, "__name__", "user weighting")
    else:
        fn = STEP_WEIGHTINGS.get(name)
        check_kwargs("step weighting", name, kwargs, fn)
        weights, label = fn(sigmas, **kwargs), name
    if weights.shape != sigmas[..., :-1].shape:
        raise ValueError(f"{label} returned shape {tuple(weights.shape)}, expected {tuple(sigmas[..., :-1].shape)}")
    if not torch.isfinite(weights).all() or (weights < 0).any():
        raise ValueError(f"{label} returned negative or non-finite weights: {weights.tolist()}")
    if normalize:
        weights = weights / weights.mean(dim=-1, keepdim=True).clamp_min(1e-12)
    return weights
