"""Many processes equal one: `torchrun --nproc_per_node 2` on CPUs forms one gloo group of two, and a 2-process
digits run trains like one process with the same global batch (docs/distributed.md)."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from .conftest import TINY_DIGITS_RUN


RUN = {"epochs": 2, "save_every": 1, "images_every": 0, "log_with": [], "threads": 1}
"""Two epochs, a checkpoint after each, one thread per process (two processes on two cores)."""

TRAINERS = {
    "flow_grpo": {"trainer": "flow_grpo"},
    "grpo_guard": {"trainer": "grpo_guard"},
    "find": {"trainer": "find", "sampling": {"sampler": "ode"}},
    "dpok": {"trainer": "dpok", "buffer_size": 48, "policy_steps": 2, "value_steps": 2, "prompts": {"group_size": 1},
             "per_process": {"policy_batch_size": 8, "value_batch_size": 16}},
}  # fmt: skip
"""Each trainer's changes to the tiny digits run; `per_process` sizes are divided by the process count."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A digits cache for this module's runs; the first (single-process) run of each test builds the model."""
    return tmp_path_factory.mktemp("dist-cache")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp_path, trainer: str, processes: int, shard: str = "none"):
    data = json.loads(json.dumps(TINY_DIGITS_RUN))
    data["prompts"] = {"prompts_per_epoch": 4, "group_size": 4}  # 16 samples per epoch
    changes = dict(TRAINERS[trainer])
    for key, value in changes.pop("per_process", {}).items():
        data[key] = value // processes
    for key, value in changes.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    data["run"] = {**RUN, "shard": shard}
    # rows per process per minibatch: an optimizer step's window is forward_batch_size x accumulation x processes
    data["sampling"]["forward_batch_size"] = 8 // processes
    data["eval"] = {**data["eval"], "max_prompts": 4, "samples_per_prompt": 2}
    path = tmp_path / f"{trainer}-{processes}-{shard}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _train(config, out, cache, processes: int, resume: bool = False) -> dict:
    env = {**os.environ, "FLOWRL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    base = ["-m", "flowrl", "train", str(config), "--output-dir", str(out), *(["--resume"] if resume else [])]
    if processes == 1:
        cmd = [sys.executable, *base]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *base]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def _weights(run, epoch: int) -> dict[str, torch.Tensor]:
    folder = run / "checkpoints" / f"epoch_{epoch}" / "accelerate"
    tensors = {}
    for file in sorted(folder.glob("model*.safetensors")):
        tensors.update({f"{file.name}:{k}": v for k, v in load_file(file).items()})
    assert tensors, f"no model weights in {folder}"
    return tensors


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _two_equals_one(tmp_path, cache, trainer: str) -> None:
    one = _train(_config(tmp_path, trainer, 1), tmp_path / "one", cache, processes=1)
    two = _train(_config(tmp_path, trainer, 2), tmp_path / "two", cache, processes=2)
    assert (one["processes"], two["processes"]) == (1, 2)  # a real group of two, not two lone runs

    # the same samples, rewards and advantages: noise is seeded per sample, rewards are gathered
    rows_one, rows_two = _same_rows(tmp_path / "one", tmp_path / "two", "reward_evals")
    for key in ("eval/digits_gold", "eval/reward"):
        assert rows_one[-1][key] == pytest.approx(rows_two[-1][key], rel=1e-3, abs=1e-4), key

    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(1, 2))


def _same_weights(one, two, epochs: tuple[int, int], sharded: bool = False) -> None:
    """Both runs' weights, the same names within 1e-4 after each of `epochs` (`sharded`: `two`'s full model
    gathered from the shards), and the later epoch changed some weight (else the test would be vacuous)."""
    for epoch in epochs:
        w1 = _weights(one, epoch)
        if sharded:
            w1, w2 = {k.split(":", 1)[1]: v for k, v in w1.items()}, _sharded_weights(two, epoch)
        else:
            w2 = _weights(two, epoch)
        assert w1.keys() == w2.keys()
        for name in w1:
            torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-5, msg=f"epoch {epoch}: {name}")
    before, after = _weights(one, epochs[0]), _weights(one, epochs[1])
    assert any(not torch.equal(before[k], after[k]) for k in after), f"epoch {epochs[1]} changed no weight"


def _same_rows(one, two, *keys: str) -> tuple[list[dict], list[dict]]:
    """Both runs' metrics rows, checked: one row for the baseline evaluation and one per epoch (one writer), the
    same rewards, advantage statistics (and `keys`) and pooled training diagnostics every epoch."""
    rows_one, rows_two = _rows(one), _rows(two)
    assert [r["epoch"] for r in rows_two] == [r["epoch"] for r in rows_one] == [0, 1, 2]
    for a, b in zip(rows_one[1:], rows_two[1:]):
        advantages = [k for k in a if k.startswith("adv/")]
        for key in ["reward/mean", "reward/std", "trained_samples", *keys, *advantages]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (key, a[key], b[key])
        # the training diagnostics are the whole epoch's, pooled over the processes (not rank 0's share)
        _same_diagnostics(a, b)
    return rows_one, rows_two


DIAGNOSTICS = ("loss", "pg_loss", "clipfrac", "approx_kl", "ratio_mean", "grad_norm", "value_loss")


def _same_diagnostics(a: dict, b: dict) -> None:
    keys = [k for k in a if k in DIAGNOSTICS or k.startswith(("ratio_mean/step_", "clipfrac/step_"))]
    assert "loss" in keys and "clipfrac" in keys, sorted(a)
    for key in keys:
        assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (key, a[key], b[key])


def test_two_processes_equal_one_flow_grpo(tmp_path, cache):
    _two_equals_one(tmp_path, cache, "flow_grpo")


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["grpo_guard", "find", "dpok"])
def test_two_processes_equal_one(tmp_path, cache, trainer):
    _two_equals_one(tmp_path, cache, trainer)


def _sharded_weights(run, epoch: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"epoch_{epoch}" / "sharded_model.safetensors")


@pytest.mark.parametrize(
    ("trainer", "shard"),
    [("flow_grpo", "fsdp2"), ("flow_grpo", "zero2"), ("flow_grpo", "zero3"),
     pytest.param("grpo_guard", "fsdp2", marks=pytest.mark.slow),
     pytest.param("grpo_guard", "zero3", marks=pytest.mark.slow)],
)  # fmt: skip
def test_two_sharded_processes_equal_one(tmp_path, cache, trainer, shard):
    # on CPUs, over a gloo group of two: FSDP2 and ZeRO-3 shard the parameters, gradients and AdamW state, ZeRO-2
    # the gradients and AdamW state; every backward (and, sharded parameters, every forward) is a collective, so
    # the processes' calls must stay in step through sampling, the update and the evaluation
    one = _train(_config(tmp_path, trainer, 1), tmp_path / "one", cache, processes=1)
    two = _train(_config(tmp_path, trainer, 2, shard=shard), tmp_path / "two", cache, processes=2)
    assert (one["processes"], two["processes"]) == (1, 2) and (one["shard"], two["shard"]) == ("none", shard)
    _same_rows(tmp_path / "one", tmp_path / "two")
    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(1, 2), sharded=True)
    # resuming the sharded run from epoch 1 (the full states scattered back into the shards) continues exactly
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "two" / "checkpoints" / "epoch_1", resumed / "checkpoints" / "epoch_1")
    _train(_config(tmp_path, trainer, 2, shard=shard), resumed, cache, processes=2, resume=True)
    again, straight = _sharded_weights(resumed, 2), _sharded_weights(tmp_path / "two", 2)
    for name in straight:
        torch.testing.assert_close(again[name], straight[name], rtol=0, atol=1e-6, msg=name)


def test_accelerate_cpu_launch_of_many_processes_is_refused():
    from flowrl.trainers.base import LaunchError, _check_launch

    with pytest.raises(LaunchError, match="torchrun --nproc_per_node N"):
        _check_launch({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    _check_launch({"ACCELERATE_USE_CPU": "True"})  # one process: fine
    _check_launch({"ACCELERATE_USE_CPU": "True", "MASTER_PORT": "1", "WORLD_SIZE": "2"})  # torchrun: fine


@pytest.mark.parametrize(
    ("name", "shard"),
    [("ddp.yaml", "none"), ("ddp_multinode.yaml", "none"), ("fsdp2.yaml", "fsdp2"), ("zero2.yaml", "zero2"),
     ("zero3.yaml", "zero3")],
)  # fmt: skip
def test_shipped_accelerate_configs_launch(name, shard):
    # each shipped config, read by accelerate's own launcher into the environment it gives the processes, asks
    # flowrl for the intended sharding (which flowrl then applies itself: accelerate's wrapping is switched off)
    from pathlib import Path

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    from flowrl.trainers.base import launch_shard

    path = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / name
    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "flowrl", "train", "run.yaml"])
    args, _, _ = _validate_launch_command(args)
    assert args.num_processes >= 2 and args.num_processes % args.num_machines == 0
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ""  # what `accelerate launch` adds before launching
        env = dict(prepare_deepspeed_cmd_env(args)[1])
    else:
        env = dict(prepare_multi_gpu_env(args))
    assert launch_shard("none", env) == shard
    assert env.get("ACCELERATE_USE_DEEPSPEED", "false") == env.get("ACCELERATE_USE_FSDP", "false") == "false"
    assert env["ACCELERATE_MIXED_PRECISION"] == ("bf16" if shard == "none" else "no")  # sharding runs in fp32


def test_launch_shard_refusals():
    from flowrl.trainers.base import LaunchError, launch_shard

    assert launch_shard("zero3", {}) == "zero3"  # no accelerate config: run.shard decides
    stage3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    assert launch_shard("zero3", stage3) == "zero3"
    with pytest.raises(LaunchError, match="ZeRO stage 1; flowrl runs stages 2 and 3"):
        launch_shard("none", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"})
    with pytest.raises(LaunchError, match="launches zero2 but run.shard is 'fsdp2'"):
        launch_shard("fsdp2", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})


CONTROL = {
    "env": {"id": "flowrl/BimodalPointMass-v0", "num_envs": 4, "steps_per_env": 60, "normalize_obs": True,
            "normalize_reward": True},
    "minibatch_size": 48, "inner_epochs": 2, "target_kl": 0.05,
    "run": {**RUN, "epochs": 3, "save_every": 1},
    "eval": {"episodes": 4, "every": 0},
}  # fmt: skip
"""Four environments (two per process) whose 50-step episodes end inside an epoch, both normalisers on, and
target_kl (a global decision): every piece of the control update that could differ by process count."""


def _control_two_equals_one(tmp_path, trainer: str) -> None:
    config = tmp_path / f"{trainer}.yaml"
    config.write_text(yaml.safe_dump({"trainer": trainer, **CONTROL}))
    one = _train(config, tmp_path / "one", tmp_path, processes=1)
    two = _train(config, tmp_path / "two", tmp_path, processes=2)
    assert (one["processes"], two["processes"]) == (1, 2)
    rows_one, rows_two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["epoch"] for r in rows_two] == [r["epoch"] for r in rows_one] == [0, 1, 2, 3]
    for a, b in zip(rows_one[1:], rows_two[1:]):
        # every environment's episodes (two of them stepped by each process) and the whole rollout's values
        assert a["episodes"] == b["episodes"] > 0 and a["env_steps"] == b["env_steps"] == 240 * a["epoch"]
        for key in ("reward/mean", "reward/std", "episode_length", "explained_variance", "value_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (key, a[key], b[key])
        assert a.get("early_stop_epoch") == b.get("early_stop_epoch")
        _same_diagnostics(a, b)
    assert rows_one[-1]["eval/reward"] == pytest.approx(rows_two[-1]["eval/reward"], rel=1e-3, abs=1e-4)
    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(2, 3))  # the two checkpoints kept
    # the normalisers' statistics (every environment's observations and returns) travel in the checkpoints
    s1 = load_file(tmp_path / "one" / "checkpoints" / "epoch_3" / "extra.safetensors")
    s2 = load_file(tmp_path / "two" / "checkpoints" / "epoch_3" / "extra.safetensors")
    for name in [k for k in s1 if k.startswith("normalizer.")]:
        torch.testing.assert_close(s2[name], s1[name], rtol=1e-6, atol=1e-8, msg=name)


def test_two_processes_equal_one_control_fpo(tmp_path):
    pytest.importorskip("gymnasium")
    _control_two_equals_one(tmp_path, "fpo")


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["ppo", "dppo"])
def test_two_processes_equal_one_control(tmp_path, trainer):
    pytest.importorskip("gymnasium")
    _control_two_equals_one(tmp_path, trainer)


TEXT = {
    "trainer": "text",
    "prompts": {"prompts_per_epoch": 8, "group_size": 4},
    "generation": {"max_new_tokens": 4, "batch_size": 8},
    "inner_epochs": 2,
    "run": {**RUN, "epochs": 2},
    "eval": {"every": 0, "max_prompts": 16},
}  # fmt: skip
"""32 completions per epoch sampled in batches of 8 (each process's 16 are two whole batches)."""


def _text_config(tmp_path, processes: int, objective: str, minibatch: int = 16):
    data = json.loads(json.dumps(TEXT))
    data["objective"] = {"name": objective}
    data["generation"]["minibatch_size"] = minibatch // processes
    data["optim"] = {"gradient_accumulation": 16 // minibatch}  # an optimizer step's window: 16 completions
    path = tmp_path / f"text-{objective}-{processes}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("objective", "minibatch"),
    [
        ("grpo", 16),
        pytest.param("dapo", 16, marks=pytest.mark.slow),
        # objectives reading batch statistics (the ratio variance and its dual variable; the global entropy
        # quantile): every call reduces over the processes. Minibatches of 2 completions, one per process on
        # average, so a process often holds none of a minibatch and must still take part in the call.
        pytest.param("r2vpo", 2, marks=pytest.mark.slow),
        pytest.param("high_entropy", 2, marks=pytest.mark.slow),
    ],
)
def test_two_processes_equal_one_text(tmp_path, cache, objective, minibatch):
    one = _train(_text_config(tmp_path, 1, objective, minibatch), tmp_path / "one", cache, processes=1)
    two = _train(_text_config(tmp_path, 2, objective, minibatch), tmp_path / "two", cache, processes=2)
    assert (one["processes"], two["processes"]) == (1, 2)
    # the same completions (sampled batch by batch from the same seeds), rewards and advantages
    rows_one, rows_two = _same_rows(tmp_path / "one", tmp_path / "two")
    assert rows_one[-1]["eval/reward"] == pytest.approx(rows_two[-1]["eval/reward"], abs=1e-6)
    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(1, 2))
