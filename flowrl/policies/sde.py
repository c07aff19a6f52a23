"""One denoising step with its Gaussian log-probability: the action of an image policy.

Flow-matching convention of SD3 / Flux / Flow-GRPO: `x_s = (1 - s) x0 + s eps`, `s = 1` is pure noise, the
model predicts the velocity `v ~ eps - x0`, sampling runs `s -> s' < s`, so `dt = s' - s < 0`.

Every kernel returns `StepOutput(prev_sample, log_prob, mean, std)`:

- `mean`, `std`: the Gaussian `N(mean, std^2 I)` the next state is drawn from (fp32; `mean` carries the
  gradient of `model_output`);
- `prev_sample`: the next state, drawn from that Gaussian, or the given `prev_sample` **re-scored, not
  re-drawn**; returned in `sample`'s dtype (the storage dtype), and the log-prob is computed on that stored
  value, so re-scoring a stored transition reproduces the rollout's log-prob exactly;
- `log_prob`: `[B]`, the Gaussian log-density reduced over each sample's latent elements with `reduce`
  (`"mean"`, the convention of every image RL codebase, makes the ratio the true ratio to the power 1/D, which
  is why image clip ranges are 1e-4 ... 2e-6; `"sum"` is the true log-density); `cps` returns Flow-GRPO's
  `-red (x' - mu)^2` instead (`cps_gaussian` the density). Deterministic steps (`ode`, DDIM with eta 0, CPS at
  s' = 0) have no density: their `log_prob` is 0 and `std` is 0.

All math runs in fp32 (`model_output` and `sample` may be bf16/fp16; fp64 inputs stay fp64).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from flowrl.core.ratios import compute_dtype, reduce_elements
from flowrl.registry import Registry


SAMPLERS: Registry = Registry("sampler")
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class StepOutput(NamedTuple):
    """Result of one step.

    Attributes:
        prev_sample (`torch.Tensor`): `[B, ...]` next state, in the dtype of `sample`.
        log_prob (`torch.Tensor`): `[B]` fp32 log-density of `prev_sample` (0 for deterministic steps).
        mean (`torch.Tensor`): `[B, ...]` fp32 mean of the step's Gaussian.
        std (`torch.Tensor`): `[B]` fp32 standard deviation (0 for deterministic steps).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def _per_sample(value, like: torch.Tensor) -> torch.Tensor:
    """A scalar or `[B]` value as a tensor `[B, 1, ..., 1]` of `like`'s dtype, broadcastable against it."""
    value = torch.as_tensor(value).to(like.device, like.dtype, non_blocking=True)  # host values: no stream sync
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    if value.shape != like.shape[:1]:
        raise ValueError(f"expected a scalar or [B]={like.shape[0]} values, got shape {tuple(value.shape)}")
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def _upcast(model_output: torch.Tensor, sample: torch.Tensor):
    dtype = compute_dtype(model_output, sample)
    return model_output.to(dtype), sample.to(dtype)


def _finish(
    mean,
    std,
    sample,
    prev_sample,
    noise,
    generator,
    reduce,
    log_prob: str = "gaussian",
    deterministic: bool | None = None,
) -> StepOutput:
    """Draw (or take) the next state, round-trip it through the storage dtype, and score it.

    `deterministic`: whether every row's std is 0 when the kernel knows it (`ode`, DDIM with eta 0); otherwise it is
    read from `std` only where that costs no device sync (a CPU tensor). On a device a zero-std row is handled row by
    row: its next state is its mean (`mu + 0 z`) and its log-prob 0, so no step reads a device value on the host.
    """
    std_b = std.reshape(-1)  # [B]
    if deterministic is None and std_b.device.type == "cpu":
        deterministic = bool((std_b == 0).all())  # host values: no device sync
    if prev_sample is None:
        if deterministic:
            prev_sample = mean
        else:
            if noise is None:
                from diffusers.utils.torch_utils import randn_tensor  # here: importing diffusers costs 2 s

                noise = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
            prev_sample = torch.addcmul(mean, std, noise.to(mean.dtype))  # mu + std * z
        prev_sample = prev_sample.to(sample.dtype)  # the value that is stored is the value that is scored
    if deterministic:
        return StepOutput(prev_sample, torch.zeros_like(std_b), mean, std_b)
    # std is constant over a sample's elements, so reduce the squared error first:
    # red_d[-(x - mu)^2 / (2 s^2) - log s - log(2 pi)/2] = -red_d (x - mu)^2 / (2 s^2) - red_d 1 (log s + log(2 pi)/2)
    sq_err = reduce_elements((prev_sample.detach().to(mean.dtype) - mean).square(), reduce)  # [B]
    if log_prob == "mse":  # Flow-GRPO's CPS code: -red (x' - mu)^2, the Gaussian's log-ratio times 2 std^2
        return StepOutput(prev_sample, -sq_err, mean, std_b)
    count = 1.0 if reduce == "mean" else float(mean[0].numel())
    positive = std_b > 0  # [B]
    safe = torch.where(positive, std_b, torch.ones_like(std_b))  # a zero-std row has no density (and no 0/0 gradient)
    log_prob = -sq_err / (2 * safe**2) - count * (torch.log(safe) + _HALF_LOG_2PI)  # [B]
    return StepOutput(prev_sample, torch.where(positive, log_prob, torch.zeros_like(log_prob)), mean, std_b)


def _flow_drift_mean(v, x, sigma, dt, diffusion):
    """Euler-Maruyama mean of the marginal-preserving reverse SDE with diffusion coefficient `g`.

    `mu = x + dt [v + g^2 / (2 s) (x + (1 - s) v)]`: the drift `v - (g^2/2) score` with the rectified-flow
    score `-(x + (1 - s) v) / s` (Flow-GRPO, arXiv:2505.05470; DanceGRPO uses the same drift).
    """
    x_coef = 1 + diffusion**2 / (2 * sigma) * dt  # [B, 1, ...]: per-sample scalars, cheap
    v_coef = (1 + diffusion**2 * (1 - sigma) / (2 * sigma)) * dt
    return torch.addcmul(x * x_coef, v, v_coef)


@SAMPLERS.register("flow_sde")
def flow_sde_step(
    model_output,
    sigma,
    sigma_next,
    sample,
    *,
    prev_sample=None,
    noise_level=0.7,
    generator=None,
    noise=None,
    reduce="mean",
    sigma_max=None,
):
    """Flow-GRPO SDE: diffusion `g = a sqrt(s / (1 - s))`, step std `g sqrt(|dt|)` (arXiv:2505.05470).

    At `s = 1` the coefficient is infinite; like Flow-GRPO, `s` in the denominator `1 - s` is replaced by
    `sigma_max` there (Flow-GRPO passes the schedule's second sigma). Default `sigma_max=None` uses the step's
    own `sigma_next`, which for the first step of a schedule starting at 1 is the same value.
    """
    v, x = _upcast(model_output, sample)
    s, s_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    guard = s_next if sigma_max is None else _per_sample(sigma_max, x)
    dt = s_next - s
    diffusion = noise_level * torch.sqrt(s / (1 - torch.where(s == 1, guard, s)))
    mean = _flow_drift_mean(v, x, s, dt, diffusion)
    return _finish(mean, diffusion * torch.sqrt(-dt), sample, prev_sample, noise, generator, reduce)


@SAMPLERS.register("dance_sde")
def dance_sde_step(
    model_output,
    sigma,
    sigma_next,
    sample,
    *,
    prev_sample=None,
    noise_level=0.3,
    generator=None,
    noise=None,
    reduce="mean",
    sigma_max=None,
):
    """DanceGRPO SDE: constant diffusion `g = eta` (`noise_level`), step std `eta sqrt(|dt|)` (arXiv:2505.07818)."""
    v, x = _upcast(model_output, sample)
    s, s_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    dt = s_next - s
    diffusion = torch.full_like(s, float(noise_level))
    mean = _flow_drift_mean(v, x, s, dt, diffusion)
    return _finish(mean, diffusion * torch.sqrt(-dt), sample, prev_sample, noise, generator, reduce)


@SAMPLERS.register("cps")
def cps_step(
    model_output,
    sigma,
    sigma_next,
    sample,
    *,
    prev_sample=None,
    noise_level=0.8,
    generator=None,
    noise=None,
    reduce="mean",
    sigma_max=None,
    log_prob="mse",
):
    """Coefficients-preserving sampling (Flow-GRPO's CPS): std `s' sin(a pi / 2)`.

    `mu = (1 - s') x0^ + sqrt(s'^2 - std^2) x1^`.

    `x0^ = x - s v` and `x1^ = x + (1 - s) v` are the predicted data and noise. The log-prob is Flow-GRPO's
    code form `-red_d (x' - mu)^2` (`log_prob="mse"`), whose log-ratio is the Gaussian one times `2 std^2`;
    `cps_gaussian` is the proper Gaussian density. The MSE form is the default because its per-step log-ratio
    has a far more even scale along the schedule (the Gaussian's grows as `1/std^2` at the end; docs/policies.md)
    and Flow-GRPO's CPS clip ranges are calibrated for it. At `s' = 0` the step is deterministic.
    """
    v, x = _upcast(model_output, sample)
    s, s_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    std = s_next * math.sin(noise_level * math.pi / 2)
    x0_hat, x1_hat = x - s * v, x + (1 - s) * v
    mean = (1 - s_next) * x0_hat + torch.sqrt((s_next**2 - std**2).clamp_min(0.0)) * x1_hat
    return _finish(mean, std, sample, prev_sample, noise, generator, reduce, log_prob)


@SAMPLERS.register("cps_gaussian")
def cps_gaussian_step(
    model_output,
    sigma,
    sigma_next,
    sample,
    *,
    prev_sample=None,
    noise_level=0.8,
    generator=None,
    noise=None,
    reduce="mean",
    sigma_max=None,
):
    """CPS with the proper Gaussian log-density of its step (log-ratio = `cps`'s divided by `2 std^2`)."""
    return cps_step(
        model_output,
        sigma,
        sigma_next,
        sample,
        prev_sample=prev_sample,
        noise_level=noise_level,
        generator=generator,
        noise=noise,
        reduce=reduce,
        log_prob="gaussian",
    )


@SAMPLERS.register("ode")
def ode_step(
    model_output,
    sigma,
    sigma_next,
    sample,
    *,
    prev_sample=None,
    noise_level=0.0,
    generator=None,
    noise=None,
    reduce="mean",
    sigma_max=None,
):
    """Deterministic Euler step `x' = x + dt v` (the flow-matching ODE); log_prob 0 and std 0 (no density)."""
    v, x = _upcast(model_output, sample)
    s, s_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    mean = x + (s_next - s) * v
    return _finish(mean, torch.zeros_like(s), sample, prev_sample, noise, generator, reduce, deterministic=True)


def sde_step(
    kind: str,
    model_output: torch.Tensor,
    sigma,
    sigma_next,
    sample: torch.Tensor,
    *,
    prev_sample: torch.Tensor | None = None,
    noise_level: float = 0.7,
    generator: torch.Generator | None = None,
    reduce: str = "mean",
    sigma_max=None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """One flow-matching step of kind `flow_sde`, `dance_sde`, `cps`, `cps_gaussian` or `ode` (see the module doc).

    Args:
        kind (`str`): the step kernel.
        model_output (`torch.Tensor`): velocity prediction `[B, ...]` (after CFG).
        sigma, sigma_next (`float` or `torch.Tensor`): noise level now and after the step (scalars or `[B]`).
        sample (`torch.Tensor`): current state `[B, ...]`.
        prev_sample (`torch.Tensor`, *optional*): a stored next state to re-score instead of drawing one.
        noise_level (`float`, defaults to 0.7): `a` of `flow_sde` (Flow-GRPO 0.7; Flux 0.9), `eta` of
            `dance_sde` (0.3), `a` of `cps` (0.8); ignored by `ode`.
        generator (`torch.Generator`, *optional*): for the Gaussian noise.
        reduce (`str`, defaults to `"mean"`): how the log-density is reduced over latent elements.
        sigma_max (*optional*): `flow_sde`'s stand-in for `s` in `1 - s` where `s = 1` (default: `sigma_next`).
        noise (`torch.Tensor`, *optional*): pre-drawn standard normal noise `[B, ...]` (instead of `generator`).
    """
    fn = SAMPLERS.get(kind)
    if kind == "ddim":
        raise ValueError("the 'ddim' sampler works on UNet schedulers: call flowrl.policies.sde.ddim_step")
    return fn(
        model_output,
        sigma,
        sigma_next,
        sample,
        prev_sample=prev_sample,
        noise_level=noise_level,
        generator=generator,
        noise=noise,
        reduce=reduce,
        sigma_max=sigma_max,
    )


def _alphas(scheduler, timestep, like, num_steps: int | None = None):
    """`alpha_bar_t` and `alpha_bar_prev` as `[B, 1, ...]` (`final_alpha_cumprod` before timestep 0) for a schedule
    of `num_steps` steps (default: the scheduler's `set_timesteps`)."""
    t = torch.as_tensor(timestep, device="cpu").long().reshape(-1)
    num_steps = num_steps or scheduler.num_inference_steps
    if not num_steps:
        raise ValueError("ddim_step needs the schedule's length: pass num_steps or call scheduler.set_timesteps")
    prev = t - scheduler.config.num_train_timesteps // num_steps
    alphas = scheduler.alphas_cumprod.to(like.dtype)
    alpha_t = alphas[t]
    alpha_prev = torch.where(prev >= 0, alphas[prev.clamp_min(0)], torch.as_tensor(scheduler.final_alpha_cumprod))
    if t.numel() == 1:
        alpha_t, alpha_prev = alpha_t.expand(like.shape[0]), alpha_prev.expand(like.shape[0])
    return _per_sample(alpha_t, like), _per_sample(alpha_prev, like)


def ddim_step(
    scheduler,
    model_output: torch.Tensor,
    timestep,
    sample: torch.Tensor,
    *,
    eta: float = 1.0,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    reduce: str = "mean",
    num_steps: int | None = None,
) -> StepOutput:
    """A DDIM step with its log-probability (DDPO, arXiv:2305.13301; Song et al. 2021 eq. 12).

    `x0^` from the prediction (`epsilon`, `sample` or `v_prediction`, per `scheduler.config.prediction_type`),
    `std = eta sqrt((1 - a_prev) / (1 - a_t) (1 - a_t / a_prev))`,
    `mu = sqrt(a_prev) x0^ + sqrt(1 - a_prev - std^2) eps^`. With eta = 0 this is exactly `DDIMScheduler.step`;
    eta = 1 gives DDPM's variance (DDPO's sampler). Like the scheduler, the step after the last uses
    `final_alpha_cumprod` (DDPO's code clamps the index to 0 instead).

    Args:
        scheduler (`diffusers.DDIMScheduler`): after `set_timesteps`, or give `num_steps`.
        timestep (`int` or `torch.Tensor`): the current timestep (or `[B]` per sample).
        num_steps (`int`, *optional*): the schedule's number of steps (a re-score on a fresh scheduler).
    """
    if scheduler.config.get("thresholding", False):
        raise ValueError("ddim_step does not support dynamic thresholding; set thresholding=False")
    e, x = _upcast(model_output, sample)
    alpha_t, alpha_prev = _alphas(scheduler, timestep, x, num_steps)
    beta_t = 1 - alpha_t
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        x0_hat, eps_hat = (x - beta_t.sqrt() * e) / alpha_t.sqrt(), e
    elif kind == "sample":
        x0_hat, eps_hat = e, (x - alpha_t.sqrt() * e) / beta_t.sqrt()
    elif kind == "v_prediction":
        x0_hat, eps_hat = alpha_t.sqrt() * x - beta_t.sqrt() * e, alpha_t.sqrt() * e + beta_t.sqrt() * x
    else:
        raise ValueError(f"prediction_type must be epsilon, sample or v_prediction, got {kind!r}")
    if scheduler.config.get("clip_sample", False):
        limit = scheduler.config.clip_sample_range
        x0_hat = x0_hat.clamp(-limit, limit)
    variance = (1 - alpha_prev) / (1 - alpha_t) * (1 - alpha_t / alpha_prev)
    std = eta * variance.sqrt()
    mean = alpha_prev.sqrt() * x0_hat + (1 - alpha_prev - std**2).clamp_min(0.0).sqrt() * eps_hat
    deterministic = True if isinstance(eta, (int, float)) and eta == 0 else None
    return _finish(mean, std, sample, prev_sample, noise, generator, reduce, deterministic=deterministic)


SAMPLERS.register("ddim", ddim_step)


def dpm_solver_2m_step(
    model_output: torch.Tensor,
    sigma: float,
    sigma_next: float,
    sample: torch.Tensor,
    *,
    x0_prev: torch.Tensor | None = None,
    sigma_prev: float | None = None,
) -> StepOutput:
    """A deterministic multistep DPM-Solver++(2M) step (midpoint form) in the flow convention: no density.

    Lu et al. 2022 (arXiv:2211.01095, Alg. 2), as MixGRPO-Flash integrates the steps after its SDE window
    (Tencent-Hunyuan/MixGRPO `sampling_utils.py::multistep_dpm_solver_second_order_update`). With `alpha = 1 - s`,
    `lambda = log(alpha / s)`, the data predictions `D0 = x - s v` (now) and `x0_prev` (at `sigma_prev`, the grid
    point before `sigma`), `h = lambda' - lambda`, `r = (lambda - lambda_prev) / h`:

        x' = (s' / s) x - alpha' (e^-h - 1) [D0 + (D0 - x0_prev) / (2 r)]

    First order (DDIM in data prediction) without a previous prediction, when `sigma_prev` is pure noise, and at
    `s' = 0`, where `x' = D0` (the solvers' `lower_order_final`). `sigma` must be < 1 (`alpha > 0`).
    """
    v, x = _upcast(model_output, sample)
    s, s_next = float(sigma), float(sigma_next)
    if not 0 <= s_next < s < 1:
        raise ValueError(f"a DPM-Solver++ step needs 0 <= sigma_next < sigma < 1, got {s_next} -> {s}")
    d0 = x - s * v  # [B, ...] the data prediction
    if s_next == 0:
        mean = d0
    else:
        lam = math.log((1 - s) / s)
        h = math.log((1 - s_next) / s_next) - lam
        mean = (s_next / s) * x - (1 - s_next) * math.expm1(-h) * d0
        if x0_prev is not None and sigma_prev is not None and float(sigma_prev) < 1:
            sp = float(sigma_prev)
            r = (lam - math.log((1 - sp) / sp)) / h
            mean = mean - (1 - s_next) * math.expm1(-h) / (2 * r) * (d0 - x0_prev.to(d0.dtype))
    zero = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    return _finish(mean, zero, sample, None, None, None, "mean", deterministic=True)
