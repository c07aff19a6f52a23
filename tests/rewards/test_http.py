"""Rewards over HTTP: `flowrl serve-reward` / `RewardServer` and the `http` reward client."""

import http.client
import json
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

import pytest
import torch

from flowrl import rewards
from flowrl.cli import main
from flowrl.rewards.http import HttpReward, RewardServerError, RewardServerUnavailable, encode_images
from flowrl.rewards.jpeg import JpegCompressibility
from flowrl.rewards.server import RewardServer


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


@pytest.mark.parametrize("format, raw_dtype", [("png", "float32"), ("raw", "float32"), ("raw", "uint8")])
def test_round_trip_equals_the_reward_called_directly(jpeg_server, images, format, raw_dtype):
    client = rewards.get("http", url=jpeg_server.url, format=format, raw_dtype=raw_dtype, batch_size=2)
    assert torch.equal(client(images, PROMPTS), JpegCompressibility()(images, PROMPTS))  # PNG/uint8: same rounding
    assert jpeg_server.stats["images"] == 5 and jpeg_server.stats["requests"] == 3  # chunks of batch_size
    with urllib.request.urlopen(f"{jpeg_server.url}/health", timeout=5) as response:
        assert json.loads(response.read()) == {"reward": "jpeg_compressibility", "status": "ok"}


def test_float_pixels_metadata_and_nan_arrive_intact(images):
    seen = {}

    def reward(images, prompts, **metadata):
        seen.update(images=images, metadata=metadata)
        scores = images.mean(dim=(1, 2, 3))
        scores[[i for i, p in enumerate(prompts) if p == "nan"]] = math.nan
        return scores

    with RewardServer(reward, name="mean", port=0).start() as server:
        client = HttpReward(server.url, format="raw")
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
                results[i] = HttpReward(server.url, format="raw")(images, ["p", "q"])
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
        "two_sizes": {"prompts": ["a", "b"], "images": {"format": "png", "data": one["data"] + encode_images(
            torch.zeros(1, 3, 5, 4))["data"]}},
    }  # fmt: skip
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
        host, port = server.httpd.server_address[:2]
        connection = http.client.HTTPConnection(host, port, timeout=5)
        connection.putrequest("POST", "/score")
        connection.putheader("Content-Length", str(10**12))  # a terabyte announced, never sent
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 413 and "at most 4000" in json.loads(response.read())["error"]
        connection.close()
        assert HttpReward(server.url)(torch.zeros(1, 3, 16, 24), PROMPTS[:1]).shape == (1,)  # a small PNG passes


def test_a_server_that_is_down_is_a_clear_error_after_the_retries(images):
    port = free_port()
    client = HttpReward(f"127.0.0.1:{port}", retries=2, backoff=0.01, timeout=2)
    start = time.monotonic()
    with pytest.raises(RewardServerUnavailable) as info:
        client(images, PROMPTS)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert f"http://127.0.0.1:{port}/score is unreachable (ConnectionRefusedError" in message
    assert f"after 3 tries; start it with `flowrl serve-reward NAME --port {port}`" in message
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, rewards.RewardError)


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


def _start_cli_server(port: int) -> tuple[subprocess.Popen, queue.Queue]:
    """`flowrl serve-reward jpeg_compressibility --port PORT` in a subprocess, and a queue of its output lines."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FLOWRL_REWARD_TOKEN", None)
    command = [sys.executable, "-m", "flowrl", "serve-reward", "jpeg_compressibility", "--port", str(port)]
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


def test_a_server_killed_mid_epoch_fails_clearly_and_serves_again_after_a_restart(images):
    process, lines = _start_cli_server(0)
    restarted = None
    try:
        url = _wait_for_url(lines)
        port = int(url.rsplit(":", 1)[1])
        expected = JpegCompressibility()(images, PROMPTS)
        assert torch.equal(HttpReward(url)(images, PROMPTS), expected)
        process.kill()  # SIGKILL: no clean shutdown
        process.wait(timeout=10)
        with pytest.raises(RewardServerUnavailable, match=rf"{url}/score is unreachable .*--port {port}`"):
            HttpReward(url, retries=1, backoff=0.01)(images, PROMPTS)
        restarted, _ = _start_cli_server(port)  # the client retries while it starts
        assert torch.equal(HttpReward(url, retries=10, backoff=0.1)(images, PROMPTS), expected)
    finally:
        for proc in (process, restarted):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def test_serve_reward_cli_errors_are_one_line(capsys):
    assert main(["serve-reward", "no_such_reward", "--port", "0"]) == 2
    assert "flowrl serve-reward: unknown reward 'no_such_reward'" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve-reward", "jpeg_compressibility", "--port", str(port)]) == 2
    assert "another program holds the port" in capsys.readouterr().err


def test_the_cli_serves_until_interrupted(monkeypatch, capsys, images):
    from flowrl.rewards import server as server_module

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
