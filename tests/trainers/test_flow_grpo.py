import pytest
import torch

from flowrl.checkpoint import CheckpointError

from .conftest import make_trainer, tiny_config


def test_per_prompt_advantages_use_the_batch_then_each_prompts_history(tiny_world, tmp_path):
    overrides = ["advantage.estimator=per_prompt", "advantage.buffer_size=3", "advantage.min_count=3"]
    config = tiny_config("flow_grpo", tmp_path, overrides=overrides)
    trainer = make_trainer(tiny_world, config)
    r = {"digits_alignment": torch.tensor([1.0, 3.0, 0.0, 4.0])}
    adv, _ = trainer.algorithm.estimator(r, torch.tensor([0, 0, 1, 1]), ["a", "a", "b", "b"])
    # two rewards per prompt < min_count 3: the batch's population statistics, mean 2, std sqrt(2.5); eps is DDPO's
    # tracker's 1e-6 unless advantage.eps is set
    assert trainer.algorithm.estimator.tracker.eps == 1e-6
    assert torch.allclose(adv, (r["digits_alignment"] - 2.0) / (2.5**0.5 + 1e-6))
    adv, _ = trainer.algorithm.estimator(
        {"digits_alignment": torch.tensor([5.0, 8.0])}, torch.tensor([0, 0]), ["a", "b"]
    )
    # buffers now a: [1, 3, 5] (mean 3, std sqrt(8/3)) and b: [0, 4, 8] (mean 4, std sqrt(32/3))
    expected = torch.tensor([(5 - 3) / ((8 / 3) ** 0.5 + 1e-6), (8 - 4) / ((32 / 3) ** 0.5 + 1e-6)])
    assert torch.allclose(adv, expected)
    assert list(trainer.algorithm.estimator.tracker.buffers["a"]) == [1.0, 3.0, 5.0]


def test_per_prompt_tracker_is_checkpointed_and_resume_is_exact(tiny_world, tmp_path):
    args = ["advantage.estimator=per_prompt", "advantage.buffer_size=8", "advantage.min_count=4"]
    straight = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path / "a", overrides=[*args, "run.epochs=3"]))
    straight.train()
    make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path / "b", overrides=[*args, "run.epochs=2"])).train()
    resumed = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path / "b", overrides=[*args, "run.epochs=3"]))
    resumed.train(resume=True)
    assert resumed.algorithm.estimator.tracker.state_dict() == straight.algorithm.estimator.tracker.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(straight.params, resumed.params))
    # a group-advantage run cannot silently resume a tracker run's checkpoint the other way round
    other = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path / "c", overrides=[*args, "run.epochs=1"]))
    state, tensors = straight.state_dict()
    del state["advantage"]
    with pytest.raises(CheckpointError, match="per-prompt tracker"):
        other.load_state_dict(state, tensors)


def test_per_prompt_config_errors(tmp_path):
    with pytest.raises(ValueError, match="reward_aggregation must be 'sum'"):
        tiny_config("flow_grpo", tmp_path, overrides=["advantage.estimator=per_prompt"], reward_aggregation="gdpo")
    with pytest.raises(ValueError, match="min_count <= buffer_size"):
        tiny_config("flow_grpo", tmp_path, overrides=["advantage.estimator=per_prompt", "advantage.min_count=32"])
    with pytest.raises(ValueError, match="unknown advantage estimator 'running'"):
        tiny_config("flow_grpo", tmp_path, overrides=["advantage.estimator=running"])
    with pytest.raises(ValueError, match="advantage is a section: write advantage.estimator: per_prompt"):
        tiny_config("flow_grpo", tmp_path, overrides=["advantage=per_prompt"])
    with pytest.raises(ValueError, match=r"'tracker_buffer' was renamed: use advantage.buffer_size"):
        tiny_config("flow_grpo", tmp_path, overrides=["tracker_buffer=3"])
