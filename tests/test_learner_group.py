"""A learner group behind Ray rollout workers, and several machines, tested on one machine's CPUs (gloo).

`run.mode: async` under `torchrun` (DDP, FSDP2, ZeRO) at staleness 0 with `sync_every: 1` is the synchronous run;
a learner killed with SIGKILL ends the run with one line, its last checkpoint whole, and `--resume` continues it;
`torchrun --nnodes 2 --nproc_per_node 1` started twice with a rendezvous on localhost (two launchers, as two machines
run them) trains as one process. The `distributed` tier."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from flowrl import checkpoint

from .launch import free_port as _free_port
from .test_distributed import _config, _rows, _same_rows, _same_weights, _train


pytestmark = pytest.mark.distributed

ASYNC = ["run.mode=async", "asynchrony.max_staleness=0", "asynchrony.worker_cpus=0", "asynchrony.worker_threads=1"]
"""Staleness 0 with `sync_every: 1` (the default): every epoch's batch sampled with the learner's current weights by
a worker on one thread, as the synchronous run's processes sample on theirs."""

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def cache(session_cache):
    return Path(session_cache)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """The synchronous one-process run every run here is compared with (2 epochs of tiny digits Flow-GRPO)."""
    folder = tmp_path_factory.mktemp("reference")
    _train(_config(folder, "flow_grpo", 1), folder / "run", cache, processes=1)
    return folder / "run"


@pytest.fixture
def ray_tmp(monkeypatch):
    """A short folder for the Ray cluster rank 0 starts (its sockets' paths must fit in 107 characters; a test's
    folder is too deep), removed afterwards."""
    folder = tempfile.mkdtemp(prefix="ray-")
    monkeypatch.setenv("RAY_TMPDIR", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# FSDP2 in the distributed tier; ZeRO-2 and ZeRO-3 in the slow tier (what ZeRO-3 adds here, its partitions gathered
# for each publication, tests/trainers/test_zero.py checks against one process; its training, test_distributed.py)
@pytest.mark.parametrize("shard", ["fsdp2", *(pytest.param(s, marks=pytest.mark.slow) for s in ("zero3", "zero2"))])
def test_a_sharded_async_learner_group_is_the_synchronous_run(tmp_path, cache, reference, ray_tmp, shard):
    """docs/async.md's learner-group command (on a tiny config, the test's shard kind): staleness 0 on two learners
    is the synchronous one-process run."""
    block = re.search(r"^## A learner group.*?```bash\n(.*?)```", (DOCS / "async.md").read_text(), flags=re.S | re.M)
    args = block.group(1).split("#")[0].split()  # the command, without its comment
    assert args[:3] == ["torchrun", "--nproc_per_node", "2"] and args[-4:] == [
        "--set",
        "run.mode=async",
        "--set",
        "run.shard=fsdp2",
    ], args
    config, run = _config(tmp_path, "flow_grpo", 2), tmp_path / "async"
    args = [str(config) if a == "CONFIG" else a.replace("=fsdp2", f"={shard}") for a in args[1:]]
    assert args[2:6] == ["-m", "flowrl", "train", str(config)], args
    # the command's `flowrl train ...` on its two processes, forked with torchrun's variables (tests/launch.py):
    # torchrun itself starts the killed learner group below and the several-machines runs
    sets = [item for flag, item in zip(args[6::2], args[7::2], strict=True) if flag == "--set"]
    summary = _train(config, run, cache, processes=int(args[1]), overrides=[*sets, *ASYNC])
    assert (summary["processes"], summary["shard"]) == (2, shard)
    rows = _rows(run)
    assert [r["async/staleness"] for r in rows[1:]] == [0.0, 0.0]
    _same_rows(reference, run)
    _same_weights(reference, run, epochs=(1, 2), sharded=True)
    # epoch 1 published twice (the initial weights, then epoch 1's), the last epoch not at all; each publication the
    # full model gathered from the shards (a shard would be half of it): its parameters and the blob's header
    model = load_file(run / "checkpoints" / "epoch_1" / "sharded_model.safetensors")
    full = sum(v.numel() * v.element_size() for v in model.values())
    per_publication = rows[1]["async/publish_bytes"] / 2
    assert 0.99 * full < per_publication < full + 65536, (per_publication, full)
    assert rows[2]["async/publish_bytes"] == 0 and rows[1]["async/publish_s"] > 0


def _torchrun(config, out, overrides=(), launcher=("--nproc_per_node", "2")) -> list[str]:
    sets = [arg for item in overrides for arg in ("--set", item)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        "-m",
        "flowrl",
        "train",
        str(config),
        "--output-dir",
        str(out),
        *sets,
    ]


def _env(tmp_path, cache) -> dict:
    scratch = tmp_path / "tmp"  # torchrun's agent leaves a log folder in the temporary folder
    scratch.mkdir(exist_ok=True)
    return {**os.environ, "FLOWRL_CACHE": str(cache), "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}


STALL_AFTER_EPOCH_1 = """
import os
if os.environ.get("RANK") == "1":  # the learner the test kills: it stops once epoch 1's checkpoint is written
    import time
    import flowrl.checkpoint as checkpoint

    save = checkpoint.save

    def save_then_stall(folder, *args, **kwargs):
        out = save(folder, *args, **kwargs)
        if out.name == "epoch_1":
            time.sleep(3600)
        return out

    checkpoint.save = save_then_stall
"""
"""`sitecustomize` of the killed run's processes: learner 1 stalls after epoch 1's checkpoint, so learner 0 waits for
it in epoch 2 whenever the kill lands (without it a late kill could find the run over: epoch 2 takes under a
second)."""


def test_a_killed_learner_ends_the_run_in_one_line_and_resume_continues_it(tmp_path, cache, reference, ray_tmp):
    """DDP: SIGKILL learner 1 once epoch 1's checkpoint is written; the survivor stops with one line naming how to
    go on, the checkpoint verifies, and the resumed group's numbers are the synchronous run's."""
    config, run = _config(tmp_path, "flow_grpo", 2), tmp_path / "async"
    launcher = ("--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()))
    cmd = _torchrun(config, run, ASYNC, launcher)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(STALL_AFTER_EPOCH_1)
    env = _env(tmp_path, cache)
    env["PYTHONPATH"] = os.pathsep.join([str(hooks), *filter(None, [env.get("PYTHONPATH")])])
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "epoch_1").is_dir():
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        learners = [p for p in psutil.Process(process.pid).children() if p.environ().get("RANK") == "1"]
        learners[0].send_signal(signal.SIGKILL)
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    lines = [line for line in err.splitlines() if re.match(r"flowrl( train)?:", line)]  # flowrl's, not torchrun's
    assert len(lines) == 1 and "at epoch 1 of 2" in lines[0] and f"{run} --resume" in lines[0], err[-6000:]
    checkpoint.verify(run / "checkpoints" / "epoch_1")
    assert not (run / "checkpoints" / "epoch_2").exists()
    summary = _train(config, run, cache, processes=2, resume=True, overrides=ASYNC)  # forked (tests/launch.py)
    assert summary["processes"] == 2
    _same_rows(reference, run)
    _same_weights(reference, run, epochs=(1, 2))


def _docs_command(page: str, row: str) -> str:
    """The command of the launch table's row `row` in docs/`page`."""
    match = re.search(rf"^\| {re.escape(row)} \| [^`]*`([^`]+)`", (DOCS / page).read_text(), flags=re.M)
    assert match, f"docs/{page} has no launch row {row!r}"
    return match.group(1)


def test_two_machines_train_as_one_process(tmp_path, cache, reference):
    """docs/distributed.md's several-machines command, started twice on this machine (two launchers rendezvousing on
    localhost, as two machines would on HEAD_IP), one process each: the one-process run."""
    command = _docs_command("distributed.md", "several machines (DDP)")
    assert command.startswith("torchrun ") and command.endswith(" -m flowrl train CONFIG.yaml"), command
    config, run, port = _config(tmp_path, "flow_grpo", 1), tmp_path / "two", str(_free_port())
    launchers = []
    for rank in (0, 1):
        line = command.replace("MACHINES", "2").replace("GPUS", "1").replace("RANK", str(rank))
        line = line.replace("HEAD_IP", "127.0.0.1").replace("29500", port).replace("CONFIG.yaml", str(config))
        args = line.split()[1:]  # torchrun's own arguments, then `-m flowrl train CONFIG`
        cmd = [sys.executable, "-m", "torch.distributed.run", *args, "--output-dir", str(run)]
        launchers.append(
            subprocess.Popen(
                cmd, env=_env(tmp_path, cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        errors = [launcher.communicate(timeout=600)[1] for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    for launcher, err in zip(launchers, errors):
        assert launcher.returncode == 0, err[-3000:]
    assert json.loads((run / "summary.json").read_text())["processes"] == 2
    _same_rows(reference, run)
    _same_weights(reference, run, epochs=(1, 2))
