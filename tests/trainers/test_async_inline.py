"""`asynchrony.backend: inline`: the asynchronous mode's staleness in one process, deterministic. Staleness 0 is
the synchronous run; staleness k samples epoch e with exactly the weights of version e - k (what the learner
published then), whatever the learner did since; algorithms that sample with a lagged copy (DiffusionNFT, DGPO)
get it published too."""

import json
import os

import pytest
import torch

from flowrl.trainers import build_trainer
from tests.conftest import DIGITS_BASE, tiny_config


INLINE = ["run.mode=async", "asynchrony.backend=inline", "run.log_with=[]"]


def _rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.algorithm.trained_module().state_dict().items()}


def _same_run(a, b):
    (rows_a, weights_a), (rows_b, weights_b) = a, b

    def numbers(rows):  # without the clocks, the memory readings and the async counters
        return [
            {
                k: v
                for k, v in r.items()
                if not (k.startswith(("time", "async/", "memory/")) or k.endswith("_s") or "throughput" in k)
            }
            for r in rows
        ]

    assert numbers(rows_a) == numbers(rows_b)
    for name, value in weights_b.items():
        assert torch.equal(weights_a[name], value), name


def _train(trainer_name, folder, overrides):
    trainer = build_trainer(tiny_config(trainer_name, folder, overrides=["run.log_with=[]", *DIGITS_BASE, *overrides]))
    trainer.train()
    return _rows(folder), _weights(trainer)


@pytest.mark.parametrize(
    "trainer_name, epochs, extra",
    [
        ("flow_grpo", 2, []),
        ("diffusion_nft", 2, ["num_draws=2"]),  # samples with its old policy: the lagged copy travels with the weights
        # DGPO samples with its lagged copy after `old_sampling_after` steps (a count the worker is told); the copy
        # first differs from the policy after its second update
        ("dgpo", 3, ["num_draws=2", "trunc_steps=2", "old_sampling_after=1"]),
    ],
)
def test_staleness_zero_is_the_synchronous_run(tmp_path, trainer_name, epochs, extra):
    synchronous = _train(trainer_name, tmp_path / "sync", [f"run.epochs={epochs}", *extra])
    inline = _train(
        trainer_name, tmp_path / "inline", [*INLINE, f"run.epochs={epochs}", "asynchrony.max_staleness=0", *extra]
    )
    assert [r["async/staleness"] for r in inline[0][1:]] == [0.0] * epochs
    _same_run(inline, synchronous)


def test_staleness_k_samples_with_the_weights_published_k_versions_before(tmp_path):
    """Epoch 1 at staleness 1 is sampled with version 0 whatever the learner's weights became: the batch equals the
    synchronous collector's at the initial weights; at staleness 0 it does not."""
    reference = build_trainer(tiny_config("flow_grpo", tmp_path / "ref", overrides=["run.log_with=[]", *DIGITS_BASE]))
    expected = reference.collector.collect(1).data
    for staleness in (1, 0):
        trainer = build_trainer(
            tiny_config(
                "flow_grpo",
                tmp_path / str(staleness),
                overrides=[*INLINE, *DIGITS_BASE, f"asynchrony.max_staleness={staleness}"],
            )
        )
        trainer.collector.collect(0)
        with torch.no_grad():  # the learner's update, made large: version 1 samples visibly otherwise
            for p in trainer.algorithm.trained_module().parameters():
                p.add_(0.05 * torch.randn_like(p))
        trainer.collector.updated(0)
        got = trainer.collector.collect(1)
        assert got.times["async/staleness"] == float(staleness)
        same = torch.equal(got.data.log_probs, expected.log_probs) and torch.equal(got.data.latents, expected.latents)
        assert same == (staleness == 1), staleness
        trainer.collector.close()


@pytest.mark.parametrize(
    "sync_every, max_staleness, expected",
    [
        (1, 2, [0.0, 1.0, 2.0, 2.0]),  # always at the bound once the run has that many versions
        (2, 1, [0.0, 1.0, 0.0, 1.0]),  # versions 0 and 2 published: epoch 2 takes the fresh one
    ],
)
def test_staleness_follows_the_bound_and_the_publishing_cadence(tmp_path, sync_every, max_staleness, expected):
    overrides = [
        *INLINE,
        "run.epochs=4",
        f"asynchrony.sync_every={sync_every}",
        f"asynchrony.max_staleness={max_staleness}",
    ]
    rows, _ = _train("flow_grpo", tmp_path, overrides)
    assert [r["async/staleness"] for r in rows[1:]] == expected


def test_a_killed_worker_s_scratch_folder_goes_when_the_next_worker_starts(tmp_path, monkeypatch):
    """A worker killed never runs `close`: the next one started on the machine removes the scratch folders of workers
    whose process has ended, and no other (a running worker's, an older name without a process id)."""
    import subprocess
    import sys

    from flowrl.run.rollout_worker import SCRATCH, scratch_folder

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(ended.stdout), os.getppid()
    stale = tmp_path / f"{SCRATCH}0-{dead}-abc123_x"
    running = tmp_path / f"{SCRATCH}1-{alive}-def456"
    older = tmp_path / f"{SCRATCH}2-q1w2e3r4"
    for folder in (stale, running, older):
        (folder / "checkpoints").mkdir(parents=True)
    new = scratch_folder(3)
    assert not stale.exists() and running.is_dir() and older.is_dir()
    assert new.is_dir() and new.name.startswith(f"{SCRATCH}3-{os.getpid()}-")
