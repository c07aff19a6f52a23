"""The asynchronous mode's pieces for a learner group and placement, in one process: which GPUs a run's own Ray cluster
may give its rollout workers, what a worker drops of the launcher's environment, each learner's share of a batch,
and what a publication holds and weighs (`async/publish_bytes`). The runs themselves: tests/test_learner_group.py
and tests/trainers/test_async_cluster.py (the `distributed` tier)."""

import dataclasses
from pathlib import Path

import pytest
import torch

from flowrl.policies.rollout import Collected, Record, per_sample
from flowrl.run import wire
from flowrl.run.async_rollouts import publication
from flowrl.run.learner_group import cluster_gpus, leave_learner_group, share, visible_gpus
from flowrl.runtime import Processes
from flowrl.trainers import build_trainer, load_config


def test_a_runs_own_cluster_keeps_the_learners_gpus_unless_asked_to_share():
    # torchrun's local ranks train on the first visible GPUs; the workers get the rest
    assert cluster_gpus(["0", "1", "2", "3"], learner_gpus=2, worker_gpus=1, share_gpus=False) == ["2", "3"]
    assert cluster_gpus(["0", "1", "2", "3"], learner_gpus=2, worker_gpus=1, share_gpus=True) == ["0", "1", "2", "3"]
    assert cluster_gpus(["0"], learner_gpus=1, worker_gpus=0.5, share_gpus=True) == ["0"]  # one GPU, shared
    assert cluster_gpus(["0"], learner_gpus=1, worker_gpus=0, share_gpus=False) == []  # CPU workers: nothing to give
    assert cluster_gpus([], learner_gpus=0, worker_gpus=0, share_gpus=False) == []
    shared = r"^asynchrony.worker_gpus is 0.5 but the 1 learner .*asynchrony.share_gpus: true"
    with pytest.raises(ValueError, match=shared):
        cluster_gpus(["0"], learner_gpus=1, worker_gpus=0.5, share_gpus=False)
    with pytest.raises(ValueError, match=r"^asynchrony.worker_gpus is 1 but this machine has no GPU"):
        cluster_gpus([], learner_gpus=0, worker_gpus=1, share_gpus=False)
    # the learners' view of the machine: CUDA_VISIBLE_DEVICES when set (its names, in its order)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}) == ["3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert cluster_gpus(visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}), 1, 1, False) == ["5"]


def test_a_ray_worker_leaves_the_learner_groups_launcher_variables():
    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
        "GROUP_RANK": "0",
        "OMP_NUM_THREADS": "1",
        "FLOWRL_CACHE": "/c",
    }
    leave_learner_group(env)
    assert env == {"OMP_NUM_THREADS": "1", "FLOWRL_CACHE": "/c"}


@dataclasses.dataclass
class _Rows(Record):
    x: torch.Tensor = per_sample()


class _Group:
    """accelerate's view of process `process_index` of `num_processes` (what `Processes` reads)."""

    def __init__(self, rank: int, world: int):
        self.process_index, self.num_processes, self.is_main_process = rank, world, rank == 0
        self.device = torch.device("cpu")


def test_each_learner_keeps_its_contiguous_share_of_a_workers_batch():
    batch = Collected(
        data=_Rows(x=torch.arange(8.0) * 10),
        rows=torch.arange(8),
        size=8,
        prompts=list("abcdefgh"),
        rewards={"r": torch.arange(8.0)},
    )
    mine = share(batch, Processes(_Group(1, 2)))
    assert mine.data.x.tolist() == [40.0, 50.0, 60.0, 70.0] and mine.rows.tolist() == [4, 5, 6, 7]
    assert mine.size == 8 and mine.prompts == list("abcdefgh") and mine.rewards["r"].tolist() == list(range(8))
    assert share(batch, Processes(_Group(0, 1))) is batch
    with pytest.raises(ValueError, match="8 samples per epoch do not split over 3 processes"):
        share(batch, Processes(_Group(0, 3)))


def test_a_lora_run_publishes_its_adapters_and_the_metric_is_their_size(tmp_path):
    """A LoRA run sends the workers its adapters only: the blob decodes to the trainable parameters, exactly, and
    weighs their bytes plus the blob's header; `async/publish_bytes` is the size of what was published."""
    config = Path(__file__).resolve().parents[2] / "configs" / "sd35m" / "tiny.yaml"
    trainer = build_trainer(
        load_config(
            config, [f"run.output_dir={tmp_path}", "run.mode=async", "asynchrony.backend=inline", "run.epochs=3"]
        )
    )
    trained = {n: p for n, p in trainer.algorithm.trained_module().named_parameters() if p.requires_grad}
    assert trained and all("lora" in name for name in trained)
    blob = publication(trainer)
    value, _ = wire.decode(blob)
    assert value["weights"].keys() == trained.keys()
    for name, p in trained.items():
        assert torch.equal(value["weights"][name], p.detach())
    adapters = sum(p.numel() * p.element_size() for p in trained.values())
    assert adapters < len(blob) < adapters + 65536
    collector = trainer.collector
    first = collector.updated(0)
    assert first["async/publish_bytes"] == len(blob) and first["async/publish_s"] > 0
    assert collector.updated(1)["async/publish_bytes"] == len(blob)  # every update (sync_every: 1)...
    assert collector.updated(2) == {"async/publish_s": 0.0, "async/publish_bytes": 0.0}  # ...but after the last
