"""Tiny trainer configs on the tiny digits world (`tests/conftest.py`)."""

from flowrl import rewards
from flowrl.trainers import build_trainer, load_config


PPO_TRAINERS = ("flow_grpo", "grpo_guard", "loop")


def tiny_config(trainer="grpo_guard", tmp_path=None, overrides=(), **top):
    """A 2-epoch, 4-prompt x 4-sample, 4-step digits config (clip range 1e-2 for the PPO-family trainers)."""
    data = {
        "trainer": trainer,
        "sampling": {"num_steps": 4, "guidance_scale": 2.0, "forward_batch_size": 8},
        "prompts": {"prompts_per_epoch": 4, "group_size": 4},
        "eval": {"every": 1, "samples_per_prompt": 2, "max_prompts": 4, "metrics": ["digits_gold"]},
        "optim": {"lr": 1e-3, "gradient_accumulation": 2},
        "run": {"epochs": 2, "save_every": 1, "images_every": 1, "log_with": [], "output_dir": str(tmp_path)},
    }
    if trainer in PPO_TRAINERS:
        data["objective"] = {"clip_eps_low": 1e-2}
    return load_config({**data, **top}, list(overrides))


def make_trainer(world, config, reward_fns=None, **kwargs):
    """A trainer on a fresh copy of the tiny world's model and its classifiers."""
    fns = reward_fns or {r.name: rewards.get(r.name, classifiers=world.classifiers) for r in config.rewards}
    evals = {name: rewards.get(name, classifiers=world.classifiers) for name in config.eval.metrics}
    policy = world.policy(forward_batch_size=config.sampling.forward_batch_size)
    return build_trainer(config, policy=policy, reward_fns=fns, eval_fns=evals, **kwargs)


def train_and_resume(world, tmp_path, name, overrides=()):
    """`name` trained 2 epochs straight and 1 + 1 epochs with a resume; asserts the weights and the per-epoch
    rewards are identical and returns `(straight trainer, resumed trainer, the straight run's rows)`."""
    import torch

    def run(folder, epochs, resume=False):
        extra = [*overrides, f"run.epochs={epochs}", "run.images_every=0"]
        trainer = make_trainer(world, tiny_config(name, tmp_path / folder, overrides=extra))
        trainer.train(resume=resume)
        return trainer

    straight = run("a", 2)
    run("b", 1)
    resumed = run("b", 2, resume=True)
    for p, q in zip(straight.policy.trainable_parameters(), resumed.policy.trainable_parameters()):
        assert torch.equal(p, q)
    rows = training_rows(tmp_path / "a")
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in training_rows(tmp_path / "b")]
    return straight, resumed, rows


def training_rows(run_dir):
    """The `metrics.jsonl` rows of the training epochs (the file starts with the epoch-0 evaluation row)."""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["epoch"] == 0 and "reward/mean" not in rows[0]
    return rows[1:]
