import pytest
import torch

from flowrl.core import STEP_SELECTIONS, STEP_WEIGHTINGS, select_steps, step_weights, steps_to_mask
from flowrl.image import StepConfig


def test_selections():
    assert select_steps("all", 4, 2).tolist() == [[0, 1, 2, 3]] * 2
    assert select_steps("first_fraction", 10, 1, fraction=0.99).tolist() == [list(range(9))]  # Flow-GRPO 9/10
    assert select_steps("window", 10, 1, start=2, end=5).tolist() == [[2, 3, 4]]
    a = select_steps("random", 10, 5, k=3, generator=torch.Generator().manual_seed(0))
    b = select_steps("random", 10, 5, k=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (5, 3)
    assert all(len(set(row)) == 3 and row == sorted(row) for row in a.tolist())
    assert len({tuple(r) for r in a.tolist()}) > 1  # differs per sample
    mask = steps_to_mask(torch.tensor([[0, 2], [1, 3]]), 4)
    assert mask.tolist() == [[True, False, True, False], [False, True, False, True]]


def test_selection_errors():
    with pytest.raises(ValueError, match="unknown step selection 'last'"):
        select_steps("last", 4, 1)
    with pytest.raises(ValueError, match="unknown hyper-parameter 'frac' for step selection 'first_fraction'"):
        select_steps("first_fraction", 4, 1, frac=0.5)
    with pytest.raises(ValueError, match="window must satisfy"):
        select_steps("window", 4, 1, start=3, end=2)
    with pytest.raises(ValueError, match="k must be in"):
        select_steps("random", 4, 1, k=5)


def test_weightings():
    sigmas = torch.tensor([1.0, 0.75, 0.25, 0.0])
    assert step_weights("uniform", sigmas).tolist() == [1.0, 1.0, 1.0]
    assert step_weights("inv_dt", sigmas).tolist() == pytest.approx([4.0, 2.0, 4.0])
    w = step_weights("inv_dt", sigmas, normalize=True)
    assert w.mean().item() == pytest.approx(1.0) and w.tolist() == pytest.approx([1.2, 0.6, 1.2])
    # Min-SNR (arXiv:2303.09556) with SNR = ((1-s)/s)^2 at s = 1, 0.75, 0.25: 0, 1/9, 9 and gamma = 5
    # epsilon form min(SNR, 5) / SNR: 1 (the limit at SNR = 0: the first step trains), 1, 5/9
    assert step_weights("min_snr", sigmas).tolist() == pytest.approx([1.0, 1.0, 5 / 9])
    # v form min(SNR, 5) / (SNR + 1): 0, (1/9) / (10/9) = 0.1, 5/10
    assert step_weights("min_snr_v", sigmas).tolist() == pytest.approx([0.0, 0.1, 0.5])
    assert step_weights("min_snr", sigmas, gamma=20.0).tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert step_weights("sigma", sigmas).tolist() == [1.0, 0.75, 0.25]
    # the flow-SDE step std at a = 1: sqrt(1 / (1 - 0.75)) sqrt(0.25) = 1 (t = 1 uses the next level),
    # sqrt(0.75 / 0.25) sqrt(0.5) = sqrt(1.5), sqrt(0.25 / 0.75) sqrt(0.25) = 1 / sqrt(12); the inverse inverts them
    assert step_weights("noise_aware", sigmas).tolist() == pytest.approx([1.0, 1.5**0.5, 12**-0.5])
    assert step_weights("inv_noise_aware", sigmas).tolist() == pytest.approx([1.0, 1.5**-0.5, 12**0.5])
    assert step_weights(lambda s: s[1:] + 1, sigmas).tolist() == [1.75, 1.25, 1.0]
    # per-sample sigmas
    assert step_weights("inv_dt", sigmas.repeat(2, 1)).shape == (2, 3)


def test_weighting_errors():
    with pytest.raises(ValueError, match="dt = 0"):
        step_weights("inv_dt", torch.tensor([1.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="returned shape"):
        step_weights(lambda s: s, torch.tensor([1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="negative or non-finite"):
        step_weights(lambda s: -s[1:], torch.tensor([1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="unknown step weighting"):
        step_weights("snr", torch.tensor([1.0, 0.0]))


def test_registries_have_descriptions():
    for reg in (STEP_SELECTIONS, STEP_WEIGHTINGS):
        assert all(reg.describe().values())


def test_progressive_sde_window_moves_every_n_epochs_and_wraps():
    from flowrl.core import sde_window_at

    # MixGRPO's trace at T = 10, span [0, 8): start = (epoch // every) mod 8, the window cut at the span's end
    trace = [sde_window_at("progressive", e, 10, size=4, every=2, span=(0, 8)) for e in range(20)]
    assert trace[:6] == [(0, 4), (0, 4), (1, 5), (1, 5), (2, 6), (2, 6)]
    assert trace[10] == (5, 8) and trace[14] == (7, 8)  # truncated, never empty
    assert trace[16] == (0, 4)  # wrapped around
    assert sde_window_at("progressive", 7, 10, size=4, stride=0, span=(2, 8)) == (2, 6)  # frozen (Flash*)
    assert sde_window_at("progressive", 3, 10, size=2, stride=3) == (0, 2)  # starts 0, 3, 6 over [0, 9)
    assert sde_window_at("fixed", 5, 10, window=(1, 3)) == (1, 3) and sde_window_at("fixed", 5, 10) is None


def test_random_sde_window_is_uniform_in_its_span_and_seeded():
    from flowrl.core import sde_window_at

    draws = [
        sde_window_at("random", 0, 10, size=3, span=(0, 5), generator=torch.Generator().manual_seed(s))
        for s in range(200)
    ]
    assert {start for start, _ in draws} == {0, 1, 2} and all(end - start == 3 for start, end in draws)
    again = sde_window_at("random", 0, 10, size=3, span=(0, 5), generator=torch.Generator().manual_seed(7))
    assert again == draws[7]
    with pytest.raises(ValueError, match="does not fit"):
        sde_window_at("random", 0, 10, size=6, span=(0, 5))
    with pytest.raises(ValueError, match="sde window schedule.*'sliding'.*progressive"):
        sde_window_at("sliding", 0, 10)
    with pytest.raises(ValueError, match="span"):
        sde_window_at("progressive", 0, 10, span=(4, 12))


def doubled_last(sigmas, *, factor=2.0):
    """A user's weighting: 1 everywhere, `factor` on the last step."""
    w = torch.ones_like(sigmas[..., :-1])
    w[..., -1] = factor
    return w


def test_early_and_late_split_the_schedule_at_the_boundary():
    sigmas = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])
    assert step_weights("early", sigmas).tolist() == [1, 1, 1, 0, 0]
    assert step_weights("late", sigmas).tolist() == [0, 0, 0, 1, 1]
    assert step_weights("early", sigmas, boundary=0.7).tolist() == [1, 1, 0, 0, 0]
    assert (step_weights("early", sigmas) + step_weights("late", sigmas)).eq(1).all()


def test_a_user_weighting_by_dotted_path_with_its_kwargs():
    path = "tests.core.test_steps:doubled_last"
    sigmas = torch.linspace(1, 0, 5)
    assert step_weights(path, sigmas, factor=3.0).tolist() == [1, 1, 1, 3]
    assert StepConfig(weighting=path, weighting_kwargs={"factor": 3.0}).weighting == path
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        StepConfig(weighting="tests.core.test_steps:nope")
    with pytest.raises(ValueError, match="unknown hyper-parameter 'gama'.*Did you mean 'gamma'"):
        StepConfig(weighting="min_snr", weighting_kwargs={"gama": 1.0})
    with pytest.raises(ValueError, match="unknown step weighting 'erly'"):
        StepConfig(weighting="erly")
