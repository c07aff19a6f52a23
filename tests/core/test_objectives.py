import math
import zlib

import pytest
import torch

from flowrl.core import (
    AGGREGATIONS,
    OBJECTIVES,
    compute_policy_loss,
    get_objective,
    list_objectives,
    register_objective,
)
from flowrl.core.objectives import ppo_clip

from .reference_objectives import DEFAULT_AGG, REFERENCES, ref_aggregate


ALL = [
    "ppo",
    "grpo",
    "dapo",
    "dr_grpo",
    "gspo",
    "sapo",
    "cispo",
    "spo",
    "gppo",
    "clamp",
    "reinforce",
    "grpo_guard",
]


def one(name, r, a, logp=0.0, **hp):
    """Loss value and d loss / d logp for a single element with ratio r and advantage a."""
    lp = torch.tensor([[logp]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - math.log(r)
    loss, metrics = compute_policy_loss(name, lp, old, torch.tensor([a], dtype=torch.float64), **hp)
    loss.backward()
    return loss.item(), lp.grad.item(), metrics


def test_registry_lists_every_objective():
    assert set(ALL) <= set(list_objectives())
    for name in ALL:
        assert get_objective(name).agg == DEFAULT_AGG[name]
        assert OBJECTIVES.describe()[name]


def test_every_objective_module_is_imported_without_a_list():
    """`import flowrl.core` registers what every module of flowrl/core (flowrl/core/text/ too) registers: the
    modules are found by walking the package, so a new objective needs no line in a hand-kept import list."""
    import ast
    from pathlib import Path

    import flowrl.core

    written, modules = set(), set()
    for path in Path(flowrl.core.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "register_objective" and node.args:
                written.add(node.args[0].value)
                modules.add(path.relative_to(Path(flowrl.core.__file__).parent).as_posix())
    assert {"text/clipping.py", "text/sequence.py", "text/troll.py", "preference.py", "objectives.py"} <= modules
    missing = written - set(list_objectives())
    assert not missing, f"objectives written in flowrl/core but not registered by importing it: {sorted(missing)}"


# --- hand-computed cases ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "r, a, value, grad",
    [
        (1.5, 1.0, -1.2, 0.0),  # A>0, r above 1+eps: value -A(1+eps) = -1.2, clipped -> no gradient
        (0.5, 1.0, -0.5, -0.5),  # A>0, r below 1-eps: the unclipped -A r = -0.5 is the max; g = -A r
        (0.5, -1.0, 0.8, 0.0),  # A<0, r below 1-eps: -A(1-eps) = 0.8 > 0.5, clipped
        (1.5, -1.0, 1.5, 1.5),  # A<0, r above: -A r = 1.5 > 1.2, unclipped; g = -A r = 1.5
        (5.0, -1.0, 3.0, 0.0),  # A<0, r = 5 > c = 3: dual clip caps the loss at -A c = 3, no gradient
    ],
)
def test_ppo_table_with_dual_clip(r, a, value, grad):
    v, g, m = one("ppo", r, a, clip_eps_low=0.2, dual_clip_c=3.0)
    assert v == pytest.approx(value, abs=1e-12)
    assert g == pytest.approx(grad, abs=1e-12)
    # each event counted once, in its own column: the dual cap is not the lower bound
    expected = {"clipfrac_high": r > 1.2 and a > 0, "clipfrac_low": r < 0.8 and a < 0, "clipfrac_dual": r > 3}
    assert {k: bool(m[k]) for k in expected} == expected
    assert m["clipfrac"].item() == sum(expected.values())


@pytest.mark.parametrize(
    "r, a, value, grad",
    [
        (1.0, 1.0, -2.0, -1.0),  # -4 sigma(0) = -2; g = -4 * 1/4 * 1 = -1
        (2.0, 1.0, -2.9242, -1.5729),  # -4 sigma(1) = -2.92423; g = -4 s(1-s) 2 with s = 0.731059
        (5.0, 1.0, -3.9281, -0.3533),
        (0.5, 1.0, -1.5102, -0.4700),
        (1.0, -1.0, 1.9048, 1.0),  # tau_neg = 1.05: (4/1.05) / 2 = 1.90476
        (2.0, -1.0, 2.8220, 1.5362),
    ],
)
def test_sapo_table(r, a, value, grad):
    v, g, _ = one("sapo", r, a)
    assert v == pytest.approx(value, abs=1e-4)
    assert g == pytest.approx(grad, abs=1e-4)


def test_gppo_and_ce_gppo_hand_values():
    # A>0, r = 1.5 > 1.28: value -1.28 like PPO, but the gradient -A (1 + eps_h) = -1.28 survives
    v, g, _ = one("gppo", 1.5, 1.0)
    assert (v, g) == pytest.approx((-1.28, -1.28))
    # A<0, r = 0.5 < 0.8: value -A (1 - eps_l) = 0.8, gradient 0.8 (PPO: 0)
    v, g, _ = one("gppo", 0.5, -1.0)
    assert (v, g) == pytest.approx((0.8, 0.8))
    # CE-GPPO beta_low = 0.5 scales value and gradient of that region: 0.5 * 0.8 = 0.4
    v, g, _ = one("gppo", 0.5, -1.0, beta_low=0.5)
    assert (v, g) == pytest.approx((0.4, 0.4))
    # inside the band: plain -A r
    v, g, _ = one("gppo", 1.1, 1.0)
    assert (v, g) == pytest.approx((-1.1, -1.1))


def test_cispo_hand_values():
    # r = 2 is truncated to 1.2; the weight is a constant so g = -A * 1.2 and the value is -1.2 A logp
    v, g, m = one("cispo", 2.0, 1.0, logp=-0.7, clip_eps_high=0.2)
    assert v == pytest.approx(-1.2 * -0.7)
    assert g == pytest.approx(-1.2)
    assert m["clipfrac_high"].item() == 1.0
    v, g, _ = one("cispo", 0.5, 1.0, logp=-0.7, clip_eps_high=0.2)
    assert g == pytest.approx(-0.5)


def test_spo_hand_values():
    # J = r A - |A| (r-1)^2 / (2 eps) = 1.5 - 0.25 / 0.4 = 0.875, so the loss is -0.875;
    # dJ/dr = A - |A| (r - 1) / eps = 1 - 2.5 = -1.5, so dl/dlogp = 1.5 * r = 2.25
    v, g, _ = one("spo", 1.5, 1.0, clip_eps_low=0.2)
    assert v == pytest.approx(-0.875)
    assert g == pytest.approx(2.25)
    # the per-element objective peaks at r* = 1 + sign(A) eps: zero gradient there
    _, g, _ = one("spo", 1.2, 1.0, clip_eps_low=0.2)
    assert g == pytest.approx(0.0, abs=1e-12)
    _, g, _ = one("spo", 0.8, -1.0, clip_eps_low=0.2)
    assert g == pytest.approx(0.0, abs=1e-12)


def test_clamp_cuts_gradient_for_both_signs():
    assert one("clamp", 1.5, 1.0, clip_eps_low=0.2)[:2] == pytest.approx((-1.2, 0.0))
    assert one("clamp", 1.1, 1.0, clip_eps_low=0.2)[:2] == pytest.approx((-1.1, -1.1))
    # A<0 and r above the band: PPO keeps the gradient (1.5) here, clamp does not
    assert one("clamp", 1.5, -1.0, clip_eps_low=0.2)[:2] == pytest.approx((1.2, 0.0))
    # an asymmetric band: 1.25 lies inside (0.8, 1.3) and keeps its gradient
    assert one("clamp", 1.25, 1.0, clip_eps_low=0.2, clip_eps_high=0.3)[:2] == pytest.approx((-1.25, -1.25))
    assert one("ppo", 1.5, -1.0, clip_eps_low=0.2)[1] == pytest.approx(1.5)


def test_reinforce_hand_value():
    assert one("reinforce", 1.5, 2.0)[:2] == pytest.approx((-3.0, -3.0))


def test_gspo_sequence_ratio_hand_value():
    # log-ratios 0.1 and 0.3 -> s = exp(0.2) = 1.2214 > 1 + 4e-4: clipped, value -(1 + 4e-4), no gradient
    lp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.1, -0.3]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("gspo", lp, old, torch.tensor([1.0], dtype=torch.float64))
    loss.backward()
    assert loss.item() == pytest.approx(-1.0004)
    assert torch.all(lp.grad == 0)
    assert metrics["ratio_mean"].item() == pytest.approx(math.exp(0.2))
    # unclipped (wide eps): d/dlogp_t of -A exp(mean log r) = -A s / |o| for each of the 2 tokens
    lp.grad = None
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, _ = compute_policy_loss("gspo", lp, old, adv, clip_eps_low=0.5, clip_eps_high=0.5)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-math.exp(0.2) / 2] * 2)


def test_grpo_guard_hand_value():
    # s = 0.5, log-ratio -0.1, ||dmu||^2 = 0.02: b = 0.02 / (2 * 0.25) = 0.04, l~ = 0.5 (-0.1 + 0.04) = -0.03,
    # r~ = exp(-0.03) = 0.970446; A = 1: -A r~ > -A (1 - 2e-6), unclipped, value -0.970446,
    # d/dlogp = -A r~ * s = -0.485223
    lp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 1), 0.1, dtype=torch.float64)
    loss, _ = compute_policy_loss(
        "grpo_guard",
        lp,
        old,
        torch.ones(1, dtype=torch.float64),
        std=torch.tensor(0.5, dtype=torch.float64),
        mean_diff_sq=torch.full((1, 1), 0.02, dtype=torch.float64),
    )
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(-0.03))
    assert lp.grad.item() == pytest.approx(-math.exp(-0.03) * 0.5)


def test_aggregation_modes_reference_table():
    # per-element losses [[1, 1, 1, .], [2, 2, ., .]] (reinforce at r = 1 gives -A, so A = -loss):
    # token-mean 7/5 = 1.4; seq-mean-token-mean (1 + 2)/2 = 1.5; seq-mean-token-sum (3 + 4)/2 = 3.5;
    # seq-mean-token-sum-norm with L = 4: 7 / (2 * 4) = 0.875
    adv = -torch.tensor([[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    lp = torch.zeros(2, 4)
    expected = {
        "token_mean": 1.4,
        "seq_mean_token_mean": 1.5,
        "seq_mean_token_sum": 3.5,
        "seq_mean_token_sum_norm": 0.875,
        "sum": 7.0,
    }
    for agg, value in expected.items():
        loss, _ = compute_policy_loss("reinforce", lp, lp, adv, mask, agg=agg)
        assert loss.item() == pytest.approx(value), agg
    # Dr.GRPO's constant L can be set explicitly: 7 / (2 * 7) = 0.5
    loss, _ = compute_policy_loss("reinforce", lp, lp, adv, mask, agg="seq_mean_token_sum_norm", norm_len=7)
    assert loss.item() == pytest.approx(0.5)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_aggregation_is_a_mask_weighted_sum(agg):
    # aggregate(l) == sum(aggregation_weights(mask) * l) for any l: what lets a loop split the K axis
    from flowrl.core import aggregate, aggregation_weights

    g = torch.Generator().manual_seed(1)
    loss = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) > 0.4
    mask[2] = False  # an empty row does not count as a sequence
    weights = aggregation_weights(mask, agg, norm_len=9 if agg == "seq_mean_token_sum_norm" else None)
    assert weights.shape == (5, 7) and (weights[~mask] == 0).all()
    expected = aggregate(loss, mask, agg, norm_len=9)
    torch.testing.assert_close((weights.double() * loss).sum(), expected, rtol=1e-6, atol=1e-12)


def test_per_step_metrics_hand_values():
    # two steps; column 0: ratios 1.1 and 0.9 (mean 1, std 0.1); column 1: one masked element, ratio 1.2
    lp = torch.zeros(2, 2, dtype=torch.float64)
    old = -torch.log(torch.tensor([[1.1, 1.2], [0.9, 5.0]], dtype=torch.float64))
    mask = torch.tensor([[True, True], [True, False]])
    _, m = compute_policy_loss("ppo", lp, old, torch.tensor([1.0, 1.0], dtype=torch.float64), mask, clip_eps_low=0.15)
    torch.testing.assert_close(m["ratio_mean_per_step"], torch.tensor([1.0, 1.2], dtype=torch.float64))
    torch.testing.assert_close(m["ratio_std_per_step"], torch.tensor([0.1, 0.0], dtype=torch.float64))
    assert m["count_per_step"].tolist() == [2.0, 1.0] and m["clipfrac_per_step"].tolist() == [0.0, 1.0]
    torch.testing.assert_close(m["raw_ratio_mean_per_step"], m["ratio_mean_per_step"])
    # GSPO: the objective's ratio is the row's geometric mean, the raw one stays per element
    _, m = compute_policy_loss("gspo", lp, old, torch.ones(2, dtype=torch.float64), mask)
    geo = math.sqrt(1.1 * 1.2)
    torch.testing.assert_close(m["ratio_mean_per_step"], torch.tensor([(geo + 0.9) / 2, geo], dtype=torch.float64))
    torch.testing.assert_close(m["raw_ratio_mean_per_step"], torch.tensor([1.0, 1.2], dtype=torch.float64))
    assert get_objective("gspo").elementwise is False and get_objective("grpo_guard").elementwise is True


def test_equal_length_invariants():
    # all rows the same length: token-mean == seq-mean-token-mean and Dr.GRPO == token-mean * |o| / L
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 6, generator=g, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, dtype=torch.float64, generator=g)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, :5] = True
    tm = compute_policy_loss("ppo", lp, old, adv, mask, agg="token_mean")[0]
    smtm = compute_policy_loss("ppo", lp, old, adv, mask, agg="seq_mean_token_mean")[0]
    dr = compute_policy_loss("ppo", lp, old, adv, mask, agg="seq_mean_token_sum_norm", norm_len=8)[0]
    assert tm.item() == pytest.approx(smtm.item())
    assert dr.item() == pytest.approx(tm.item() * 5 / 8)


# --- parity with direct autograd of the published formula (fp64, random inputs) ------------------

PARITY_HPARAMS = {
    # clip ranges chosen so that random ratios land on both sides of every bound
    "ppo": {"clip_eps_low": 0.2, "clip_eps_high": 0.3, "dual_clip_c": 2.0},
    "grpo": {},
    "dapo": {},
    "dr_grpo": {},
    "gspo": {"clip_eps_low": 0.05, "clip_eps_high": 0.08},
    "sapo": {"tau_pos": 0.9, "tau_neg": 1.3},
    "cispo": {"clip_eps_low": 0.3, "clip_eps_high": 0.2},
    "spo": {"clip_eps_low": 0.15},
    "gppo": {"beta_low": 0.5, "beta_high": 0.75},
    "clamp": {"clip_eps_low": 0.2, "clip_eps_high": 0.25},
    "reinforce": {},
    "grpo_guard": {"clip_eps_low": 0.05},
}


def random_batch(seed, b=6, k=7, adv_per_element=False):
    g = torch.Generator().manual_seed(seed)
    logp = (-2 * torch.rand(b, k, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.35 * torch.randn(b, k, generator=g, dtype=torch.float64)
    adv = torch.randn((b, k) if adv_per_element else (b,), generator=g, dtype=torch.float64)
    mask = torch.rand(b, k, generator=g) > 0.3
    mask[:, 0] = True  # every row has a valid element
    return logp, old, adv, mask, g


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("variant", ["adv_b", "adv_bk_weights"])
def test_value_and_gradient_match_direct_autograd(name, agg, variant):
    seed = zlib.crc32(f"{name}-{agg}-{variant}".encode())
    logp, old, adv, mask, g = random_batch(seed, b=12, adv_per_element=variant != "adv_b")
    hp = dict(PARITY_HPARAMS[name])
    extra = {}
    if name == "grpo_guard":
        std = 0.2 + torch.rand(logp.shape, generator=g, dtype=torch.float64)
        mean_diff_sq = (0.01 * torch.rand(logp.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
        extra = {"std": std, "mean_diff_sq": mean_diff_sq}
    weights = 0.5 + torch.rand(logp.shape, generator=g, dtype=torch.float64) if variant != "adv_b" else None

    loss, metrics = compute_policy_loss(name, logp, old, adv, mask, agg=agg, weights=weights, **hp, **extra)
    grads = torch.autograd.grad(loss, [logp] + ([extra["mean_diff_sq"]] if extra else []))

    ref_fn, preset = REFERENCES[name]
    adv_bk = adv if adv.ndim == 2 else adv.unsqueeze(-1).expand_as(logp)
    per_element = ref_fn(logp, old, adv_bk, mask, **{**preset, **hp}, **extra)
    if weights is not None:
        per_element = per_element * weights
    ref_loss = ref_aggregate(per_element, mask, agg)
    ref_grads = torch.autograd.grad(ref_loss, [logp] + ([extra["mean_diff_sq"]] if extra else []))

    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for ours, ref in zip(grads, ref_grads):
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)
    if name not in ("reinforce", "sapo"):
        # the case is only meaningful if both regimes (bound binding / not binding) occur
        assert 0.0 < metrics["clipfrac"].item() < 1.0, metrics["clipfrac"]


# --- invariants --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_ratio_is_exactly_one_and_gradient_is_vanilla_pg_at_old_policy(name):
    logp, _, adv, mask, g = random_batch(3)
    extra = {}
    if name == "grpo_guard":
        extra = {"std": torch.tensor(0.3, dtype=torch.float64), "mean_diff_sq": torch.zeros_like(logp)}
    agg = get_objective(name).agg
    loss, metrics = compute_policy_loss(name, logp, logp.detach(), adv, mask, **extra)
    (grad,) = torch.autograd.grad(loss, logp)
    assert metrics["ratio_mean"].item() == 1.0 and metrics["ratio_std"].item() == 0.0
    assert metrics["ratio_min"].item() == 1.0 and metrics["ratio_max"].item() == 1.0
    assert metrics["approx_kl_k3"].item() == 0.0 and metrics["clipfrac"].item() == 0.0
    # -A grad(logp) with the objective's aggregation; GRPO-Guard scales the log-ratio by s = 0.3
    pg_loss, _ = compute_policy_loss("reinforce", logp, logp.detach(), adv, mask, agg=agg)
    (pg_grad,) = torch.autograd.grad(pg_loss, logp)
    scale = 0.3 if name == "grpo_guard" else 1.0
    torch.testing.assert_close(grad, scale * pg_grad, rtol=1e-12, atol=1e-15)


def test_ppo_gradient_is_zero_exactly_where_the_clip_binds():
    logp, old, adv, mask, _ = random_batch(11, b=16, k=16)
    mask = torch.ones_like(mask)
    loss, _ = compute_policy_loss("ppo", logp, old, adv, mask, clip_eps_low=0.2, agg="seq_mean_token_sum")
    (grad,) = torch.autograd.grad(loss, logp)
    ratio = torch.exp(logp.detach() - old)
    a = adv.unsqueeze(-1)
    binding = ((a > 0) & (ratio > 1.2)) | ((a < 0) & (ratio < 0.8))
    assert binding.any() and (~binding).any()
    assert torch.all(grad[binding] == 0)
    assert torch.all(grad[~binding] != 0)


def test_spo_never_zeroes_the_gradient():
    logp, old, adv, mask, _ = random_batch(12, b=16, k=16)
    old = logp.detach() + 2.0 * (old - logp.detach())  # far off-policy: ratios well outside 1 +- eps
    loss, _ = compute_policy_loss("spo", logp, old, adv, torch.ones_like(mask), clip_eps_low=0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.all(grad != 0)


@pytest.mark.parametrize("name", ["ppo", "cispo", "vespo", "sapo"])  # cispo, vespo: the surrogate reads logp too
@pytest.mark.parametrize("dirty", ["both", "logp", "old"])
def test_padding_never_reaches_the_loss_or_gradient(name, dirty):
    logp, old, adv, mask, _ = random_batch(5)
    clean_loss, _ = compute_policy_loss(name, logp, old, adv, mask)
    (clean_grad,) = torch.autograd.grad(clean_loss, logp)
    dirty_old = torch.where(mask, old, torch.full_like(old, float("nan"))) if dirty != "logp" else old
    dirty_logp = torch.where(mask, logp, torch.full_like(old, -float("inf"))) if dirty != "old" else logp
    loss, metrics = compute_policy_loss(name, dirty_logp, dirty_old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == clean_loss.item()
    torch.testing.assert_close(grad, clean_grad)
    assert all(torch.isfinite(v).all() for v in metrics.values())


def test_all_masked_batch_gives_zero_loss():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = compute_policy_loss("grpo", lp, lp.detach(), torch.ones(2), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(lp.grad == 0)


def test_low_precision_inputs_are_computed_in_fp32():
    lp = torch.randn(3, 5).to(torch.bfloat16).requires_grad_(True)
    loss, metrics = compute_policy_loss("ppo", lp, lp.detach() + 0.01, torch.randn(3))
    assert loss.dtype == torch.float32 and metrics["ratio_mean"].dtype == torch.float32
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad.float()).all()


def test_metrics_by_hand_and_per_step():
    # 4 elements, eps 0.2: r = 1.5 (A+, high-clipped), 0.5 (A-, low-clipped), 1.1 (A+), 0.9 (A-) -> clipfrac 0.5
    ratios = torch.tensor([[1.5, 0.5], [1.1, 0.9]])
    adv = torch.tensor([[1.0, -1.0], [1.0, -1.0]])
    lp = torch.zeros(2, 2, requires_grad=True)
    _, m = compute_policy_loss("ppo", lp, -ratios.log(), adv)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    assert m["clipfrac_high"].item() == pytest.approx(0.25)
    assert m["clipfrac_low"].item() == pytest.approx(0.25)
    assert m["ratio_mean"].item() == pytest.approx(1.0)
    assert m["ratio_std"].item() == pytest.approx(math.sqrt((0.25 + 0.25 + 0.01 + 0.01) / 4))
    assert m["ratio_mean_per_step"].tolist() == pytest.approx([1.3, 0.7])
    assert m["clipfrac_per_step"].tolist() == pytest.approx([0.5, 0.5])
    # k3 = mean((r - 1) - log r)
    k3 = sum((r - 1) - math.log(r) for r in [1.5, 0.5, 1.1, 0.9]) / 4
    assert m["approx_kl_k3"].item() == pytest.approx(k3, rel=1e-5)
    # long (text) sequences get no per-step metrics
    lp = torch.zeros(1, 100)
    _, m = compute_policy_loss("ppo", lp, lp, torch.ones(1))
    assert "ratio_mean_per_step" not in m


# --- errors ------------------------------------------------------------------------------------


def test_unknown_objective_lists_valid_names():
    lp = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="unknown objective 'ppo2'.*Did you mean 'ppo'.*Valid choices: ppo, grpo"):
        compute_policy_loss("ppo2", lp, lp, torch.ones(1))


def test_unknown_and_missing_hyper_parameters():
    lp = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="unknown hyper-parameter 'clip_epsilon' for objective 'ppo'.*clip_eps_low"):
        compute_policy_loss("ppo", lp, lp, torch.ones(1), clip_epsilon=0.1)
    # one name per concept: the clip widths and KL weights of earlier versions name their new one
    with pytest.raises(ValueError, match="'clip_eps' of objective 'ppo' was renamed: use clip_eps_low"):
        compute_policy_loss("ppo", lp, lp, torch.ones(1), clip_eps=0.1)
    with pytest.raises(ValueError, match="'kl_coef' of objective 'kl_cov' was renamed: use beta"):
        compute_policy_loss("kl_cov", lp, lp, torch.ones(1), kl_coef=0.1)
    with pytest.raises(ValueError, match="needs hyper-parameter.*std, mean_diff_sq"):
        compute_policy_loss("grpo_guard", lp, lp, torch.ones(1))
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        compute_policy_loss("ppo", lp, lp, torch.ones(1), agg="mean")


def test_shape_errors_name_the_tensor():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logp must have shape"):
        compute_policy_loss("ppo", lp, torch.zeros(2, 4), torch.ones(2))
    with pytest.raises(ValueError, match=r"advantages \[B\] must have B=2"):
        compute_policy_loss("ppo", lp, lp, torch.ones(3))
    with pytest.raises(ValueError, match="mask must have shape"):
        compute_policy_loss("ppo", lp, lp, torch.ones(2), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"logp must be \[B, K\]"):
        compute_policy_loss("ppo", torch.zeros(3), torch.zeros(3), torch.ones(3))


def test_duplicate_registration_raises_and_custom_objective_works():
    with pytest.raises(ValueError, match="already registered"):
        register_objective("ppo", ppo_clip)
    register_objective("ppo_tight_test", ppo_clip, clip_eps_low=0.01)
    try:
        v, g, _ = one("ppo_tight_test", 1.5, 1.0)
        assert (v, g) == pytest.approx((-1.01, 0.0))
    finally:
        OBJECTIVES.unregister("ppo_tight_test")
    with pytest.raises(ValueError, match="unknown hyper-parameter 'tau'"):
        register_objective("bad_preset_test", ppo_clip, tau=1.0)


def test_invalid_hyper_parameter_values():
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        one("ppo", 1.0, -1.0, dual_clip_c=0.5)
    with pytest.raises(ValueError, match="clip_eps_low must be > 0"):
        one("spo", 1.0, 1.0, clip_eps_low=0.0)
    with pytest.raises(ValueError, match="clip ranges must be >= 0"):
        one("ppo", 1.0, 1.0, clip_eps_low=-0.1)


@pytest.mark.parametrize("name", ALL)
def test_clip_flags_are_disjoint(name):
    # clipfrac is reported as clipfrac_high + clipfrac_low, which needs disjoint flags
    objective = get_objective(name)
    g = torch.Generator().manual_seed(0)
    ratio = torch.exp(torch.randn(8, 50, generator=g))
    adv = torch.randn(8, 50, generator=g)
    hp = {k: v for k, v in objective.hparams.items() if k in objective.surrogate_params}
    if name == "ppo":
        hp["dual_clip_c"] = 2.0
    if objective.needs_logp:
        hp["logp"] = -torch.rand(8, 50, generator=g)
    terms = objective.surrogate(ratio, adv, **hp)
    flags = [terms.clipped_high, terms.clipped_low, terms.clipped_dual]
    for flag in flags:  # bool, or a float 0/1 indicator
        assert flag is None or flag.dtype == torch.bool or set(flag.unique().tolist()) <= {0.0, 1.0}
    flags = [torch.zeros(ratio.shape) if f is None else f.float() for f in flags]
    assert float(torch.stack(flags).sum(0).max()) <= 1.0


def test_every_objective_has_image_scale_defaults_derived_from_flow_grpo():
    from flowrl.core import IMAGE_SCALE

    assert IMAGE_SCALE == pytest.approx(1e-4 / 0.2)
    for name in list_objectives():
        objective = get_objective(name)
        assert set(objective.image_hparams) <= set(objective.hparams), name
    assert get_objective("ppo").image_hparams == {"clip_eps_low": pytest.approx(1e-4)}
    assert get_objective("sapo").image_hparams == {"tau_pos": pytest.approx(2000.0), "tau_neg": pytest.approx(2100.0)}
    assert get_objective("spo").image_hparams == {"clip_eps_low": pytest.approx(1e-4)}
    assert get_objective("cispo").image_hparams == {"clip_eps_high": pytest.approx(2e-3)}
    assert get_objective("grpo_guard").image_hparams == {"clip_eps_low": 2e-6}
