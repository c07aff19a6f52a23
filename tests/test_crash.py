"""Crashes lose nothing: a run killed with SIGKILL while writing a checkpoint, or in the middle of an epoch,
resumes from its latest complete checkpoint and ends exactly where an uninterrupted run ends; two processes
building the digits base model into one cache at once both get an intact model (docs/reliability.md)."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from . import launch
from .conftest import TINY_DIGITS_RUN


# each test starts, kills and restarts `flowrl` processes (about 45 s together): the second CI tier
pytestmark = pytest.mark.distributed


DYING = """
import os, signal, sys
from flowrl import checkpoint
from flowrl.cli import main
from flowrl.run.scheduler import UpdateScheduler

mode, at = sys.argv[1], int(sys.argv[2])
if mode == "checkpoint":  # SIGKILL while checkpoint `at` is written: weights on disk, no manifest yet
    write_manifest, count = checkpoint.write_manifest, [0]

    def dying(folder):
        count[0] += 1
        if count[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        write_manifest(folder)

    checkpoint.write_manifest = dying
else:  # SIGKILL in the middle of epoch `at` (0-based): sampled and scored, not yet trained
    run = UpdateScheduler.run

    def dying(self, batch, epoch):
        if epoch == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return run(self, batch, epoch)

    UpdateScheduler.run = dying
sys.exit(main(sys.argv[3:]))
"""

VOLATILE = ("time", "wall_s", "threads", "memory/")
"""Metrics that measure the machine, not the training."""


@pytest.fixture(scope="module")
def env(session_cache):
    return {**os.environ, "FLOWRL_CACHE": str(session_cache), "OMP_NUM_THREADS": "1"}


def _config(tmp_path):
    data = json.loads(json.dumps(TINY_DIGITS_RUN))
    data["run"] = {"epochs": 3, "save_every": 1, "samples_every": 0, "log_with": [], "threads": 1}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(env, *args):
    """`flowrl ARGS` forked from the session's forkserver (tests/launch.py): its exit code and output."""
    log = Path(args[args.index("--output-dir") + 1] + ".log")
    return launch.run(list(args), env, log)


def _run_dying(env, *args):
    """The DYING script with `args` as its command line, forked (tests/launch.py) and killed by its own hook: its exit
    code and output."""
    log = Path(args[args.index("--output-dir") + 1] + ".log")
    launched = launch.start_code(DYING, env, log, argv=["-c", *args])
    return launched.wait(timeout=600), log.read_text()


def _end(run):
    weights = load_file(run / "checkpoints" / "epoch_3" / "accelerate" / "model.safetensors")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]
    return weights, rows


@pytest.mark.parametrize("mode, at", [("checkpoint", 3), ("epoch", 2)])
def test_a_killed_run_resumes_exactly_from_its_last_complete_checkpoint(env, tmp_path, mode, at):
    config = _config(tmp_path)
    straight = tmp_path / "straight"
    code, output = _run(env, "train", str(config), "--output-dir", str(straight))
    assert code == 0, output[-2000:]

    killed = tmp_path / "killed"
    code, output = _run_dying(env, mode, str(at), "train", str(config), "--output-dir", str(killed))
    assert code == -signal.SIGKILL, output[-2000:]
    names = sorted(p.name for p in (killed / "checkpoints").iterdir() if not p.name.startswith("."))
    assert names == ["epoch_1", "epoch_2"]  # a partial checkpoint never gets its name (it stays `.tmp-epoch_3`)
    code, output = _run(env, "train", str(config), "--output-dir", str(killed), "--resume")
    assert code == 0, output[-2000:]

    (w_straight, rows_straight), (w_killed, rows_killed) = _end(straight), _end(killed)
    assert rows_killed == rows_straight  # one row per epoch, the same numbers
    for name, value in w_straight.items():
        assert torch.equal(w_killed[name], value), name


def _run_twice_at_once(code: str, env: dict, tmp_path: Path) -> list[str]:
    """The Python source `code` in two processes started together (forked: tests/launch.py); their outputs, once
    both succeeded."""
    both = [launch.start_code(code, env, tmp_path / f"build-{i}.log") for i in range(2)]
    codes = [launched.wait(timeout=600) for launched in both]
    outputs = [launched.log.read_text() for launched in both]
    assert codes == [0, 0], [out[-2000:] for out in outputs]
    return outputs


def _built(output: str) -> str:
    """The folder a build printed (`built: FOLDER`) among its process's output."""
    return next(line.split(" ", 1)[1] for line in output.splitlines() if line.startswith("built: "))


def test_two_processes_building_the_digits_model_at_once_share_one_intact_build(env, tmp_path):
    build = (
        "from flowrl.digits.build import BuildConfig, build_model\n"
        "from flowrl.digits.nets import TransformerConfig\n"
        "tiny = TransformerConfig(num_layers=1, attention_head_dim=8, num_attention_heads=2,\n"
        "                         caption_projection_dim=16)\n"
        "print('built:', build_model(BuildConfig(pretrain_steps=40, transformer=tiny)))\n"
    )
    outputs = _run_twice_at_once(build, {**env, "FLOWRL_CACHE": str(tmp_path / "cache")}, tmp_path)
    folders = {_built(out) for out in outputs}
    assert len(folders) == 1
    built = sum("building the digits base model" in out for out in outputs)
    assert built == 1, "the second process should wait for the first and reuse its build"
    folder = next(iter(folders))
    meta = json.loads(open(os.path.join(folder, "meta.json")).read())
    assert meta["config"]["pretrain_steps"] == 40
    from diffusers import SD3Transformer2DModel

    SD3Transformer2DModel.from_pretrained(os.path.join(folder, "transformer"))  # the build loads back
    leftovers = [p for p in os.listdir(os.path.dirname(folder)) if p.startswith(".model-") and not p.endswith(".lock")]
    assert not leftovers, leftovers


def test_two_processes_building_the_arithmetic_model_at_once_share_one_intact_build(env, tmp_path):
    # the text world's base model (flowrl.llm.build): two runs starting at once on one cache (CI, 2026-11-28: the
    # second's build replaced the folder while the first was loading it, "no file named model.safetensors")
    build = (
        "from flowrl.llm.build import BuildConfig, build, load\n"
        "folder = build(BuildConfig(train_steps=30, eval_samples=1))\n"
        "load(folder)\n"
        "print('built:', folder)\n"
    )
    outputs = _run_twice_at_once(build, {**env, "FLOWRL_CACHE": str(tmp_path / "cache")}, tmp_path)
    assert len({_built(out) for out in outputs}) == 1
    assert sum("building the arithmetic base model" in out for out in outputs) == 1
