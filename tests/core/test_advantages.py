import json
import math

import pytest
import torch

from flowrl.core import (
    ADVANTAGES,
    PerPromptStatTracker,
    gae,
    group_advantages,
    group_index,
    leave_one_out_advantages,
)


def test_group_advantages_by_hand_and_zero_std_groups():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv, stats = group_advantages(rewards, ["a", "a", "a", "b", "b", "b"])
    # group a: mean 2, sample std 1 -> (r - 2) / (1 + 1e-4); group b: all equal -> exactly 0
    assert adv.tolist() == pytest.approx([-1 / 1.0001, 0.0, 1 / 1.0001, 0.0, 0.0, 0.0])
    assert adv[3:].eq(0).all()
    assert stats["zero_std_groups"] == 1 and stats["num_groups"] == 2 and stats["zero_std_frac"] == 0.5
    # population std (numpy's, as Flow-GRPO/DDPO): std of [1, 2, 3] is sqrt(2/3)
    adv, _ = group_advantages(rewards, ["a", "a", "a", "b", "b", "b"], unbiased=False, eps=0.0)
    assert adv[:3].tolist() == pytest.approx([-(1.5**0.5), 0.0, 1.5**0.5])


def test_group_advantages_sum_to_zero_per_group_for_every_std_mode():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=g)
    ids = torch.arange(6).repeat_interleave(4)
    for std in ["group", "global", "none"]:
        adv, _ = group_advantages(rewards, ids, std=std)
        sums = torch.zeros(6).index_add_(0, ids, adv)
        assert sums.abs().max() < 1e-5, std
    # global: a single scale for the whole batch -> adv = (r - group mean) / (batch std + eps)
    adv, _ = group_advantages(rewards, ids, std="global")
    means = torch.zeros(6).index_add_(0, ids, rewards) / 4
    torch.testing.assert_close(adv, (rewards - means[ids]) / (rewards.std() + 1e-4))
    adv, _ = group_advantages(rewards, ids, std="none")
    torch.testing.assert_close(adv, rewards - means[ids])


def test_group_advantages_clip_singletons_and_errors():
    adv, stats = group_advantages(torch.tensor([0.0, 10.0, 7.0]), [0, 0, 1], clip=0.5)
    assert adv.tolist() == pytest.approx([-0.5, 0.5, 0.0])  # singleton group 1 counts as zero-std
    assert stats["zero_std_groups"] == 1
    with pytest.raises(ValueError, match="finite; non-finite at indices \\[1\\]"):
        group_advantages(torch.tensor([0.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="std must be one of"):
        group_advantages(torch.zeros(2), [0, 0], std="batch")
    with pytest.raises(ValueError, match="group_ids has 3"):
        group_advantages(torch.zeros(2), [0, 0, 1])


def test_near_constant_group_is_zero_not_huge():
    # floating-point means of equal values may differ from them by an ulp; such groups are still 0
    adv, stats = group_advantages(torch.tensor([0.1, 0.1, 0.1]), [0, 0, 0], eps=0.0)
    assert adv.eq(0).all() and not torch.isnan(adv).any() and stats["zero_std_groups"] == 1


def test_leave_one_out_matches_explicit_baseline():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(9, generator=g, dtype=torch.float64)
    ids = [0, 0, 0, 0, 1, 1, 2, 2, 2]  # unequal group sizes
    adv, _ = leave_one_out_advantages(rewards, ids)
    for i, gi in enumerate(ids):
        others = [rewards[j] for j, gj in enumerate(ids) if gj == gi and j != i]
        assert adv[i].item() == pytest.approx((rewards[i] - sum(others) / len(others)).item())
    sums = torch.zeros(3, dtype=torch.float64).index_add_(0, torch.tensor(ids), adv)
    assert sums.abs().max() < 1e-12
    shifted, _ = leave_one_out_advantages(rewards + 3.0, ids)  # invariant to a constant reward shift
    torch.testing.assert_close(shifted, adv)
    # K/(K-1) times the group-centred reward
    centred, _ = group_advantages(rewards, ids, std="none")
    k = torch.tensor([4, 4, 4, 4, 2, 2, 3, 3, 3], dtype=torch.float64)
    torch.testing.assert_close(adv, k / (k - 1) * centred)


def test_leave_one_out_needs_two_samples_per_group():
    with pytest.raises(ValueError, match="K >= 2"):
        leave_one_out_advantages(torch.tensor([1.0, 2.0, 3.0]), [0, 0, 1])


def test_leave_one_out_with_std_is_proportional_to_grpo():
    rewards = torch.tensor([1.0, 4.0, 2.0, 7.0])
    loo, _ = leave_one_out_advantages(rewards, [0] * 4, normalize_std=True, eps=0.0)
    grpo, _ = group_advantages(rewards, [0] * 4, eps=0.0)
    torch.testing.assert_close(loo, 4 / 3 * grpo)


def test_per_prompt_tracker_batch_fallback_then_history():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)
    # first batch: each prompt has 2 < 3 rewards -> batch statistics (mean 2.5, pop std sqrt(1.25))
    r1 = torch.tensor([1.0, 2.0, 3.0, 4.0])
    adv, _ = tracker(r1, ["p", "p", "q", "q"])
    torch.testing.assert_close(adv, (r1 - 2.5) / (1.25**0.5 + 1e-6))
    # second batch: p now holds [1, 2, 0, 4] -> its own statistics (mean 1.75, pop std sqrt(2.1875))
    r2 = torch.tensor([0.0, 4.0])
    adv, _ = tracker(r2, ["p", "p"])
    torch.testing.assert_close(adv, (r2 - 1.75) / (2.1875**0.5 + 1e-6))
    # the buffer keeps only the last 4 rewards
    tracker(torch.tensor([9.0]), ["p"])
    assert list(tracker.buffers["p"]) == [2.0, 0.0, 4.0, 9.0]


def test_per_prompt_tracker_state_round_trip():
    a = PerPromptStatTracker(buffer_size=8, min_count=2)
    a(torch.tensor([1.0, 2.0, 3.0]), ["x", "x", "y"])
    state = json.loads(json.dumps(a.state_dict()))  # JSON-serialisable
    b = PerPromptStatTracker(buffer_size=8, min_count=2)
    b.load_state_dict(state)
    r, prompts = torch.tensor([0.5, 4.0, 1.0]), ["x", "y", "y"]
    torch.testing.assert_close(a(r, prompts)[0], b(r, prompts)[0])
    with pytest.raises(ValueError, match="buffer_size mismatch"):
        PerPromptStatTracker(buffer_size=4, min_count=2).load_state_dict(state)


def test_gae_by_hand():
    # gamma 0.5, lam 0.5, one episode of 2 steps ending at t=1:
    # delta_1 = 1 + 0 - 0.5 = 0.5 (done, no bootstrap); A_1 = 0.5
    # delta_0 = 0 + 0.5 * 0.5 - 0.0 = 0.25; A_0 = 0.25 + 0.25 * 0.5 = 0.375
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.0, 0.5]])
    dones = torch.tensor([[0.0, 1.0]])
    adv, ret = gae(rewards, values, dones, torch.tensor([100.0]), gamma=0.5, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0.375, 0.5])
    assert ret.tolist()[0] == pytest.approx([0.375, 1.0])


def test_gae_limits():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    dones, nxt = torch.zeros(3, 5), torch.randn(3, generator=g)
    # lam = 1, gamma = 1: returns are the undiscounted reward-to-go plus the bootstrap value
    _, ret = gae(rewards, values, dones, nxt, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, rewards.flip(-1).cumsum(-1).flip(-1) + nxt[:, None])
    # lam = 0: one-step TD errors
    adv, _ = gae(rewards, values, dones, nxt, gamma=0.9, lam=0.0)
    following = torch.cat([values[:, 1:], nxt[:, None]], dim=1)
    torch.testing.assert_close(adv, rewards + 0.9 * following - values)
    with pytest.raises(ValueError, match="share a"):
        gae(rewards, values[:, :4], dones, nxt)


def test_registry_and_group_index():
    assert {"group", "leave_one_out", "per_prompt", "gae"} <= set(ADVANTAGES.names())
    inverse, n = group_index(["b", "a", "b"])
    assert inverse.tolist() == [0, 1, 0] and n == 2
    inverse, n = group_index(torch.tensor([7, 3, 7]))
    assert inverse.tolist() == [1, 0, 1] and n == 2


def test_sas_first_visit_is_the_group_z_score_and_later_visits_blend_history():
    from flowrl.core import SmoothAdvantageStandardizer

    sas = SmoothAdvantageStandardizer()
    prompts = ["a"] * 4 + ["b"] * 4
    r1 = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv, stats = sas(r1, prompts)
    a = torch.tensor([1.0, 0.0, 0.0, 0.0])
    z = (a - 0.25) / a.std()  # sample std, as DCPO's code
    torch.testing.assert_close(adv[:4], z)
    assert stats["zero_std_groups"] == 0
    # second visit of "a": all rewards 1 (the group z-score would be 0); hand-computed pool:
    # mu_tot = (0.25 + 1) / 2, sigma_tot^2 = (sigma_1^2 + 0 + (1/2)(1 - 0.25)^2) / 2
    adv2, stats2 = sas(torch.ones(4), ["a"] * 4)
    var1 = float(a.var())
    mu_tot, sigma_tot = 0.625, math.sqrt((var1 + 0.5 * 0.75**2) / 2)
    a_tot = (1 - mu_tot) / sigma_tot
    # A_new = 0: SA_new = A_tot / 2, SA_tot = A_tot / 2 (i = 2): both equal
    torch.testing.assert_close(adv2, torch.full((4,), a_tot / 2))
    assert stats2["zero_std_groups"] == 1
    # third visit with spread: the smaller-magnitude blend of (2/3 A_new + 1/3 A_tot) and (1/3 A_new + 2/3 A_tot)
    r3 = torch.tensor([1.0, 1.0, 0.0, 1.0])
    adv3, _ = sas(r3, ["a"] * 4)
    mu_new, s_new = 0.75, float(r3.std())
    mu3 = (2 * mu_tot + mu_new) / 3
    s3 = math.sqrt((2 * sigma_tot**2 + s_new**2 + (2 / 3) * (mu_new - mu_tot) ** 2) / 3)
    a_new, a_t = (r3 - mu_new) / s_new, (r3 - mu3) / s3
    sa_new, sa_tot = 2 / 3 * a_new + a_t / 3, a_new / 3 + 2 / 3 * a_t
    torch.testing.assert_close(adv3, torch.where(sa_new.abs() < sa_tot.abs(), sa_new, sa_tot))
    assert sas.prompts["a"][0] == 3 and sas.prompts["b"][0] == 1


def test_sas_state_round_trips_through_json_and_needs_groups_of_two():
    import json

    from flowrl.core import SmoothAdvantageStandardizer

    sas = SmoothAdvantageStandardizer()
    sas(torch.tensor([0.2, 0.9, 0.4]), ["p"] * 3)
    restored = SmoothAdvantageStandardizer()
    restored.load_state_dict(json.loads(json.dumps(sas.state_dict())))
    r = torch.tensor([0.5, 0.1, 0.7])
    torch.testing.assert_close(restored(r, ["p"] * 3)[0], sas(r, ["p"] * 3)[0])
    with pytest.raises(ValueError, match="at least 2 samples"):
        sas(torch.tensor([1.0, 0.0]), ["x", "y"])
