"""The preference trainers: Diffusion-DPO (online and offline) and DGPO (`flowrl.core.preference`,
`flowrl.trainers.shared.preference`, `flowrl.trainers.image.diffusion_dpo`, `flowrl.trainers.image.dgpo`)."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flowrl.core import compute_policy_loss
from flowrl.core.preference import group_sums, preference_loss
from flowrl.trainers import load_config
from flowrl.trainers.image.diffusion_dpo import best_and_worst
from flowrl.trainers.shared.preference import group_draws

from .conftest import make_trainer, tiny_config, train_and_resume, training_rows


def core_loss(name, l_theta, l_ref, adv, group, **hparams):
    """`(loss, d loss / d l_theta)` of a core preference objective on per-draw errors `[B, K]`."""
    l_theta = l_theta.clone().requires_grad_(True)
    b, k = l_theta.shape
    groups = group.double()[:, None].expand(b, k)
    loss, metrics = compute_policy_loss(name, -l_theta, -l_ref, adv, None, group=groups, **hparams)
    (grad,) = torch.autograd.grad(loss, l_theta)
    return loss.detach(), grad, metrics


# ----------------------------------------------------------------------------------------------
# the losses by hand
# ----------------------------------------------------------------------------------------------


def test_diffusion_dpo_loss_and_gradient_by_hand_on_two_pairs():
    # rows: pair 0 (chosen, rejected), pair 1 (rejected, chosen); one draw each
    l_theta = torch.tensor([[0.5], [0.9], [0.4], [0.3]], dtype=torch.float64)
    l_ref = torch.tensor([[0.7], [0.6], [0.5], [0.2]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    loss, grad, metrics = core_loss("diffusion_dpo", l_theta, l_ref, adv, torch.tensor([0, 0, 1, 1]), beta=2.0)
    # pair 0: x_w = 0.7 - 0.5 = 0.2, x_l = 0.6 - 0.9 = -0.3, z = (2 / 2) (0.2 + 0.3) = 0.5
    # pair 1: x_w = 0.2 - 0.3 = -0.1, x_l = 0.5 - 0.4 = 0.1, z = -0.2
    expected = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(0.2))) / 2  # mean of -log sigmoid(z)
    assert loss.item() == pytest.approx(expected, abs=1e-12) and expected == pytest.approx(0.636108, abs=1e-6)
    # dL/dl_theta^w = sigmoid(-z) beta / 4 (the 1/2 of the mean over pairs), the rejected's the opposite
    s0, s1 = 1 / (1 + math.exp(0.5)), 1 / (1 + math.exp(-0.2))
    assert grad[:, 0].tolist() == pytest.approx([s0 / 2, -s0 / 2, -s1 / 2, s1 / 2], abs=1e-12)
    assert metrics["preference_accuracy"].item() == 0.5  # pair 0 has z > 0, pair 1 not
    # the peers' code: -logsigmoid(-0.5 beta ((theta_w - ref_w) - (theta_l - ref_l))).mean()
    w, lo = torch.tensor([0, 3]), torch.tensor([1, 2])
    inside = -0.5 * 2.0 * ((l_theta[w] - l_ref[w]) - (l_theta[lo] - l_ref[lo]))
    assert loss.item() == pytest.approx(-F.logsigmoid(inside).mean().item(), abs=1e-12)


def test_dgpo_gradient_is_the_code_s_sigmoid_weighted_advantage_matching_and_its_clip():
    torch.manual_seed(0)
    g, n, k, beta, eps = 2, 4, 3, 5.0, 0.05
    group = torch.arange(g).repeat_interleave(n)  # [8]
    adv = torch.randn(g * n, dtype=torch.float64)
    l_ref = torch.rand(g * n, k, dtype=torch.float64)
    l_theta = l_ref + 0.1 * torch.randn(g * n, k, dtype=torch.float64)
    l_old = l_theta + 0.04 * torch.randn(g * n, k, dtype=torch.float64)
    loss, grad, _ = core_loss(
        "dgpo", l_theta, l_ref, adv, group, beta=beta, clip_eps_low=eps, clip_log_ratio=l_old - l_theta
    )
    # Luo-Yihong/DGPO, per draw: s_g = sum_g A beta (dsm - ref) / G; loss = mean(sg(sigmoid(s_g)) A dsm), where the
    # DSM clip detaches dsm (A > 0: ratio > 1 + eps; else ratio < 1 - eps, ratio = exp(old - dsm))
    dsm = l_theta.clone().requires_grad_(True)
    code = 0
    for j in range(k):
        ratio = torch.exp(l_old[:, j] - dsm[:, j].detach())
        clip = torch.where(adv > 0, ratio > 1 + eps, ratio < 1 - eps)
        d = torch.where(clip, dsm[:, j].detach(), dsm[:, j])
        per_sample = adv * beta * (dsm[:, j].detach() - l_ref[:, j]) / n
        s = torch.zeros(g, dtype=torch.float64).index_add(0, group, per_sample)
        code = code + (torch.sigmoid(s)[group] * adv * d).mean() / k  # accumulated over the k timesteps
    (expected,) = torch.autograd.grad(code, dsm)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    # some draws were clipped and pass no gradient; the value is the group DPO loss
    assert (grad == 0).any()
    z = beta * torch.zeros(g, k, dtype=torch.float64).index_add(0, group, adv[:, None] * (l_ref - l_theta)) / n
    assert loss.item() == pytest.approx((F.softplus(-z) / beta).mean().item(), abs=1e-12)


@pytest.mark.parametrize("name", ["diffusion_dpo", "dgpo"])
def test_the_loss_is_log_2_at_the_reference_and_its_gradient_antisymmetric_in_chosen_and_rejected(name):
    l = torch.rand(4, 2, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    group = torch.tensor([0, 0, 1, 1])
    loss, grad, _ = core_loss(name, l, l, adv, group, beta=8.0)
    scale = 1 / 8.0 if name == "dgpo" else 1.0
    assert loss.item() == pytest.approx(scale * math.log(2), abs=1e-12)
    # at theta = ref the chosen's error is pushed down exactly as hard as the rejected's is pushed up
    torch.testing.assert_close(grad[0::2], -grad[1::2])
    assert (grad[0::2] > 0).all()  # descending the loss lowers the chosen's error
    swapped_loss, swapped_grad, _ = core_loss(name, l, l, -adv, group, beta=8.0)
    assert swapped_loss.item() == pytest.approx(loss.item(), abs=1e-12)
    torch.testing.assert_close(swapped_grad, -grad)
    # identical chosen and rejected errors anywhere give a zero gradient for the pair as a whole
    same = torch.tensor([[0.3, 0.2], [0.3, 0.2], [0.1, 0.5], [0.1, 0.5]], dtype=torch.float64)
    _, grad_same, _ = core_loss(name, same, same + 0.05, adv, group, beta=8.0)
    torch.testing.assert_close(grad_same[0::2] + grad_same[1::2], torch.zeros(2, 2, dtype=torch.float64))


def test_core_value_and_gradient_match_the_direct_definition_with_masks_and_any_group_order():
    torch.manual_seed(1)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    group = torch.tensor([2, 0, 2, 1, 0, 1])
    mask = torch.ones(6, 3, dtype=torch.bool)
    mask[3, 1] = False
    for name, adv in (("diffusion_dpo", torch.tensor([1.0, 1, -1, -1, -1, 1])), ("dgpo", torch.randn(6))):
        adv = adv.double()
        direct = preference_loss(x, adv, group, mask, beta=3.0, form=name)
        (want,) = torch.autograd.grad(direct, x)
        logp = x.detach().clone().requires_grad_(True)
        got, _ = compute_policy_loss(
            name, logp, torch.zeros_like(logp), adv, mask, group=group.double()[:, None].expand(6, 3), beta=3.0
        )
        (have,) = torch.autograd.grad(got, logp)
        assert got.item() == pytest.approx(direct.item(), abs=1e-12)
        torch.testing.assert_close(have, want)
    sums, counts = group_sums(torch.ones(6, 3), group, mask)
    assert counts[:, 0].tolist() == [2, 2, 2, 2, 2, 2] and counts[4, 1] == 2 and counts[5, 1] == 1


# ----------------------------------------------------------------------------------------------
# pairs and draws
# ----------------------------------------------------------------------------------------------


def test_best_and_worst_pairs_per_group():
    adv = torch.tensor([0.1, 0.9, -0.5, 0.2, 0.0, 0.0, 0.3, -0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    valid = torch.tensor([True, True, True, True, True, True, True, False])
    # group 0: best row 1, worst row 2; group 1: no spread; group 2: one valid sample
    assert best_and_worst(adv, groups, valid).tolist() == [0, 1, -1, 0, 0, 0, 0, 0]


def test_pairs_and_groups_share_their_draws():
    keys = torch.tensor([3, 3, 5, 5, 5, 3])
    sigmas = torch.linspace(1, 0, 11)
    draws = group_draws("logit_normal", keys, 2, (1, 2, 2), (0, 4, 5))
    for a, b in ((0, 1), (0, 5), (2, 3), (2, 4)):
        assert torch.equal(draws.taus[a], draws.taus[b]) and torch.equal(draws.noises[a], draws.noises[b])
    assert not torch.equal(draws.noises[0], draws.noises[2]) and not torch.equal(draws.taus[0], draws.taus[2])
    # whichever rows a process holds, a group draws the same
    part = group_draws("logit_normal", keys[2:4], 2, (1, 2, 2), (0, 4, 5))
    assert torch.equal(part.noises, draws.noises[2:4])
    shared = group_draws("grid", keys, 3, (1, 2, 2), (0, 4, 5), sigmas[:6], shared_times=True)
    assert (shared.taus == shared.taus[0]).all() and not torch.equal(shared.noises[0], shared.noises[2])
    assert set(shared.taus[0].tolist()) <= set(sigmas[:5].tolist()) and len(set(shared.taus[0].tolist())) == 3


# ----------------------------------------------------------------------------------------------
# the trainers on the tiny world
# ----------------------------------------------------------------------------------------------

TINY = {"diffusion_dpo": ["num_draws=2"], "dgpo": ["num_draws=2", "trunc_steps=2", "kl.beta=0.1"]}


def trainer_for(world, tmp_path, name, overrides=()):
    return make_trainer(world, tiny_config(name, tmp_path, overrides=[*TINY[name], *overrides]))


def test_online_dpo_trains_the_best_and_worst_of_each_group_starting_at_log_2(tiny_world, tmp_path):
    trainer = trainer_for(tiny_world, tmp_path, "diffusion_dpo", ["run.epochs=1"])
    batch, collected, record = trainer.prepare_epoch(0)
    pairs = batch.advantages
    assert set(pairs[batch.trainable].tolist()) == {-1.0, 1.0} and record["adv/dpo_pairs"] == batch.trainable.sum() / 2
    for g in collected.group_ids.unique():
        rows = (collected.group_ids == g) & batch.trainable
        if rows.any():
            assert pairs[rows].sum() == 0 and collected.total[rows & (pairs > 0)] >= collected.total[rows].max()
    draws = batch.data.draws  # each pair trains at the same (t, eps)
    chosen, rejected = (pairs > 0).nonzero().flatten(), (pairs < 0).nonzero().flatten()
    same = collected.group_ids[chosen][:, None] == collected.group_ids[rejected][None]
    for i, j in same.nonzero().tolist():
        assert torch.equal(draws.taus[chosen[i]], draws.taus[rejected[j]])
        assert torch.equal(draws.noises[chosen[i]], draws.noises[rejected[j]])
    row = trainer.train_epoch(0)
    assert row["loss"] == pytest.approx(math.log(2), abs=1e-5)  # one step, taken at theta = ref


@pytest.mark.parametrize("name", ["diffusion_dpo", "dgpo"])
def test_the_micro_batch_size_changes_nothing(tiny_world, tmp_path, name):
    """Pairs and groups of 4 cut into micro-batches of 3 (split across micro-batches): the two-pass update gives the
    same steps as micro-batches of 16 (DGPO: two mini-batches of two groups, the second step's DSM clip binds)."""
    weights = []
    for micro in (16, 3):
        overrides = ["run.epochs=1", f"batch.micro_batch_size={micro}"]
        if name == "dgpo":
            overrides += ["batch.mini_batch_size=8", "dsm_clip=1e-3"]
        trainer = trainer_for(tiny_world, tmp_path / str(micro), name, overrides)
        start = [p.detach().clone() for p in trainer.params]
        row = trainer.train_epoch(0)
        weights.append(([p.detach().clone() for p in trainer.params], row))
    (a, row_a), (b, row_b) = weights
    assert row_a["optimizer_steps"] == row_b["optimizer_steps"] == (2 if name == "dgpo" else 1)
    assert name != "dgpo" or row_a["clipfrac"] > 0
    for key in ("loss", "preference_accuracy", "preference_margin", "clipfrac", "penalty"):
        if key in row_a:
            assert row_b[key] == pytest.approx(row_a[key], rel=1e-4, abs=1e-6), key
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(p, q) for p, q in zip(b, start))


@pytest.mark.parametrize("name", ["diffusion_dpo", "dgpo"])
def test_two_epochs_train_and_resume_exactly(tiny_world, tmp_path, name):
    straight, _, rows = train_and_resume(tiny_world, tmp_path, name, TINY[name])
    assert all(r["optimizer_steps"] >= 1 and math.isfinite(r["loss"]) for r in rows)
    if name == "dgpo":
        assert rows[-1]["dgpo/old_decay"] == pytest.approx(min(1e-3 * (straight.engine.optimizer_steps - 1), 0.3))


# ----------------------------------------------------------------------------------------------
# offline preference data
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_preferences(tmp_path_factory):
    pytest.importorskip("sklearn")
    from flowrl.digits.preferences import build_digits_preferences

    return build_digits_preferences(tmp_path_factory.mktemp("prefs"), pairs=12, seed=0)


def test_the_digits_example_and_the_loader(digits_preferences, tmp_path):
    from flowrl.digits import digit_of
    from flowrl.image.preferences import load_preferences, read_image

    pairs = load_preferences(digits_preferences)
    assert len(pairs) == 12 and all(p.chosen.is_file() and p.rejected.is_file() for p in pairs)
    image = read_image(pairs[0].chosen, (8, 8))
    assert image.shape == (3, 8, 8) and 0 <= image.min() and image.max() <= 1 and image.max() > 0.5
    digit_of(pairs[0].prompt)  # a digits prompt
    bad = tmp_path / "bad.jsonl"
    cases = {
        '{"prompt": "a seven", "chosen": "a.png"}': r"bad.jsonl:2: needs a non-empty string for 'rejected'",
        "not json": r"bad.jsonl:2: not valid JSON",
        '["a", "b"]': r"bad.jsonl:2: a row must be a JSON object",
        '{"prompt": "x", "chosen": "missing.png", "rejected": "missing.png"}': r"bad.jsonl:2: chosen image 'missing",
    }
    first = json.dumps({k: str(getattr(pairs[0], k)) for k in ("prompt", "chosen", "rejected")})
    for line, message in cases.items():
        bad.write_text(f"{first}\n{line}\n")
        with pytest.raises(ValueError, match=message):
            load_preferences(bad)
    with pytest.raises(ValueError, match="does not exist .*python -m flowrl.digits.preferences"):
        load_preferences(tmp_path / "nowhere.jsonl")


def test_offline_dpo_trains_on_the_file_s_pairs_and_resumes(digits_preferences, tiny_world, tmp_path):
    overrides = [f"preference_data={digits_preferences}", "prompts.group_size=2"]
    with pytest.raises(ValueError, match="set prompts.group_size to 2"):
        load_config({"trainer": "diffusion_dpo", "preference_data": str(digits_preferences)})
    trainer = trainer_for(tiny_world, tmp_path / "one", "diffusion_dpo", [*overrides, "run.epochs=1"])
    batch, collected, _ = trainer.prepare_epoch(0)
    assert batch.advantages.tolist() == [1.0, -1.0] * 4 and collected.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch.data.latents.shape == (8, 1, 1, 8, 8) and batch.data.latents.abs().max() <= 1
    train_and_resume(tiny_world, tmp_path / "resume", "diffusion_dpo", [*TINY["diffusion_dpo"], *overrides])
    rows = training_rows(tmp_path / "resume" / "a")
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and rows[0]["reward/mean"] == 0.5


# ----------------------------------------------------------------------------------------------
# two processes (the `distributed` tier)
# ----------------------------------------------------------------------------------------------

DISTRIBUTED = {
    "diffusion_dpo": {"num_draws": 2},
    # mini-batches of one group of 4 (each process holds one of the epoch's 4 groups per step), micro-batches of 3
    "dgpo": {
        "num_draws": 2,
        "trunc_steps": 2,
        "dsm_clip": 1e-3,
        "kl": {"beta": 0.1},
        "batch": {"mini_batch_size": 8, "micro_batch_size": 3},
    },
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(DISTRIBUTED))
def test_two_processes_equal_one(tmp_path, session_cache, name):
    """`torchrun --nproc_per_node 2`: the same steps, diagnostics and weights as one process (the group sums are
    reduced over the processes, every process calls the objective in step)."""
    import yaml

    from tests.conftest import TINY_DIGITS_RUN
    from tests.test_distributed import _same_rows, _same_weights, _train_together

    data = json.loads(json.dumps(TINY_DIGITS_RUN))
    data.update({"trainer": name, "prompts": {"prompts_per_epoch": 4, "group_size": 4}})
    for key, value in DISTRIBUTED[name].items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    data["run"] = {"epochs": 2, "save_every": 1, "samples_every": 0, "log_with": [], "threads": 1}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    cache = Path(session_cache)  # the digits base and classifiers every two-process test shares (built once)
    one, two = _train_together(
        dict(config=config, out=tmp_path / "one", cache=cache, processes=1),
        dict(config=config, out=tmp_path / "two", cache=cache, processes=2),
    )
    assert (one["processes"], two["processes"]) == (1, 2)
    rows_one, _ = _same_rows(tmp_path / "one", tmp_path / "two", "preference_accuracy", "preference_margin")
    assert rows_one[1]["optimizer_steps"] >= 1
    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(1, 2))
