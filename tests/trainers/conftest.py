"""Trainers on the tiny digits world (`tests/conftest.py`: `tiny_world`, `tiny_config`)."""

from flowrl import rewards
from flowrl.trainers import build_trainer
from tests.conftest import PPO_TRAINERS, tiny_config  # noqa: F401  (re-exported for the trainer tests)


def make_trainer(world, config, reward_fns=None, **kwargs):
    """A trainer on a fresh copy of the tiny world's model and its classifiers."""
    fns = reward_fns or {r.name: rewards.get(r.name, classifiers=world.classifiers) for r in config.rewards}
    evals = {name: rewards.get(name, classifiers=world.classifiers) for name in config.eval.metrics}
    policy = world.policy(forward_batch_size=config.batch.micro_batch_size)
    return build_trainer(config, policy=policy, reward_fns=fns, eval_fns=evals, **kwargs)


def train_and_resume(world, tmp_path, name, overrides=()):
    """`name` trained 2 epochs straight and 1 + 1 epochs with a resume; asserts the weights and the per-epoch
    rewards are identical and returns `(straight trainer, resumed trainer, the straight run's rows)`."""
    import torch

    def run(folder, epochs, resume=False):
        extra = [*overrides, f"run.epochs={epochs}", "run.samples_every=0"]
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


def update_batch(rollout, advantages=None):
    """`rollout` (one process's whole batch) as an `UpdateBatch` with `advantages` (default 0), every row trained."""
    import torch

    from flowrl.run.scheduler import UpdateBatch

    n = len(rollout)
    advantages = torch.zeros(n) if advantages is None else advantages
    return UpdateBatch(
        data=rollout, rows=torch.arange(n), size=n, advantages=advantages, trainable=torch.ones(n, dtype=torch.bool)
    )


def elements(trainer, rollout, epoch=0):
    """The `[B, k]` elements the trainer's algorithm trains of `rollout` (this process's whole batch) at `epoch`."""
    return trainer.algorithm.elements(update_batch(rollout), epoch)[0]


def micro_batch(trainer, rollout, advantages=None, epoch=0, index=None):
    """All of `rollout`'s rows as one micro-batch, with the elements the algorithm trains at `epoch` (or `index`)."""
    import dataclasses

    import torch

    mb = trainer.scheduler.micro_batch(update_batch(rollout, advantages), epoch=epoch)
    if index is not None:
        mb = dataclasses.replace(mb, index=index, valid=torch.ones(index.shape, dtype=torch.bool))
    return mb


def micro_loss(trainer, rollout, advantages=None, epoch=0, index=None):
    """`(loss with its graph, metrics)` of all of `rollout`'s rows as one micro-batch (no backward)."""
    return trainer.scheduler.loss(micro_batch(trainer, rollout, advantages, epoch, index))


def collected(rollout):
    """`rollout` as a collected batch that is one process's whole epoch."""
    import torch

    from flowrl.policies.rollout import Collected

    return Collected(data=rollout, rows=torch.arange(len(rollout)), size=len(rollout))


def brightness(images, prompts, **_):
    """A reward that needs no model: each image's mean pixel value (for trainers on the tiny pipelines)."""
    return images.float().mean(dim=(1, 2, 3))


def assert_grads_close(grads, expected_grads, rtol=1e-3, atol=1e-4):
    """Each parameter's gradient equals the direct implementation's (`atol` relative to the largest expected entry);
    a parameter the direct loss does not reach gets no gradient, or zeros."""
    import torch

    scale = max(float(e.abs().max()) for e in expected_grads if e is not None)
    for g, e in zip(grads, expected_grads, strict=True):
        if e is None:
            assert g is None or torch.all(g == 0)
        else:
            torch.testing.assert_close(g, e, rtol=rtol, atol=atol * scale)
