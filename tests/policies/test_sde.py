import math

import pytest
import torch
from diffusers import DDIMScheduler

from flowrl.policies import SAMPLERS, ddim_step, sde_step


KINDS = ["flow_sde", "dance_sde", "cps_gaussian"]


def _inputs(seed=0, b=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 4, 5, 5, generator=g), torch.randn(b, 4, 5, 5, generator=g), g


@pytest.mark.parametrize("kind", KINDS)
def test_log_prob_matches_torch_normal(kind):
    v, x, g = _inputs()
    out = sde_step(kind, v, 0.6, 0.45, x, noise_level=0.7, generator=g)
    for b in range(3):
        ref = torch.distributions.Normal(out.mean[b], out.std[b]).log_prob(out.prev_sample[b].float()).mean()
        assert out.log_prob[b].item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-5)
    total = sde_step(kind, v, 0.6, 0.45, x, prev_sample=out.prev_sample, noise_level=0.7, reduce="sum")
    # sum = mean * D: the 1/D that shrinks image clip ranges
    torch.testing.assert_close(total.log_prob, out.log_prob * 100, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_given_prev_sample_is_rescored_not_redrawn(kind):
    v, x, g = _inputs()
    first = sde_step(kind, v, 0.6, 0.45, x, noise_level=0.7, generator=g)
    again = sde_step(kind, v, 0.6, 0.45, x, prev_sample=first.prev_sample, noise_level=0.7, generator=g)
    assert torch.equal(again.prev_sample, first.prev_sample)
    assert torch.equal(again.log_prob, first.log_prob)


def test_flow_sde_matches_flow_grpo_formula_by_hand():
    # s = 0.6, s' = 0.45, a = 0.7: sigma_t = 0.7 sqrt(0.6 / 0.4) = 0.857321, dt = -0.15,
    # mu = x (1 + sigma_t^2 dt / (2 s)) + v (1 + sigma_t^2 (1 - s) / (2 s)) dt, std = sigma_t sqrt(0.15)
    v, x = torch.full((1, 1), 2.0), torch.full((1, 1), 0.5)
    out = sde_step("flow_sde", v, 0.6, 0.45, x, noise_level=0.7, noise=torch.zeros(1, 1))
    sigma_t = 0.7 * math.sqrt(0.6 / 0.4)
    mean = 0.5 * (1 + sigma_t**2 * -0.15 / 1.2) + 2.0 * (1 + sigma_t**2 * 0.4 / 1.2) * -0.15
    assert out.mean.item() == pytest.approx(mean, abs=1e-6)  # fp32 math
    assert out.std.item() == pytest.approx(sigma_t * math.sqrt(0.15), rel=1e-6)
    assert out.prev_sample.item() == pytest.approx(mean, abs=1e-6)  # zero noise: the mean
    # with a = 0 the mean is the Euler ODE step x + dt v
    ode = sde_step("ode", v, 0.6, 0.45, x)
    assert ode.prev_sample.item() == pytest.approx(0.5 - 0.15 * 2.0)
    assert ode.log_prob.item() == 0 and ode.std.item() == 0


def test_flow_sde_sigma_one_guard():
    # at s = 1, 1 - s is replaced by 1 - sigma_max (Flow-GRPO passes the schedule's second sigma)
    v, x = torch.zeros(1, 1), torch.ones(1, 1)
    out = sde_step("flow_sde", v, 1.0, 0.9, x, noise_level=0.7, sigma_max=0.8, noise=torch.zeros(1, 1))
    assert out.std.item() == pytest.approx(0.7 * math.sqrt(1 / 0.2) * math.sqrt(0.1), rel=1e-6)
    default = sde_step("flow_sde", v, 1.0, 0.9, x, noise_level=0.7, noise=torch.zeros(1, 1))
    assert default.std.item() == pytest.approx(0.7 * math.sqrt(1 / 0.1) * math.sqrt(0.1), rel=1e-6)
    assert torch.isfinite(default.log_prob).all()


def test_dance_sde_is_flow_drift_with_constant_diffusion():
    v, x, _ = _inputs()
    dance = sde_step("dance_sde", v, 0.6, 0.45, x, noise_level=0.3, noise=torch.zeros_like(x))
    # DanceGRPO's form: mu = x + ds v + ds (eta^2 / 2) (x - (1 - s) x0^) / s^2 with x0^ = x - s v
    ds, s, eta = -0.15, 0.6, 0.3
    x0_hat = x - s * v
    torch.testing.assert_close(dance.mean, x + ds * v + ds * eta**2 / 2 * (x - (1 - s) * x0_hat) / s**2)
    assert dance.std[0].item() == pytest.approx(0.3 * math.sqrt(0.15))


def test_cps_last_step_is_deterministic():
    v, x, _ = _inputs()
    out = sde_step("cps", v, 0.2, 0.0, x, noise_level=0.8)
    torch.testing.assert_close(out.prev_sample, x - 0.2 * v)  # s' = 0: the predicted x0
    assert torch.all(out.log_prob == 0)


def test_low_precision_inputs_round_trip_through_storage_dtype():
    v, x, g = _inputs()
    out = sde_step("flow_sde", v.bfloat16(), 0.6, 0.45, x.bfloat16(), generator=g)
    assert out.prev_sample.dtype == torch.bfloat16 and out.log_prob.dtype == torch.float32
    again = sde_step("flow_sde", v.bfloat16(), 0.6, 0.45, x.bfloat16(), prev_sample=out.prev_sample)
    assert torch.equal(again.log_prob, out.log_prob)  # the stored value is the scored value


def test_per_sample_sigmas_equal_scalar_sigmas():
    v, x, g = _inputs()
    scalar = sde_step("flow_sde", v, 0.6, 0.45, x, noise=torch.zeros_like(x))
    vector = sde_step("flow_sde", v, torch.full((3,), 0.6), torch.full((3,), 0.45), x, noise=torch.zeros_like(x))
    assert torch.equal(scalar.mean, vector.mean) and torch.equal(scalar.log_prob, vector.log_prob)
    with pytest.raises(ValueError, match=r"scalar or \[B\]"):
        sde_step("flow_sde", v, torch.full((2,), 0.6), 0.45, x)
    with pytest.raises(ValueError, match="unknown sampler"):
        sde_step("euler", v, 0.6, 0.45, x)


def _gaussian_flow_velocity(x, s, m, s0):
    """Exact velocity E[eps - x0 | x_s = x] for data N(m, s0^2) and x_s = (1 - s) x0 + s eps."""
    a = 1 - s
    var = a**2 * s0**2 + s**2
    x0 = m + a * s0**2 * (x - a * m) / var
    eps = s * (x - a * m) / var
    return eps - x0


@pytest.mark.parametrize("kind, noise_level", [("ode", 0.0), ("flow_sde", 0.7), ("dance_sde", 0.5)])
def test_samplers_preserve_the_marginals_of_an_analytic_flow(kind, noise_level):
    # data N(2, 0.5^2); noise N(0, 1); 200 shifted steps from s = 1 to 0; 20000 chains
    m, s0, n = 2.0, 0.5, 20000
    g = torch.Generator().manual_seed(0)
    sigmas = torch.linspace(1, 0, 201, dtype=torch.float64)
    x = torch.randn(n, 1, generator=g, dtype=torch.float64)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        v = _gaussian_flow_velocity(x, s, m, s0)
        x = sde_step(kind, v, s, s_next, x, noise_level=noise_level, generator=g, sigma_max=sigmas[1]).prev_sample
        x = x.to(torch.float64)
    assert x.mean().item() == pytest.approx(m, abs=0.02)
    assert x.std().item() == pytest.approx(s0, abs=0.02)


def test_cps_preserves_the_noise_coefficient():
    # CPS keeps x_s = (1 - s) x0^ + s * (unit noise) exactly when x0^ is right; with a point-mass data
    # distribution the prediction is exact, so every intermediate state is N((1 - s) m, s^2)
    m, n = 1.5, 20000
    g = torch.Generator().manual_seed(1)
    sigmas = torch.linspace(1, 0, 11, dtype=torch.float64)
    x = torch.randn(n, 1, generator=g, dtype=torch.float64)
    for i, (s, s_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        v = (x - (1 - s) * m) / s - m  # eps - x0 for x0 = m
        x = sde_step("cps", v, s, s_next, x, noise_level=0.8, generator=g).prev_sample
        if i == 4:
            assert x.mean().item() == pytest.approx((1 - s_next.item()) * m, abs=0.02)
            assert x.std().item() == pytest.approx(s_next.item(), abs=0.02)
    assert torch.allclose(x, torch.full_like(x, m))


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_ddim_eta_zero_reproduces_the_scheduler(prediction_type):
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type=prediction_type,
        clip_sample=False,
        set_alpha_to_one=False,
    )
    scheduler.set_timesteps(10)
    v, x, g = _inputs()
    for t in scheduler.timesteps:
        ours = ddim_step(scheduler, v, t, x, eta=0.0)
        ref = scheduler.step(v, t, x, eta=0.0).prev_sample
        torch.testing.assert_close(ours.prev_sample, ref, rtol=1e-5, atol=1e-5)
        assert torch.all(ours.log_prob == 0)


def test_ddim_with_eta_is_a_gaussian_with_ddpm_variance():
    scheduler = DDIMScheduler(clip_sample=False)
    scheduler.set_timesteps(10)
    v, x, g = _inputs()
    t = scheduler.timesteps[3]
    out = ddim_step(scheduler, v, t, x, eta=1.0, generator=g)
    a_t = scheduler.alphas_cumprod[t]
    a_prev = scheduler.alphas_cumprod[t - 100]
    variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    assert out.std[0].item() == pytest.approx(variance.sqrt().item(), rel=1e-5)
    ref = torch.distributions.Normal(out.mean[0], out.std[0]).log_prob(out.prev_sample[0]).mean()
    assert out.log_prob[0].item() == pytest.approx(ref.item(), rel=1e-5)
    again = ddim_step(scheduler, v, torch.full((3,), int(t)), x, eta=1.0, prev_sample=out.prev_sample)
    torch.testing.assert_close(again.log_prob, out.log_prob)


def test_registry():
    assert {"flow_sde", "dance_sde", "cps", "cps_gaussian", "ode", "ddim"} <= set(SAMPLERS.names())


def test_cps_mean_matches_flow_grpos_published_formula():
    # Flow-GRPO's CPS (sd3_sde_with_logprob, sde_type "cps"), written out independently of the kernel:
    # std = s' sin(a pi/2), x0^ = x - s v, eps^ = x + v (1 - s), mu = x0^ (1 - s') + eps^ sqrt(s'^2 - std^2)
    v, x, _ = _inputs(4)
    s, s_next, a = 0.7, 0.55, 0.8
    std = s_next * math.sin(a * math.pi / 2)
    mean = (x - s * v) * (1 - s_next) + (x + v * (1 - s)) * math.sqrt(s_next**2 - std**2)
    out = sde_step("cps", v, s, s_next, x, noise_level=a, noise=torch.zeros_like(x))
    torch.testing.assert_close(out.mean, mean, rtol=1e-6, atol=1e-6)
    assert out.std[0].item() == pytest.approx(std, rel=1e-6)


def test_cps_log_prob_is_flow_grpos_code_form():
    # -mean (x' - mu)^2: its log-ratio is the Gaussian one times 2 std^2, the factor that differs per step
    v, x, g = _inputs(5)
    new_v = v + 0.05 * torch.randn(v.shape, generator=g)
    first = sde_step("cps_gaussian", v, 0.7, 0.55, x, noise_level=0.8, generator=g)
    mse = sde_step("cps", v, 0.7, 0.55, x, prev_sample=first.prev_sample, noise_level=0.8)
    expected = -(first.prev_sample - first.mean).square().flatten(1).mean(1)
    torch.testing.assert_close(mse.log_prob, expected, rtol=1e-6, atol=1e-7)
    moved = {
        k: sde_step(k, new_v, 0.7, 0.55, x, prev_sample=first.prev_sample, noise_level=0.8)
        for k in ("cps", "cps_gaussian")
    }
    gaussian_ratio = moved["cps_gaussian"].log_prob - first.log_prob
    mse_ratio = moved["cps"].log_prob - mse.log_prob
    std = first.std[0]
    torch.testing.assert_close(mse_ratio, gaussian_ratio * 2 * std**2, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_ddim_mean_with_eta_matches_the_scheduler_with_zero_noise(prediction_type):
    # diffusers' DDIMScheduler.step draws x' = mu + std z; with z = 0 it returns the published DDIM mean (eq. 12)
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type=prediction_type,
        clip_sample=False,
        set_alpha_to_one=False,
    )
    scheduler.set_timesteps(10)
    v, x, _ = _inputs(6)
    for eta in (0.5, 1.0):
        for t in scheduler.timesteps:
            ours = ddim_step(scheduler, v, t, x, eta=eta)
            ref = scheduler.step(v, t, x, eta=eta, variance_noise=torch.zeros_like(x)).prev_sample
            torch.testing.assert_close(ours.mean, ref, rtol=1e-5, atol=1e-5)


def test_dpm_solver_2m_step_by_hand():
    # x = 1, v = 0.5 at s = 0.5 -> s' = 0.25; D0 = x - s v = 0.75; lambda = log((1 - s) / s): 0, log 3, -log 3
    # h = log 3, e^-h = 1/3, alpha' = 0.75. First order: (s'/s) x - alpha' (e^-h - 1) D0 = 0.5 + 0.375 = 0.875.
    # With x0_prev = 0.2 at s_prev = 0.75: r = (0 + log 3) / log 3 = 1, correction -alpha' (e^-h - 1) / 2 (D0 - 0.2)
    # = 0.25 * 0.55 = 0.1375.
    from flowrl.policies.sde import dpm_solver_2m_step

    x, v = torch.ones(1, 2), torch.full((1, 2), 0.5)
    first = dpm_solver_2m_step(v, 0.5, 0.25, x)
    torch.testing.assert_close(first.prev_sample, torch.full((1, 2), 0.875))
    second = dpm_solver_2m_step(v, 0.5, 0.25, x, x0_prev=torch.full((1, 2), 0.2), sigma_prev=0.75)
    torch.testing.assert_close(second.prev_sample, torch.full((1, 2), 1.0125))
    assert second.log_prob.eq(0).all() and second.std.eq(0).all()  # deterministic: no density
    # the last step lands on the data prediction; pure noise before has no log-SNR: first order
    torch.testing.assert_close(dpm_solver_2m_step(v, 0.5, 0.0, x, x0_prev=x, sigma_prev=0.75).prev_sample, x - 0.25)
    torch.testing.assert_close(
        dpm_solver_2m_step(v, 0.5, 0.25, x, x0_prev=x, sigma_prev=1.0).prev_sample, first.prev_sample
    )
    with pytest.raises(ValueError, match="sigma_next < sigma < 1"):
        dpm_solver_2m_step(v, 1.0, 0.5, x)


def test_dpm_solver_2m_is_exact_for_a_point_mass():
    # data = c: x_s = (1 - s) c + s eps, v = eps - c, D = c at every step; the ODE's solution is
    # x_s' = (s'/s) x + (1 - s'/s) c, which DPM-Solver++ reproduces exactly at first and second order
    from flowrl.policies.sde import dpm_solver_2m_step

    torch.manual_seed(0)
    c, eps = torch.randn(3, 4), torch.randn(3, 4)
    grid = [0.9, 0.7, 0.4, 0.15, 0.0]
    x, x0_prev, s_prev = (1 - grid[0]) * c + grid[0] * eps, None, None
    for s, s_next in zip(grid, grid[1:]):
        out = dpm_solver_2m_step(eps - c, s, s_next, x, x0_prev=x0_prev, sigma_prev=s_prev)
        torch.testing.assert_close(out.prev_sample, (1 - s_next) * c + s_next * eps, atol=1e-6, rtol=1e-5)
        x, x0_prev, s_prev = out.prev_sample, c, s
