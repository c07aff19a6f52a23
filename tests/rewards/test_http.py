"""Rewards over HTTP: `flowrl serve-reward` / `RewardServer` and the `http` reward client."""

import http.client
import json
import logging
import math
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import httpx
import pytest
import torch

from flowrl import rewards
from flowrl.cli import main
from flowrl.rewards.jpeg import JpegCompressibility
from flowrl.rewards.serving.http import (
    HttpReward,
    RewardServerError,
    RewardServerUnavailable,
    decode_images,
    encode_images,
    request_body,
)
from flowrl.rewards.serving.server import RewardServer


PROMPTS = ["a cat", "a dog", "a fox", "an owl", "a yak"]


@pytest.fixture
def images():
    return torch.rand(5, 3, 16, 24, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def jpeg_server():
    with RewardServer(JpegCompressibility(), name="jpeg_compressibility", port=0).start() as server:
        yield server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of a raw POST, for the error paths."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("format, raw_dtype", [("png", "float32"), ("raw", "float32"), (None, None)])
def test_round_trip_equals_the_reward_called_directly(jpeg_server, images, format, raw_dtype):
    kwargs = {"format": format, "raw_dtype": raw_dtype} if format else {}  # the default: raw uint8
    client = rewards.get("http", url=jpeg_server.url, batch_size=2, **kwargs)
    assert torch.equal(client(images, PROMPTS), JpegCompressibility()(images, PROMPTS))  # PNG/uint8: same rounding
    assert jpeg_server.stats["images"] == 5 and jpeg_server.stats["requests"] == 3  # chunks of batch_size
    with urllib.request.urlopen(f"{jpeg_server.url}/health", timeout=5) as response:
        assert json.loads(response.read()) == {"reward": "jpeg_compressibility", "status": "ok"}
    assert client.health() == {"reward": "jpeg_compressibility", "status": "ok"}


@pytest.mark.parametrize("format", ["jpeg", "webp"])
def test_lossy_formats_are_close_and_smaller(format):
    smooth = torch.linspace(0, 1, 64).repeat(2, 3, 64, 1)  # [2, 3, 64, 64] gradients
    sent = json.dumps(encode_images(smooth, format, quality=90))
    back = decode_images(json.loads(sent))
    assert back.shape == smooth.shape and (back - smooth).abs().mean() < 0.01
    assert len(sent) < len(json.dumps(encode_images(smooth, "raw", "uint8")))
    body = json.loads(request_body(smooth, ["a", "b"], {"k": [1, 2]}, format="raw", dtype="uint8"))
    assert torch.equal(decode_images(body["images"]), decode_images(encode_images(smooth, "png")))
    assert body["prompts"] == ["a", "b"] and body["metadata"] == {"k": [1, 2]}


def test_float_pixels_metadata_and_nan_arrive_intact(images):
    seen = {}

    def reward(images, prompts, **metadata):
        seen.update(images=images, metadata=metadata)
        scores = images.mean(dim=(1, 2, 3))
        scores[[i for i, p in enumerate(prompts) if p == "nan"]] = math.nan
        return scores

    with RewardServer(reward, name="mean", port=0).start() as server:
        client = HttpReward(server.url, format="raw", raw_dtype="float32")
        prompts = ["a", "nan", "b", "nan", "c"]
        scores = client(images, prompts, answer=torch.arange(5), tag="x")
    assert torch.equal(seen["images"], images)
    assert seen["metadata"] == {"answer": [0, 1, 2, 3, 4], "tag": ["x"] * 5}
    expected = images.mean(dim=(1, 2, 3))
    assert scores.isnan().tolist() == [False, True, False, True, False]
    assert torch.allclose(scores[[0, 2, 4]], expected[[0, 2, 4]])


def test_concurrent_clients_get_their_own_scores_in_fewer_reward_calls():
    def slow_mean(images, prompts, **metadata):
        time.sleep(0.05)  # the next requests queue up meanwhile
        return images.mean(dim=(1, 2, 3))

    n_clients = 8
    results, errors = {}, []
    barrier = threading.Barrier(n_clients)
    with RewardServer(slow_mean, name="mean", port=0, batch_wait_s=0.05, max_batch=64).start() as server:

        def client(i):
            try:
                barrier.wait()
                images = torch.full((2, 3, 8, 8), i / 10)
                results[i] = HttpReward(server.url, raw_dtype="float32")(images, ["p", "q"])
            except Exception as err:  # noqa: BLE001
                errors.append(err)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        stats = dict(server.stats)
    assert not errors, errors
    for i in range(n_clients):
        assert torch.allclose(results[i], torch.full((2,), i / 10)), (i, results[i])
    assert stats["requests"] == n_clients and stats["reward_calls"] < n_clients, stats


def test_a_failing_request_does_not_fail_the_requests_batched_with_it():
    def picky(images, prompts, **metadata):
        if "bad" in prompts:
            raise ValueError("cannot score 'bad'")
        return torch.ones(len(prompts))

    with RewardServer(picky, name="picky", port=0, batch_wait_s=0.2).start() as server:
        out = {}

        def send(prompt):
            body = {"prompts": [prompt], "images": encode_images(torch.zeros(1, 3, 4, 4))}
            out[prompt] = post(server.url + "/score", json.dumps(body).encode())

        threads = [threading.Thread(target=send, args=(prompt,)) for prompt in ["ok", "bad"]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert out["ok"] == (200, {"scores": [1.0]})
        assert out["bad"] == (500, {"error": "reward 'picky' failed: ValueError: cannot score 'bad'"})
        client = HttpReward(server.url, retries=1, backoff=0.01)
        with pytest.raises(RewardServerError, match=r"answered 500 \(reward 'picky' failed: .*\) on each of 2 tries"):
            client(torch.zeros(1, 3, 4, 4), ["bad"])


def test_closing_answers_the_batch_being_scored_and_503s_the_queued_ones():
    entered, gate = threading.Event(), threading.Event()

    def gated(images, prompts, **metadata):
        entered.set()
        gate.wait(timeout=10)
        return images.mean(dim=(1, 2, 3))

    server = RewardServer(gated, name="gated", port=0, batch_wait_s=0).start()
    out = {}

    def send(name, size):  # two image sizes: never merged into one reward call
        body = {"prompts": ["a"], "images": encode_images(torch.zeros(1, 3, size, size))}
        out[name] = post(server.url + "/score", json.dumps(body).encode())

    first = threading.Thread(target=send, args=("scoring", 4))
    first.start()
    assert entered.wait(timeout=10)
    second = threading.Thread(target=send, args=("queued", 5))
    second.start()
    deadline = time.monotonic() + 10
    while server._queue.qsize() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    closing = threading.Thread(target=server.close)
    closing.start()
    time.sleep(0.1)
    gate.set()
    for thread in (first, second, closing):
        thread.join(timeout=20)
    assert out["scoring"] == (200, {"scores": [0.0]})
    assert out["queued"] == (503, {"error": "the reward server is shutting down"})  # the client retries a 503


def test_a_token_is_required_when_set(images, monkeypatch):
    monkeypatch.delenv("FLOWRL_REWARD_TOKEN", raising=False)
    with RewardServer(JpegCompressibility(), name="jpeg", port=0, token="s3cret").start() as server:
        with pytest.raises(RewardServerError, match=r"refused the request \(401: missing token.*FLOWRL_REWARD_TOKEN"):
            HttpReward(server.url)(images, PROMPTS)
        with pytest.raises(RewardServerError, match=r"401: wrong token.*differs from the server's --token"):
            HttpReward(server.url, token="guess")(images, PROMPTS)
        assert HttpReward(server.url, token="s3cret")(images, PROMPTS).shape == (5,)
        monkeypatch.setenv("FLOWRL_REWARD_TOKEN", "s3cret")
        assert HttpReward(server.url)(images, PROMPTS).shape == (5,)
        assert server.stats["requests"] == 2


@pytest.mark.parametrize(
    "body, match",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        ({"prompts": ["a"], "images": {"format": "gif", "data": []}}, "unknown image format 'gif'"),
        ({"prompts": ["a", "b"], "images": "png"}, "'images' must be an object"),
        ({"prompts": ["a", "b"], "images": {"format": "png", "data": ["bm90IGEgcG5n"] * 2}}, "is not a PNG"),
        ({"prompts": ["a"], "images": {"format": "png", "data": ["*"]}}, "not valid base64"),
        ({"prompts": ["a"], "image": {}}, "unknown key"),
        ("two_prompts_one_image", "got 1 images but 2 prompts"),
        ("raw_wrong_shape", "must be \\[B, 3, H, W\\]"),
        ("raw_wrong_bytes", "needs 192"),
        ("wrong_metadata", "metadata 'answer' must be a list of 1 values"),
        ("two_sizes", "all images must have one size"),
    ],
)
def test_malformed_requests_get_a_one_line_400(jpeg_server, body, match):
    one = encode_images(torch.zeros(1, 3, 4, 4))
    raw = encode_images(torch.zeros(1, 3, 4, 4), "raw")
    cases = {
        "two_prompts_one_image": {"prompts": ["a", "b"], "images": one},
        "raw_wrong_shape": {"prompts": ["a"], "images": {**raw, "shape": [1, 4, 4, 3]}},
        "raw_wrong_bytes": {"prompts": ["a"], "images": {**raw, "data": raw["data"][:-8]}},
        "wrong_metadata": {"prompts": ["a"], "images": one, "metadata": {"answer": [1, 2]}},
        "two_sizes": {
            "prompts": ["a", "b"],
            "images": {"format": "png", "data": one["data"] + encode_images(torch.zeros(1, 3, 5, 4))["data"]},
        },
    }
    body = cases[body] if isinstance(body, str) else body
    status, answer = post(jpeg_server.url + "/score", body if isinstance(body, bytes) else json.dumps(body).encode())
    assert status == 400 and re.search(match, answer["error"]), answer
    assert "\n" not in answer["error"]
    status, _ = post(jpeg_server.url + "/score", json.dumps({"prompts": ["a"], "images": one}).encode())
    assert status == 200  # the server lives on


def test_an_oversized_body_gets_413_before_it_is_read_and_the_client_halves_its_chunk(images):
    with RewardServer(JpegCompressibility(), name="jpeg", port=0, max_body_bytes=4000).start() as server:
        client = HttpReward(server.url, format="raw", raw_dtype="uint8")  # about 1.6 kB per image: 2 fit, not 3
        assert torch.equal(client(images, PROMPTS), JpegCompressibility()(images, PROMPTS))
        assert server.stats["requests"] == 3  # 5 -> 2 + 3 -> 2 + (1 + 2)
        too_big = r"refused a \d+-byte request for one image \(413: .*at most 4000\); use format='png' or .*max-body"
        with pytest.raises(RewardServerError, match=too_big):
            HttpReward(server.url, format="raw")(torch.rand(1, 3, 32, 32), PROMPTS[:1])  # 16 kB
        host, port = server.address
        connection = http.client.HTTPConnection(host, port, timeout=5)
        connection.putrequest("POST", "/score")
        connection.putheader("Content-Length", str(10**12))  # a terabyte announced, never sent
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 413 and "at most 4000" in json.loads(response.read())["error"]
        connection.close()
        # a 3 MB body sent in full is read and dropped: the client gets the answer, not a reset connection
        answer = httpx.post(f"{server.url}/score", content=b"x" * 3_000_000, timeout=10)
        assert answer.status_code == 413 and "at most 4000" in answer.json()["error"]
        assert HttpReward(server.url, format="png")(torch.zeros(1, 3, 16, 24), PROMPTS[:1]).shape == (1,)


def test_a_server_that_is_down_is_a_clear_error_after_the_deadline(images, caplog):
    port = free_port()
    client = HttpReward(f"127.0.0.1:{port}", deadline_s=0.5, backoff=0.01, timeout_s=2)
    start = time.monotonic()
    caplog.set_level(logging.WARNING, logger="flowrl.rewards.serving.http")
    with pytest.raises(RewardServerUnavailable) as info:
        client(images, PROMPTS)
    assert 0.5 <= time.monotonic() - start < 5
    message = str(info.value)
    assert f"http://127.0.0.1:{port}/score is unreachable (ConnectionRefusedError" in message and "\n" not in message
    assert re.search(
        rf"gave up after \d+ tries in 0\.\d s \(deadline_s=0\.5\); start it with `flowrl serve-reward "
        rf"NAME --port {port}`",
        message,
    ), message
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, rewards.RewardError)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"reward server http://127.0.0.1:{port}/score unreachable, retrying for up to 0.5 s"
    ]


class _Replies:
    """A stand-in for the client's `httpx.Client`: answers each POST with the next of `replies` (a status code or
    an exception to raise) and records the request ids it was sent."""

    def __init__(self, *replies):
        self.replies, self.ids = list(replies), []

    def post(self, url, content, headers):
        self.ids.append(headers["X-Request-ID"])
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        payload = {"scores": [0.5] * len(json.loads(content)["prompts"])} if reply == 200 else {"error": "busy"}
        return httpx.Response(reply, json=payload, headers={"X-Request-ID": headers["X-Request-ID"]})


def test_unavailable_answers_are_waited_for_and_other_5xx_retried_a_few_times(caplog):
    client = HttpReward("127.0.0.1:1", backoff=0.001, retries=1)
    fake = _Replies(503, httpx.ReadTimeout("slow"), 502, httpx.RemoteProtocolError("gone"), 504, 200)
    client._http = lambda: fake
    with caplog.at_level(logging.WARNING, logger="flowrl.rewards.serving.http"):
        assert client(torch.zeros(2, 3, 4, 4), ["a", "b"]).tolist() == [0.5, 0.5]
    assert len(set(fake.ids)) == 1 and len(fake.ids) == 6  # one request, resent as it was
    metrics = client.pop_metrics()
    assert metrics["requests"] == 1 and metrics["retries"] == 5 and metrics["waited_s"] > 0
    assert client.pop_metrics() == {"requests": 0, "retries": 0, "waited_s": 0.0}
    assert "unreachable, retrying for up to 600 s (answered 503 (busy))" in caplog.records[0].getMessage()
    assert "answers again" in caplog.records[-1].getMessage() and len(caplog.records) == 2
    fake = _Replies(500, 500, 200)
    client._http = lambda: fake
    with pytest.raises(RewardServerError, match=r"answered 500 \(busy\) on each of 2 tries"):
        client(torch.zeros(2, 3, 4, 4), ["a", "b"])
    fake = _Replies(200)
    client._http = lambda: fake
    fake.post = lambda url, content, headers: httpx.Response(200, json={"scores": [1]}, headers={"X-Request-ID": "x"})
    with pytest.raises(RewardServerError, match="answered request x, not"):
        client(torch.zeros(1, 3, 4, 4), ["a"])


def test_a_retried_request_id_is_scored_once(images):
    calls = []

    def counted(images, prompts, **metadata):
        calls.append(len(prompts))
        return images.mean(dim=(1, 2, 3))

    with RewardServer(counted, name="mean", port=0).start() as server:
        body = request_body(images, PROMPTS)
        answers = [
            httpx.post(f"{server.url}/score", content=body, headers={"X-Request-ID": rid}, timeout=10)
            for rid in ("r1", "r1", "r2")
        ]
        assert [a.status_code for a in answers] == [200] * 3
        assert [a.headers["X-Request-ID"] for a in answers] == ["r1", "r1", "r2"]
        assert answers[0].json() == answers[1].json() == answers[2].json()
        assert calls == [5, 5] and server.stats["repeats"] == 1  # r1's retry was answered from r1
        other = request_body(images[:2], PROMPTS[:2])  # the id reused for another body: scored as a new request
        answer = httpx.post(f"{server.url}/score", content=other, headers={"X-Request-ID": "r1"}, timeout=10)
        assert len(answer.json()["scores"]) == 2 and calls == [5, 5, 2]


def test_a_wrong_answer_names_the_url(images):
    def short(images, prompts, **metadata):
        return torch.zeros(len(prompts))

    with RewardServer(short, name="short", port=0).start() as server:
        client = HttpReward(server.url)
        original = client._post
        client._post = lambda body: {"scores": original(body)["scores"][:-1]}
        with pytest.raises(RewardServerError, match=rf"{server.url}/score returned 4 scores for 5 images"):
            client(images, PROMPTS)
        client._post = lambda body: {"scores": ["high"] * 5}
        with pytest.raises(RewardServerError, match="not a number or null: 'high'"):
            client(images, PROMPTS)


def _start_cli_server(port: int, *args: str) -> tuple[subprocess.Popen, queue.Queue]:
    """`flowrl serve-reward jpeg_compressibility --port PORT ARGS` in a subprocess, and a queue of its output lines."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("FLOWRL_REWARD_TOKEN", None)
    command = [sys.executable, "-m", "flowrl", "serve-reward", "jpeg_compressibility", "--port", str(port), *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    return process, lines


def _wait_for_url(lines: queue.Queue, timeout: float = 60) -> str:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
        except queue.Empty:
            break
        match = re.search(r"at (http://\S+) ", seen[-1])
        if match:
            return match.group(1)
    raise AssertionError(f"flowrl serve-reward did not start: {''.join(seen)}")


def _stop(*processes) -> None:
    for process in processes:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@pytest.mark.distributed
def test_a_server_killed_mid_run_and_restarted_loses_and_duplicates_no_scores(caplog):
    """kill -9 while a batch is in flight, restart on the same port 2 s later: the client waits and every batch gets
    exactly its own scores, in order (as the reward called directly gives them)."""
    generator = torch.Generator().manual_seed(1)
    batches = [torch.rand(3 + i % 4, 3, 16, 16, generator=generator) for i in range(20)]  # sizes 3..6
    prompts = [[f"batch {i} image {j}" for j in range(len(batch))] for i, batch in enumerate(batches)]
    expected = [JpegCompressibility()(batch, p) for batch, p in zip(batches, prompts)]
    first, lines = _start_cli_server(0, "--batch-wait", "0.1")  # each request waits 0.1 s in the server
    processes, kill = [first], threading.Event()

    def kill_and_restart(port: int) -> None:
        kill.wait(timeout=60)
        _stop(processes[0])  # SIGKILL: no clean shutdown, the request in flight gets no answer
        time.sleep(2)
        processes.append(_start_cli_server(port, "--batch-wait", "0.1")[0])

    try:
        url = _wait_for_url(lines)
        client = HttpReward(url, backoff=0.05, max_backoff=0.5)  # deadline_s: the default 600 s
        killer = threading.Thread(target=kill_and_restart, args=(int(url.rsplit(":", 1)[1]),), daemon=True)
        killer.start()
        got, took = [], []
        with caplog.at_level(logging.WARNING, logger="flowrl.rewards.serving.http"):
            for i, (batch, p) in enumerate(zip(batches, prompts)):
                if i == 8:
                    kill.set()
                start = time.monotonic()
                got.append(client(batch, p))
                took.append(time.monotonic() - start)
        killer.join(timeout=30)
    finally:
        _stop(*processes)
    assert len(processes) == 2 and len(got) == len(batches)
    for i, (scores, want) in enumerate(zip(got, expected)):
        assert torch.equal(scores, want), i  # nothing lost, nothing duplicated, nothing out of order
    assert max(took) > 2 and max(took) == max(took[8:10])  # batch 8 (or 9) waited for the restart
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if f"{url}/score unreachable, retrying for up to 600 s" in m]) == 1, messages
    assert any("answers again" in m for m in messages), messages


@pytest.mark.distributed
def test_a_server_that_never_comes_back_is_one_line_after_the_deadline(images, tmp_path, capsys):
    from PIL import Image

    process, lines = _start_cli_server(0)
    try:
        url = _wait_for_url(lines)
        client = HttpReward(url, deadline_s=1.5, backoff=0.05)
        assert client(images, PROMPTS).shape == (5,)
    finally:
        _stop(process)
    start = time.monotonic()
    with pytest.raises(RewardServerUnavailable) as info:
        client(images, PROMPTS)
    assert 1.5 <= time.monotonic() - start < 5
    message = str(info.value)
    assert "\n" not in message and "(deadline_s=1.5); start it with `flowrl serve-reward NAME" in message, message
    path = tmp_path / "a.png"
    Image.new("RGB", (16, 16), "red").save(path)
    assert main(["score", "jpeg_compressibility", str(path), "--server", url, "--kwargs", '{"deadline_s": 0.3}']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"flowrl score: reward server at {url}/score is unreachable"), err


@pytest.mark.distributed
def test_a_run_whose_reward_server_goes_away_stops_cleanly_and_resumes_from_its_checkpoint(tiny_world, tmp_path):
    """The `http` reward in a training run: the server goes away in epoch 3 and stays away past `deadline_s`; the
    run stops with `RewardServerUnavailable`, epoch 2's checkpoint and the metrics stay intact, and a resume with
    the server back finishes the run."""
    from flowrl import checkpoint
    from tests.trainers.conftest import make_trainer, tiny_config, training_rows

    served = rewards.get("digits_alignment", classifiers=tiny_world.classifiers)
    port = free_port()
    section = [{"name": "http", "kwargs": {"url": f"127.0.0.1:{port}", "deadline_s": 1.0}}]
    config = tiny_config(
        "flow_grpo", tmp_path, ["run.epochs=3", "run.samples_every=0", "eval.every=0"], rewards=section
    )

    def trainer_with(fn):
        return make_trainer(tiny_world, config, reward_fns={"http": fn})

    server = RewardServer(served, name="digits_alignment", port=port).start()
    client, calls = HttpReward(**section[0]["kwargs"]), [0]

    def going_away(images, prompts, **metadata):
        calls[0] += 1  # 1: the baseline evaluation, 2 and 3: epochs 1 and 2, 4: epoch 3
        if calls[0] == 4:
            server.close()
        return client(images, prompts, **metadata)

    with pytest.raises(RewardServerUnavailable, match=rf"127\.0\.0\.1:{port}/score is unreachable .*deadline_s=1\)"):
        trainer_with(going_away).train()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["epoch_1", "epoch_2"]
    checkpoint.verify(tmp_path / "checkpoints" / "epoch_2")
    assert [r["epoch"] for r in training_rows(tmp_path)] == [1, 2]
    with RewardServer(served, name="digits_alignment", port=port).start():
        assert trainer_with(HttpReward(**section[0]["kwargs"])).train(resume=True)["epochs"] == 3
    assert [r["epoch"] for r in training_rows(tmp_path)] == [1, 2, 3]


def test_serve_reward_cli_errors_are_one_line(capsys):
    assert main(["serve-reward", "no_such_reward", "--port", "0"]) == 2
    assert "flowrl serve-reward: unknown reward 'no_such_reward'" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve-reward", "jpeg_compressibility", "--port", str(port)]) == 2
    assert "another program holds the port" in capsys.readouterr().err
    # a bad port, an argument the reward does not take, a public interface without a token: named, before any
    # model loads or any port is bound
    cases = [
        (["--port", "99999"], "--port must be between 0 and 65535 (0 picks a free port), got 99999"),
        (["--port", "0", "--set", "unknown_kw=1"], "reward 'jpeg_compressibility' takes no argument 'unknown_kw'; "),
        (["--port", "0", "--host", "0.0.0.0"], "--host 0.0.0.0 without a token lets anyone"),
    ]
    for args, match in cases:
        assert main(["serve-reward", "jpeg_compressibility", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err and "internal error" not in err, err
    assert "--insecure" in err


def test_serve_reward_without_fastapi_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` raises ImportError
    assert main(["serve-reward", "jpeg_compressibility", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'flowrl-toolkit[serve]'" in err, err


def test_the_cli_serves_until_interrupted(monkeypatch, capsys, images):
    from flowrl.rewards.serving import server as server_module

    def serve_then_interrupt(self):
        client = HttpReward(self.url)
        self.start()
        try:
            assert client(images, PROMPTS).shape == (5,)
        finally:
            self.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(server_module.RewardServer, "serve_forever", serve_then_interrupt)
    argv = ["serve-reward", "jpeg_compressibility", "--port", "0", "--set", "quality=50", "--max-batch", "8"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert re.search(r"serving reward 'jpeg_compressibility' at http://127\.0\.0\.1:\d+ ", captured.out)
    assert "stopped serving 'jpeg_compressibility'" in captured.err
