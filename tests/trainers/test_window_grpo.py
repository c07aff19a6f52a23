"""The Flow-GRPO presets that move the SDE window (MixGRPO, Flow-GRPO-Fast) or subsample steps (DanceGRPO)."""

import pytest

from flowrl.trainers import TRAINERS, load_config

from .conftest import elements, make_trainer, tiny_config, train_and_resume


PRESETS = {
    # the presets' own settings scaled to the tiny world's 4 steps
    "mix_grpo": ["sampling.window_size=2", "sampling.window_every=1", "objective.clip_eps_low=1e-2"],
    "mix_grpo_flash": [
        "sampling.window_size=1",
        "sampling.window_every=1",
        "sampling.post_window_ratio=0.5",
        "objective.clip_eps_low=1e-2",
    ],
    "flow_grpo_fast": ["sampling.window_size=2", "sampling.window_span=[0, 3]", "objective.clip_eps_low=1e-2"],
    "dance_grpo": ["sampling.num_steps=4", "sampling.sde_window=[0, 3]", "steps.k=2", "objective.clip_eps_low=1e-2"],
}


def test_presets_keep_the_papers_settings():
    mix, flash, fast, dance = (load_config({"trainer": name}) for name in PRESETS)
    assert (mix.sampling.sde_window_schedule, mix.sampling.window_size, mix.sampling.window_every) == (
        "progressive",
        4,
        25,
    )
    assert mix.steps.selection == "all" and mix.advantage.unbiased and mix.advantage.eps == 1e-8
    assert (flash.sampling.window_every, flash.sampling.post_window_solver, flash.sampling.post_window_ratio) == (
        20,
        "dpm_solver_2m",
        0.4,
    )
    assert mix.sampling.post_window_solver == "euler" and flash.sampling.init_same_noise
    assert (fast.sampling.sampler, fast.sampling.noise_level, fast.sampling.guidance_scale) == ("cps", 0.8, 1.0)
    assert (fast.sampling.sde_window_schedule, fast.sampling.window_size, fast.sampling.window_span) == (
        "random",
        3,
        (0, 5),
    )
    assert fast.objective.clip_eps_low == 1e-5
    assert (dance.sampling.sampler, dance.sampling.noise_level, dance.sampling.num_steps) == ("dance_sde", 0.3, 16)
    # DanceGRPO's train_grpo_flux.py (XueZeyue/DanceGRPO @ 15cc71d, l. 506-519 and 570): 16 sampling steps, the
    # samples keep `[:, :-1]` of the 16 transitions (the last, to sigma 0, is never trained) and train
    # int(15 * 0.6) = 9 of the 15 left in a random order: 9 of 15, not 9 of 16 with the last
    assert dance.sampling.sde_window == (0, 15) and (dance.steps.selection, dance.steps.k) == ("random", 9)
    assert all(name in TRAINERS for name in PRESETS)


def test_mix_grpo_rollouts_are_stochastic_only_inside_the_moving_window(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, tiny_config("mix_grpo", tmp_path, overrides=PRESETS["mix_grpo"]))
    for epoch, window in enumerate([(0, 2), (1, 3), (2, 3), (0, 2)]):  # span [0, 3): starts 0, 1, 2, then wrap
        assert trainer.collector.sampler.window(epoch) == window
        rollout, _, _ = trainer.collector.sample(epoch)
        assert rollout.sde_steps.tolist() == list(range(*window))
        assert elements(trainer, rollout, epoch)[0].tolist() == list(range(*window))
        # outside the window the step is the deterministic Euler step x' = x + dt v: it has no log-prob
        assert rollout.sde_mask.tolist() == [window[0] <= t < window[1] for t in range(4)]


def test_mix_grpo_flash_samples_fewer_steps_after_the_window(tiny_world, tmp_path):
    # 4 steps, a 1-step window moving over [0, 3): after window [s, s + 1) the 4 - s - 1 Euler steps become
    # max(int((4 - s) * 0.5), 2) - 1 = 1 DPM-Solver++(2M) step to sigma 0; only the window step is trained
    trainer = make_trainer(tiny_world, tiny_config("mix_grpo_flash", tmp_path, overrides=PRESETS["mix_grpo_flash"]))
    for epoch, start in enumerate([0, 1, 2]):
        rollout, _, _ = trainer.collector.sample(epoch)
        assert rollout.num_steps == start + 2 and rollout.sigmas[-1] == 0
        assert rollout.sde_mask.tolist() == [t == start for t in range(start + 2)]
        assert elements(trainer, rollout, epoch)[0].tolist() == [start]


def test_flow_grpo_fast_draws_its_window_per_epoch_the_same_on_resume(tiny_world, tmp_path):
    config = tiny_config("flow_grpo_fast", tmp_path, overrides=PRESETS["flow_grpo_fast"])
    trainer = make_trainer(tiny_world, config)
    windows = [trainer.collector.sampler.window(e) for e in range(12)]
    assert {w for w in windows} <= {(0, 2), (1, 3)} and len(set(windows)) == 2
    assert windows == [make_trainer(tiny_world, config).collector.sampler.window(e) for e in range(12)]


@pytest.mark.parametrize("name", list(PRESETS))
def test_two_epochs_train_and_resume_exactly(tiny_world, tmp_path, name):
    _, _, rows = train_and_resume(tiny_world, tmp_path, name, PRESETS[name])
    assert all(r["clipfrac"] >= 0 for r in rows)
