"""Humanline (arXiv:2509.24207; HALOs `humanline=true`) and VCPO's ESS learning-rate scaling (arXiv:2602.17616):
hand-computed losses and scales, the per-step anchor sync, and short runs of TROLL, Humanline and VCPO on arith."""

import math

import pytest
import torch

from flowrl.core import compute_policy_loss, get_objective
from flowrl.run.ess import ESSScaling, ess_ratio, lr_scale
from flowrl.trainers import build_trainer, load_config
from tests.llm.helpers import full_and_resumed, tiny


def one(x, a, **hp):
    """Humanline's loss and d loss / d logp for one token with log-ratio x and advantage a (fp64)."""
    lp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = compute_policy_loss("humanline", lp, lp.detach() - x, torch.tensor([a], dtype=torch.float64), **hp)
    loss.backward()
    return loss.item(), lp.grad.item(), metrics


# --- Humanline: the loss ----------------------------------------------------------------------------------------


def test_humanline_defaults_are_halos():
    objective = get_objective("humanline")  # config/config.yaml, config/loss/grpo.yaml
    assert objective.hparams == {
        "log_epsilon_p": -1.0,
        "log_epsilon_r": 1.5,
        "clip_eps_low": 0.01,
        "clip_eps_high": None,
        "beta": 0.01,
    }
    assert objective.agg == "token_mean"


@pytest.mark.parametrize(
    "x, a, value, grad, dual",
    [
        # inside everything: r = 1.1, A = 1: -1.1 + 0.01 (1/1.1 + ln 1.1 - 1) = -1.1 + 0.01 * 0.004401 = -1.099956;
        # grad -A r + beta (1 - 1/r) = -1.1 + 0.01 * 0.090909 = -1.099091
        (math.log(1.1), 1.0, -1.099956, -1.099091, 0.0),
        # x = 2 > 1.5, A = -1: r~ = e^1.5 = 4.481689, PPO's unclipped branch -A r~ = 4.481689 (gradient 0, the
        # clamp binds); k3 = e^-2 + 2 - 1 = 1.135335 -> 4.481689 + 0.011353 = 4.493042; grad 0.01 (1 - e^-2) = 0.008647
        (2.0, -1.0, 4.493042, 0.008647, 1.0),
        # x = -1.5 < -1, A = 1: r~ = e^-1 = 0.367879, unclipped -0.367879 (gradient 0); k3 = e^1.5 - 1.5 - 1
        # = 1.981689 -> -0.367879 + 0.019817 = -0.348062; grad 0.01 (1 - e^1.5) = -0.034817
        (-1.5, 1.0, -0.348062, -0.034817, 1.0),
        # r = 1.5 inside the clamp, A = 1: PPO clips at 1.2 -> -1.2, gradient 0; k3 = 1/1.5 + ln 1.5 - 1 = 0.072132
        # -> -1.2 + 0.000721 = -1.199279; grad 0.01 (1 - 1/1.5) = 0.003333
        (math.log(1.5), 1.0, -1.199279, 0.003333, 0.0),
    ],
)
def test_humanline_hand_computed(x, a, value, grad, dual):
    v, g, metrics = one(x, a, clip_eps_low=0.2)
    assert v == pytest.approx(value, abs=1e-6) and g == pytest.approx(grad, abs=1e-6)
    assert float(metrics["clipfrac_dual"]) == dual


def test_humanline_matches_the_halos_formula_in_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 9, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ref = lp.detach() + torch.randn(4, 9, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 9, generator=g) > 0.2
    loss, _ = compute_policy_loss("humanline", lp, ref, adv, mask)
    (grad,) = torch.autograd.grad(loss, lp)
    # HALOs GRPOTrainer.loss with humanline: clamp the log-ratio, PPO min with eps, beta k3 on the raw log-ratio
    leaf = lp.detach().requires_grad_(True)
    ratio = (leaf - ref).clamp(-1.0, 1.5).exp()
    a = adv[:, None]
    kl = torch.exp(ref - leaf) - (ref - leaf) - 1
    per_token = -torch.min(a * ratio, a * ratio.clamp(0.99, 1.01)) + 0.01 * kl
    expected = (per_token * mask).sum() / mask.sum()
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)


# --- Humanline: the anchor synced every optimizer step ----------------------------------------------------------


@pytest.mark.long
def test_sync_reference_gives_ratio_one_at_first_and_lags_one_step(tmp_path):
    trainer = build_trainer(
        tiny(**{"objective.name": "humanline", "sync_reference": True, "run.epochs": 1, "batch.inner_epochs": 2}),
        output_dir=tmp_path,
    )
    algo = trainer.algorithm
    batch, _, _ = trainer.prepare_epoch(0)
    batch.advantages = torch.randn(len(batch.data))
    _, metrics = trainer.scheduler.loss(trainer.scheduler.micro_batch(batch))
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["ratio_std"]) == 0.0  # anchor = theta_0
    starts = []  # the weights each optimizer step starts from
    step = trainer.engine.step

    def recording_step():
        starts.append([p.detach().clone() for p in algo.anchor.params])
        return step()

    trainer.engine.step = recording_step
    trainer.scheduler.run(batch, 0)
    assert len(starts) >= 2
    # after step t, the next loss anchors at theta_t (the weights step t started from), as HALOs syncs before stepping
    algo.anchor_log_probs(batch.data.select([0]))  # the first loss of the next step syncs
    for anchor, pending, before_last, last in zip(algo.anchor.shadow, algo.pending.shadow, starts[-2], starts[-1]):
        torch.testing.assert_close(anchor, last, rtol=0, atol=0)
        assert not torch.equal(pending, before_last)
    assert not algo.sync_due


def test_sync_reference_resumes_exactly(tmp_path):
    overrides = {"objective.name": "humanline", "sync_reference": True, "run.epochs": 2, "run.save_every": 1}
    full, resumed = full_and_resumed(tmp_path, overrides, stop=1)
    for a, b in zip(full.algorithm.anchor.shadow, resumed.algorithm.anchor.shadow):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_troll_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="sync_reference must be false"):
        build_trainer(tiny(**{"objective.name": "troll", "sync_reference": True}), output_dir=tmp_path)
    with pytest.raises(ValueError, match="batch.backward: whole"):
        build_trainer(tiny(**{"objective.name": "troll", "batch.backward": "per_step"}), output_dir=tmp_path)
    with pytest.raises(ValueError, match="rule"):
        build_trainer(tiny(**{"ess_scaling.rule": "cubic"}), output_dir=tmp_path)


# --- VCPO: ESS learning-rate scaling ----------------------------------------------------------------------------


def test_ess_ratio_and_lr_scale_hand_computed():
    # w = (1, 3): ESS = (1 + 3)^2 / (1 + 9) = 1.6, rho = 1.6 / 2 = 0.8; sqrt(0.8) = 0.894427
    rho = float(ess_ratio(torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)))
    assert rho == pytest.approx(0.8)
    assert lr_scale(rho, "sqrt") == pytest.approx(0.894427, abs=1e-6)
    assert lr_scale(rho, "linear") == pytest.approx(0.8)
    assert lr_scale(rho, "sqrt", base_ratio=0.5) == 1.0  # min(1, 0.8 / 0.5)
    assert lr_scale(rho, "none") == 1.0
    assert float(ess_ratio(torch.zeros(5))) == pytest.approx(1.0)  # on-policy: equal weights
    # one weight e^50 times the others: rho -> 1 / B = 1/3, without overflow
    assert float(ess_ratio(torch.tensor([0.0, 50.0, 0.0]))) == pytest.approx(1 / 3, abs=1e-6)


def test_ess_hook_scales_the_step_and_restores_the_lr():
    from flowrl.runtime import Processes

    class Engine:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        seen = None

        def step(self):
            self.seen = self.optimizer.param_groups[0]["lr"]
            return 0.5

    engine, hook = Engine(), ESSScaling("sqrt", 1.0, Processes.single())
    # two sequences: log-ratios (0, 0) and (ln 3, 0) over their masked tokens, a padding row left out
    logp = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [9.0, 9.0]])
    hook.observe(logp, torch.zeros(3, 2), torch.ones(3, 2), torch.tensor([True, True, False]))
    norm, logs = hook.step(engine)
    assert norm == 0.5 and logs["ess_ratio"] == pytest.approx(0.8)
    assert engine.seen == pytest.approx(1e-3 * math.sqrt(0.8))
    assert engine.optimizer.param_groups[0]["lr"] == 1e-3 and hook.seq == []


def test_ess_scaling_in_the_text_trainer(tmp_path):
    trainer = build_trainer(
        tiny(**{"ess_scaling.rule": "linear", "run.epochs": 2, "batch.inner_epochs": 2}), output_dir=tmp_path
    )
    trainer.train()
    records = [r for r in trainer.log.history if r.get("optimizer_steps")]  # the first row is the baseline eval
    assert records and all(
        0 < r["ess_ratio"] <= 1 and r["ess_lr_scale"] == pytest.approx(r["ess_ratio"]) for r in records
    )
    assert min(r["ess_ratio"] for r in records) < 1  # later mini-batches are off-policy
    assert trainer.engine.optimizer.param_groups[0]["lr"] == pytest.approx(trainer.config.optim.lr)


# --- end to end on arith ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["troll", "humanline", "vcpo"])
def test_arith_config_trains_a_few_epochs(name, tmp_path):
    overrides = [
        "run.epochs=3",
        "run.log_with=[]",
        "eval.every=0",
        "eval.max_prompts=16",
        "run.save_every=0",
        "run.samples_every=0",
        "prompts.prompts_per_epoch=8",
        "batch.mini_batch_size=32",
    ]
    trainer = build_trainer(load_config(f"configs/llm/arith_{name}.yaml", overrides), output_dir=tmp_path)
    before = [p.detach().clone() for p in trainer.params]
    summary = trainer.train()
    assert summary["epochs"] == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))
    records = [r for r in trainer.log.history if r.get("optimizer_steps")]  # the first row is the baseline eval
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)
    key = {"troll": "troll_kl", "humanline": "humanline_clamped_frac", "vcpo": "ess_ratio"}[name]
    assert all(math.isfinite(r[key]) for r in records)
