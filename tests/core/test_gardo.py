"""GARDO's tensor pieces (arXiv:2512.24138) by hand-computed numbers and against the released stat tracker."""

import math

import numpy as np
import pytest
import torch

from flowrl.core import (
    RiskController,
    diversity_factor,
    group_advantages,
    nearest_peer_distance,
    rank_uncertainty,
    uncertainty_gate,
)
from flowrl.core.gardo import batch_ranks


def test_ranks_and_uncertainty_by_hand():
    proxy = torch.tensor([0.9, 0.1, 0.5, 0.3])  # ranks 1, 4, 2, 3 (1 = highest)
    aesthetic = torch.tensor([0.2, 0.8, 0.6, 0.4])  # ranks 4, 1, 2, 3
    imagereward = torch.tensor([0.7, 0.9, 0.1, 0.2])  # ranks 2, 1, 4, 3
    assert batch_ranks(proxy).tolist() == [1, 4, 2, 3]
    assert batch_ranks(torch.tensor([0.5, 0.5, 0.7])).tolist() == [2, 3, 1]  # ties: the earlier sample first
    # the code: rank_main - (rank_aesthetic + rank_imagereward) / 2
    u = rank_uncertainty(proxy, [aesthetic, imagereward])
    assert u.tolist() == [1 - 3, 4 - 1, 2 - 3, 3 - 3]
    assert rank_uncertainty(proxy, [aesthetic, imagereward], direction="proxy_higher").tolist() == [2, -3, 1, 0]
    with pytest.raises(ValueError, match="direction"):
        rank_uncertainty(proxy, [aesthetic], direction="both")


def test_gate_keeps_the_top_fraction_of_the_non_negative_uncertainties():
    u = torch.tensor([3.0, 1.0, 0.0, -2.0, 2.0])
    # non-negative: [3, 1, 0, 2]; their median (linear interpolation) is 1.5; gated: u > 1.5
    assert uncertainty_gate(u, 0.5).tolist() == [True, False, False, False, True]
    assert float(np.percentile([3.0, 1.0, 0.0, 2.0], 50)) == 1.5  # the code's threshold, for the record
    # 90th percentile of [0, 1, 2, 3] = 2.7: only the largest
    assert uncertainty_gate(u, 0.1).tolist() == [True, False, False, False, False]
    assert not uncertainty_gate(torch.tensor([-1.0, -3.0]), 0.1).any()  # nothing non-negative: nothing gated


def test_risk_controller_by_hand():
    risk = RiskController()  # base 0.1, rate 0.1, [0.02, 0.2], window 20
    assert risk.update(1.0) == pytest.approx(0.1)  # first epoch: the base
    assert risk.update(2.0) == pytest.approx(0.11)  # above every value seen: x 1.1
    assert risk.update(0.5) == pytest.approx(0.099)  # below every value seen: x 0.9
    assert risk.update(1.5) == pytest.approx(0.099)  # inside the range: unchanged
    for m in range(3, 20):
        risk.update(float(m))  # each a new maximum
    assert risk.fraction == pytest.approx(0.2) and len(risk.history) == 20  # clipped at the top; 20 epochs kept
    again = RiskController()
    again.load_state_dict(risk.state_dict())
    assert again.update(100.0) == risk.update(100.0)


def test_nearest_peer_distance_by_hand():
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 0.0], [0.0, 3.0], [5.0, 5.0]])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    d = nearest_peer_distance(features, groups)
    # group 0: e0 and e2 point the same way (distance 0), e1 is orthogonal to both (1); group 1: a zero vector has
    # cosine 0 with anything (1); group 2: a sample alone has no peer (0)
    assert d.tolist() == pytest.approx([0.0, 1.0, 0.0, 1.0, 1.0, 0.0])


def test_diversity_factor_by_hand():
    groups = torch.tensor([0, 0, 0, 1, 1])
    distance = torch.tensor([0.0, 0.6, 0.3, 0.0, 0.0])
    adv = torch.tensor([0.5, 0.2, -0.7, 0.1, -0.1])
    # group 0: mean distance 0.3, so positive advantages get d / 0.3 = [0, 2], the negative one keeps 1;
    # group 1: every distance 0, factor 1
    assert diversity_factor(distance, groups, adv).tolist() == pytest.approx([0.0, 2.0, 1.0, 1.0, 1.0])


def _released_gardo_tracker(prompts, rewards, features):
    """The released `PerPromptStatTracker.update(..., type='gardo')` (tinnerhrhe/GARDO `flow_grpo/stat_tracking.py`
    l.96-135), written out with numpy for one epoch."""
    rewards, prompts = np.asarray(rewards, dtype=np.float64), np.asarray(prompts)
    features = np.nan_to_num(np.asarray(features, dtype=np.float64))
    features = features / np.linalg.norm(features, ord=2, axis=1, keepdims=True)
    out = np.zeros_like(rewards)
    for prompt in np.unique(prompts):
        sel = prompts == prompt
        r, e = rewards[sel], features[sel]
        dist = 1 - np.clip(e @ e.T, -1, 1)
        nearest = np.array([np.min(np.delete(dist[i], i)) for i in range(len(r))])
        factor = np.where(r - r.mean() < 0, 1.0, nearest / nearest.mean())
        out[sel] = (r - r.mean()) * factor
    return out


def test_group_advantages_times_the_factor_match_the_released_tracker():
    g = torch.Generator().manual_seed(0)
    n, k = 24, 6
    groups = torch.arange(n) // k
    rewards = torch.rand(n, generator=g, dtype=torch.float64)
    features = torch.randn(n, 16, generator=g, dtype=torch.float64)
    expected = _released_gardo_tracker(groups.numpy(), rewards.numpy(), features.numpy())
    adv, _ = group_advantages(rewards, groups, std="none")  # (r - mean), no std: the gardo mode
    shaped = adv * diversity_factor(nearest_peer_distance(features, groups), groups, adv).double()
    np.testing.assert_allclose(shaped.numpy(), expected, rtol=1e-5, atol=1e-7)
    assert not math.isclose(float(shaped.abs().sum()), float(adv.abs().sum()))  # the factor does change them
