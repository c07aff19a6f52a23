"""The reward server under hostile input: decompression bombs, deep JSON, many large bodies at once, a public
interface without a token. Real HTTP requests against started servers; the memory tests read the server process's
own peak and current resident memory (`/proc/PID/status`)."""

import base64
import io
import json
import os
import re
import threading
import time

import pytest
import torch

from flowrl.rewards.jpeg import JpegCompressibility
from flowrl.rewards.serving.http import HttpReward, RewardServerError, request_body
from flowrl.rewards.serving.server import RewardServer
from flowrl.rewards.serving.server_requests import BODY_COST, PIXEL_COST

from .test_http import _start_cli_server, _stop, _wait_for_url, post


def bomb_png(size: int = 8000) -> bytes:
    """A 1-bit PNG of `size` x `size` black pixels: 7,840 bytes for 8000 x 8000 (768 MB as float32 RGB)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (size, size)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def png_request(data: bytes, count: int = 1) -> bytes:
    encoded = base64.b64encode(data).decode()
    return json.dumps({"prompts": ["a"] * count, "images": {"format": "png", "data": [encoded] * count}}).encode()


def test_images_too_large_are_refused_with_413_before_any_pixel_is_decoded():
    bomb = bomb_png()
    assert len(bomb) < 10_000
    with RewardServer(JpegCompressibility(), name="jpeg", port=0).start() as server:
        start = time.monotonic()
        status, answer = post(server.url + "/score", png_request(bomb))
        assert time.monotonic() - start < 2  # decoding it takes 8-12 s
        assert status == 413 and "image 0 is 8000x8000 (732 MiB once decoded" in answer["error"], answer
        assert "at most 16777216 pixels per image" in answer["error"]
        # raw pixels: refused from the announced shape, before the data is decoded
        raw = {"format": "raw", "dtype": "uint8", "shape": [1, 3, 8000, 8000], "data": ""}
        status, answer = post(server.url + "/score", json.dumps({"prompts": ["a"], "images": raw}).encode())
        assert status == 413 and "8000x8000" in answer["error"]
        # images each under the per-image limit but over the request's: 413 (the client sends halves)
        status, answer = post(server.url + "/score", png_request(bomb_png(4096), count=5))
        assert status == 413 and "limit of 67108864 pixels per request" in answer["error"], answer
        assert server.budget.used == 0  # nothing stays charged
        assert HttpReward(server.url)(torch.rand(2, 3, 16, 16), ["a", "b"]).shape == (2,)  # the server lives on
    with RewardServer(JpegCompressibility(), name="jpeg", port=0, max_image_pixels=32 * 32).start() as server:
        with pytest.raises(RewardServerError, match=r"413: image 0 is 48x48 .* at most 1024 pixels per image"):
            HttpReward(server.url, format="png")(torch.rand(1, 3, 48, 48), ["a"])


def test_deeply_nested_json_is_a_one_line_400():
    with RewardServer(JpegCompressibility(), name="jpeg", port=0).start() as server:
        status, answer = post(server.url + "/score", b"[" * 100_000)
        assert status == 400
        assert answer == {"error": "the body is not valid JSON: it nests arrays or objects too deeply"}


def test_requests_beyond_the_memory_budget_wait_or_shrink():
    """A request that does not fit beside the ones in flight gets 503 (the client waits and sends it again); one
    that could never fit gets 413 naming the budget (the client sends halves)."""
    images = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    prompts = [str(i) for i in range(8)]
    expected = JpegCompressibility()(images, prompts)

    def cost(n: int) -> int:  # what the client's request of n images is charged (raw uint8, its default)
        return BODY_COST * len(request_body(images[:n], prompts[:n])) + PIXEL_COST * n * 32 * 32

    with RewardServer(JpegCompressibility(), name="jpeg", port=0, max_inflight_bytes=cost(8)).start() as server:
        server.budget.charge(cost(8) - cost(1) // 2, "others in flight")  # as if other requests were being decoded
        status, answer = post(server.url + "/score", request_body(images[:1], prompts[:1]))
        assert status == 503 and re.match(r"the reward server is busy: \d+ of its \d+ bytes", answer["error"])
        client = HttpReward(server.url, backoff=0.05, max_backoff=0.2)
        threading.Timer(0.5, server.budget.release, args=(cost(8) - cost(1) // 2,)).start()  # the others end
        start = time.monotonic()
        assert torch.equal(client(images, prompts), expected)
        assert time.monotonic() - start > 0.4  # it waited for them
        assert server.budget.used == 0 and server.budget.peak <= cost(8)
    with RewardServer(JpegCompressibility(), name="jpeg", port=0, max_inflight_bytes=cost(2)).start() as server:
        assert torch.equal(HttpReward(server.url)(images, prompts), expected)
        assert server.stats["requests"] == 4  # 8 -> 4 + 4 -> 2 + 2 + 2 + 2
        with pytest.raises(RewardServerError, match=rf"413: the request needs \d+ bytes .* budget of {cost(2)} "):
            HttpReward(server.url)(torch.rand(1, 3, 128, 128), ["one image too large for the budget"])


def test_a_public_interface_needs_a_token_or_insecure():
    with pytest.raises(ValueError, match="--host 0.0.0.0 without a token lets anyone .* pass --insecure"):
        RewardServer(JpegCompressibility(), host="0.0.0.0", port=0)
    with RewardServer(JpegCompressibility(), host="0.0.0.0", port=0, token="s3cret") as server:
        assert server.address[0] == "0.0.0.0"
    with RewardServer(JpegCompressibility(), host="0.0.0.0", port=0, insecure=True) as server:
        assert server.address[0] == "0.0.0.0"
    with RewardServer(JpegCompressibility(), host="localhost", port=0) as server:  # this machine: no token needed
        assert server.address[0] == "127.0.0.1"


def _memory_mb(pid: int) -> dict[str, float]:
    """The process's peak (`VmHWM`) and current (`VmRSS`) resident memory, in MB."""
    status = open(f"/proc/{pid}/status").read()
    return {key: int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) / 1024 for key in ("VmHWM", "VmRSS")}


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/PID/status")
def test_hostile_requests_leave_the_server_s_memory_bounded():
    """`flowrl serve-reward` in its own process, its memory read from /proc: four decompression bombs at once cost
    nothing; eight 16 MB bodies at once with a 64 MB budget are read one at a time (the others get 503), and what
    they held goes back to the system; four clients scoring at once beyond the budget all get their scores."""
    process, lines = _start_cli_server(0, "--max-inflight-mb", "64")
    try:
        url = _wait_for_url(lines)
        HttpReward(url)(torch.rand(2, 3, 16, 16), ["warm", "up"])  # the reward's first call allocates its own
        base = _memory_mb(process.pid)
        answers = []

        def all_at_once(send, items):
            threads = [threading.Thread(target=send, args=(item,)) for item in items]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)

        def send(body):
            answers.append(post(url + "/score", body)[0])

        all_at_once(send, [png_request(bomb_png())] * 4)
        assert answers == [413] * 4
        assert _memory_mb(process.pid)["VmHWM"] - base["VmHWM"] < 30  # decoding one took 2.2 GB
        # valid JSON bodies of 16 MB refused once parsed (an unknown key): bodies and their JSON strings
        junk = b'{"prompts": [], "x": "' + b"A" * 16_000_000 + b'"}'
        answers.clear()
        all_at_once(send, [junk] * 8)
        assert sorted(set(answers)) <= [400, 503] and 400 in answers and 503 in answers, answers
        memory = _memory_mb(process.pid)
        assert memory["VmHWM"] - base["VmHWM"] < 64 + 30, (base, memory)  # the budget, and the server's own
        deadline = time.monotonic() + 5  # the last refused bodies may still be drained after their answer
        while memory["VmRSS"] - base["VmRSS"] >= 20 and time.monotonic() < deadline:
            time.sleep(0.1)
            memory = _memory_mb(process.pid)
        assert memory["VmRSS"] - base["VmRSS"] < 20, (base, memory)  # what they held was handed back
        # four clients, 16 images of 256 px each (about 30 MB charged a request): at most two fit at once
        batches = [torch.rand(16, 3, 256, 256, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        scores = {}

        def score(i):
            scores[i] = HttpReward(url, backoff=0.05, max_backoff=0.5)(batches[i], [str(i)] * 16)

        all_at_once(score, range(4))
        for i, batch in enumerate(batches):
            assert torch.equal(scores[i], JpegCompressibility()(batch, [str(i)] * 16)), i
        assert _memory_mb(process.pid)["VmHWM"] - base["VmHWM"] < 64 + 30
    finally:
        _stop(process)
