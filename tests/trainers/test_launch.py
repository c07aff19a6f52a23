"""Launch checks (no processes started): the refused launches, and what each shipped accelerate config asks of
flowrl (the multi-process runs themselves: tests/test_distributed.py, the `distributed` tier)."""

import pytest


def test_accelerate_cpu_launch_of_many_processes_is_refused():
    from flowrl.run.engine import LaunchError, check_launch

    with pytest.raises(LaunchError, match="torchrun --nproc_per_node N"):
        check_launch({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    check_launch({"ACCELERATE_USE_CPU": "True"})  # one process: fine
    check_launch({"ACCELERATE_USE_CPU": "True", "MASTER_PORT": "1", "WORLD_SIZE": "2"})  # torchrun: fine


@pytest.mark.parametrize(
    ("name", "shard"),
    [
        ("ddp.yaml", "none"),
        ("ddp_multinode.yaml", "none"),
        ("fsdp2.yaml", "fsdp2"),
        ("zero2.yaml", "zero2"),
        ("zero3.yaml", "zero3"),
    ],
)
def test_shipped_accelerate_configs_launch(name, shard):
    # each shipped config, read by accelerate's own launcher into the environment it gives the processes, asks
    # flowrl for the intended sharding (which flowrl then applies itself: accelerate's wrapping is switched off)
    from pathlib import Path

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    from flowrl.run.engine import launch_precision, launch_shard

    path = Path(__file__).resolve().parents[2] / "configs" / "accelerate" / name
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
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and launch_precision("no", env) == "bf16"  # read, not ignored


def test_launch_precision():
    from flowrl.run.engine import LaunchError, launch_precision

    assert launch_precision("no", {}) == "no" and launch_precision("bf16", {}) == "bf16"
    assert launch_precision("no", {"ACCELERATE_MIXED_PRECISION": "bf16"}) == "bf16"
    assert launch_precision("bf16", {"ACCELERATE_MIXED_PRECISION": "no"}) == "bf16"
    with pytest.raises(LaunchError, match="asks for mixed_precision fp16 but run.mixed_precision is bf16"):
        launch_precision("bf16", {"ACCELERATE_MIXED_PRECISION": "fp16"})


def test_launch_shard_refusals():
    from flowrl.run.engine import LaunchError, launch_shard

    assert launch_shard("zero3", {}) == "zero3"  # no accelerate config: run.shard decides
    stage3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    assert launch_shard("zero3", stage3) == "zero3"
    with pytest.raises(LaunchError, match="ZeRO stage 1; flowrl runs stages 2 and 3"):
        launch_shard("none", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"})
    with pytest.raises(LaunchError, match="launches zero2 but run.shard is 'fsdp2'"):
        launch_shard("fsdp2", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})


def test_offload_without_a_sharded_model_is_refused(tiny_world, tmp_path):
    from tests.conftest import tiny_config
    from tests.trainers.conftest import make_trainer

    with pytest.raises(ValueError, match=r"run.offload moves the shards of a sharded model: it needs run.shard"):
        make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=["run.offload=true"]))
