"""The asynchronous mode on a Ray cluster of two nodes, started on this machine as docs/async.md starts one on two
machines (`ray start`, each node with its own ports): the rollout workers run on the second node, and a node lost in
the middle of a run (its raylet killed) costs its worker, which is replaced on the node left. The `distributed`
tier."""

import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch

from flowrl import cli
from flowrl.config import save_config
from flowrl.run.async_rollouts import AsyncCollector
from flowrl.trainers import build_trainer
from tests.conftest import DIGITS_BASE, tiny_config
from tests.launch import free_port


pytestmark = pytest.mark.distributed
ray = pytest.importorskip("ray", reason="the asynchronous mode needs Ray (the `async` extra)")

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _docs_commands() -> list[str]:
    """The command lines of docs/async.md's cluster block: the head's `ray start`, a rollout machine's, the run."""
    text = (DOCS / "async.md").read_text()
    block = re.search(r"^## A Ray cluster across machines\n\n```bash\n(.*?)```", text, flags=re.S | re.M)
    assert block, "docs/async.md has no cluster commands"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


@pytest.fixture
def cluster_env(monkeypatch):
    """What the nodes and this test's learner share: a short Ray folder (socket paths must fit in 107 characters), no
    token authentication, one torch thread, and a lost node noticed in about 10 s (a 1.5 s bound declared the live
    second node dead on a 2-core machine under load, and the run lost its workers)."""
    folder = tempfile.mkdtemp(prefix="ray-")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # (the nodes listen on this machine only)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RAY_health_check_period_ms", "1000")
    monkeypatch.setenv("RAY_health_check_failure_threshold", "10")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the learner, as the synchronous run it is compared with and the workers
    yield folder
    torch.set_num_threads(threads)
    shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _two_nodes(folder: str, head_cpus: int, node_cpus: int):
    """docs/async.md's two `ray start` lines (HEAD_IP 127.0.0.1 and a free port), each node in its own process with
    the flags two nodes on one machine need; yields `(address, the second node's process)`."""
    head_line, node_line, _ = _docs_commands()
    port = str(free_port())
    address = f"127.0.0.1:{port}"
    one_machine = ["--block", "--disable-usage-stats", f"--temp-dir={folder}", "--object-store-memory=80000000"]
    head = [
        *head_line.replace("6379", port).split(),
        *one_machine,
        "--include-dashboard=false",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
    ]
    node = [
        *node_line.replace("HEAD_IP:6379", address).split(),
        *one_machine,
        f"--dashboard-agent-listen-port={free_port()}",
        f"--num-cpus={node_cpus}",
    ]
    if head_cpus:
        head = [arg.replace("--num-cpus=0", f"--num-cpus={head_cpus}") for arg in head]
    processes = [subprocess.Popen(head, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        processes.append(subprocess.Popen(node, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 120
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert time.monotonic() < deadline, "the second node did not join within 120 s"
            time.sleep(0.5)
        ray.shutdown()  # the run connects on its own (asynchrony.address)
        yield address, processes[1]
    finally:
        ray.shutdown()
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def _nodes_seen(monkeypatch, after=None) -> list:
    """Record, after each batch the learner receives, its workers' nodes and the cluster's (`after(collector)` runs
    then too)."""
    seen = []
    receive = AsyncCollector._receive

    def node(worker):
        try:
            return ray.get(worker.node.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return "lost"  # its node went (its death not yet noticed by the schedule)

    def receive_and_look(self, epoch):
        out = receive(self, epoch)
        seen.append((epoch, [node(w) for w in self.workers], {n["NodeID"]: n for n in ray.nodes()}))
        if after is not None:
            after(self, epoch)
        return out

    monkeypatch.setattr(AsyncCollector, "_receive", receive_and_look)
    return seen


def _rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_the_docs_cluster_runs_the_workers_on_the_second_node(tmp_path, cluster_env, monkeypatch):
    """The head lends no CPU: the two workers (one CPU each) can only run on the second node; at staleness 0 the run
    is the synchronous one (rewards, losses, evaluations)."""
    config = tiny_config(
        "flow_grpo",
        tmp_path / "run",
        overrides=[
            *DIGITS_BASE,
            "run.epochs=2",
            "asynchrony.rollout_workers=2",
            "asynchrony.max_staleness=0",
            "asynchrony.worker_threads=1",
        ],
    )
    save_config(config, tmp_path / "config.yaml")
    seen = _nodes_seen(monkeypatch)
    with _two_nodes(cluster_env, head_cpus=0, node_cpus=2) as (address, _):
        train_line = (
            _docs_commands()[2].replace("HEAD_IP:6379", address).replace("CONFIG", str(tmp_path / "config.yaml"))
        )
        assert cli.main(train_line.split()[1:]) == 0
    for _, workers, nodes in seen:
        heads = [i for i, n in nodes.items() if n["Resources"].get("node:__internal_head__")]
        assert len(nodes) == 2 and len(heads) == 1
        assert len(workers) == 2 and all(w is not None and w != heads[0] and w in nodes for w in workers), workers
    rows = _rows(tmp_path / "run")
    assert [r["async/staleness"] for r in rows[1:]] == [0.0, 0.0]
    sync = build_trainer(
        tiny_config("flow_grpo", tmp_path / "sync", overrides=[*DIGITS_BASE, "run.epochs=2", "run.log_with=[]"])
    )
    sync.train()
    for a, b in zip(rows, _rows(tmp_path / "sync"), strict=True):
        for key in ("reward/mean", "loss", "clipfrac", "eval/reward"):
            assert a.get(key) == b.get(key), (a["epoch"], key)


def test_a_lost_node_s_worker_is_replaced_on_the_node_left(tmp_path, cluster_env, monkeypatch):
    """Two workers, one per node (SPREAD); after the first batch the second node's raylet is killed (its worker goes
    with it): the worker is replaced on the head and the run goes on to its end."""
    killed = []

    def kill_the_second_node(collector, epoch):
        if killed:
            return
        raylets = [p for p in psutil.Process(node.pid).children(recursive=True) if p.name() == "raylet"]
        raylets[0].send_signal(signal.SIGKILL)
        killed.append(epoch)

    seen = _nodes_seen(monkeypatch, after=kill_the_second_node)
    config = tiny_config(
        "flow_grpo",
        tmp_path / "run",
        overrides=[
            *DIGITS_BASE,
            "run.epochs=3",
            "run.mode=async",
            "asynchrony.rollout_workers=2",
            "asynchrony.worker_cpus=0.5",
            "asynchrony.worker_threads=1",
            "run.log_with=[]",
        ],
    )
    with _two_nodes(cluster_env, head_cpus=1, node_cpus=1) as (address, node):
        config.asynchrony.address = address
        summary = build_trainer(config).train()
    assert summary["epochs"] == 3 and killed == [0]
    (_, before, nodes), *_, (_, after, alive) = seen
    head = next(i for i, n in nodes.items() if n["Resources"].get("node:__internal_head__"))
    assert len(set(before)) == 2 and head in before  # one worker per node before the loss
    assert [n["Alive"] for i, n in alive.items() if i != head] == [False]
    assert after == [head, head]  # the lost node's worker replaced on the head
    rows = _rows(tmp_path / "run")
    # one replacement, or two: a replacement spawned before Ray marks the lost node dead (its health check, ~10 s
    # here) can be placed there and die with it (CI, 2026-11-28: 2)
    assert rows[-1]["async/restarts"] in (1.0, 2.0) and all(r["async/staleness"] <= 1 for r in rows[1:])
