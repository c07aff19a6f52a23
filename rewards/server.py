"""Serve a registered reward over HTTP: one model copy, many clients, requests batched together.

    flowrl serve-reward pickscore --port 8000 --set device=cuda      # or, in Python:
    serve_reward("pickscore", port=8000, reward_kwargs={"device": "cuda"})

Handler threads decode each request (JSON, base64 PNG or raw pixels; never pickle) and queue it; one worker
thread takes the queued requests that arrive within `batch_wait_s` of each other (up to `max_batch` images, same
image size and metadata keys), scores them with one reward call and hands each request its own scores. The protocol
is in `flowrl.rewards.http`, whose `HttpReward` is the client.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from flowrl.rewards import check_output
from flowrl.rewards.http import decode_images, scores_to_json


logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024
"""Default request size limit (256 MiB: 64 noisy 1024 px PNGs after base64 come close to it)."""
MAX_PIXELS = 64 * 1024 * 1024
"""Default limit on the pixels (`B * H * W`) of one request, checked before decoding (256 images of 512 x 512)."""
_DRAIN_BYTES, _DRAIN_SECONDS = 1 << 30, 5.0  # after an early 401/413, drop at most this much of the body (never
# stored) so that a client still sending it reads the answer instead of a reset connection


class _HTTPServer6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class RequestError(Exception):
    """A request the server answers with `status` and the one-line `{"error": message}`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class _Job:
    images: torch.Tensor
    prompts: list[str]
    metadata: dict[str, list]
    done: threading.Event = field(default_factory=threading.Event)
    scores: torch.Tensor | None = None
    error: str | None = None

    @property
    def key(self) -> tuple:
        """Requests with equal keys can be scored in one call (same image size, same metadata keys)."""
        return tuple(self.images.shape[1:]), tuple(sorted(self.metadata))


class RewardServer:
    """An HTTP server for one reward callable (`POST /score`, `GET /health`), with cross-request batching.

    Args:
        reward (`Callable`): `reward(images, prompts, **metadata) -> [B]` (only the worker thread calls it).
        name (`str`, defaults to `"reward"`): the name `/health` and error messages give.
        host (`str`, defaults to `"127.0.0.1"`): the interface to bind (`0.0.0.0` exposes it to the network: set a
            token).
        port (`int`, defaults to 8000): `0` picks a free port (see `url`).
        token (`str`, *optional*): when set, `/score` needs `Authorization: Bearer TOKEN` (else 401).
        max_batch (`int`, defaults to 64): merge queued requests up to this many images per reward call (a larger
            request is scored alone; the reward splits it by its own `batch_size`).
        max_body_bytes (`int`, defaults to 256 MiB): larger requests get 413 before their body is read.
        max_pixels (`int`, defaults to 64 Mi): more pixels (`B * H * W`) in one request get 400 before decoding.
        batch_wait_s (`float`, defaults to 0.01): how long the worker waits for more requests to merge.
    """

    def __init__(self, reward: Callable[..., Any], name: str = "reward", host: str = "127.0.0.1", port: int = 8000,
                 token: str | None = None, max_batch: int = 64, max_body_bytes: int = MAX_BODY_BYTES,
                 max_pixels: int = MAX_PIXELS, batch_wait_s: float = 0.01):  # fmt: skip
        if max_batch < 1 or max_body_bytes < 1 or max_pixels < 1 or batch_wait_s < 0:
            raise ValueError(f"reward server: need max_batch, max_body_bytes, max_pixels >= 1 and batch_wait_s >= 0; "
                             f"got {max_batch}, {max_body_bytes}, {max_pixels}, {batch_wait_s}")  # fmt: skip
        self.reward, self.name, self.token = reward, name, token or None
        self.max_batch, self.max_body_bytes, self.max_pixels = max_batch, max_body_bytes, max_pixels
        self.batch_wait_s = batch_wait_s
        self.stats = {"requests": 0, "reward_calls": 0, "images": 0}
        """Scored requests, reward calls (fewer than requests when batching merged some) and images."""
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._held: deque[_Job] = deque()  # taken from the queue but not mergeable into the batch being built
        self._lock = threading.Lock()
        self._closed = False
        server_class = _HTTPServer6 if ":" in host else ThreadingHTTPServer
        try:
            self.httpd = server_class((host, port), _make_handler(self))
        except OSError as err:
            busy = " (another program holds the port: pick another with --port)"
            busy = busy if err.errno == errno.EADDRINUSE else ""
            raise OSError(f"cannot serve reward {name!r} on {host}:{port}: {err.strerror or err}{busy}") from None
        self.httpd.daemon_threads = True
        self._worker = threading.Thread(target=self._work, name="flowrl-reward-server", daemon=True)
        self._worker.start()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """`http://HOST:PORT` of the bound socket (the real port when `port=0`)."""
        host, port = self.httpd.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Answer requests until `close()` (from another thread) or Ctrl-C; closes the server on the way out."""
        try:
            self.httpd.serve_forever(poll_interval=0.2)
        finally:
            self.close()

    def start(self) -> RewardServer:
        """Answer requests in a background thread (for tests and notebooks); `close()` stops it."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="flowrl-reward-http", daemon=True)  # fmt: skip
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop answering, fail the queued requests with 503 and release the port."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()
        self._queue.put(None)
        self._worker.join(timeout=10)
        for job in [*self._held, *_drain(self._queue)]:
            if job is not None:
                job.error = "the reward server is shutting down"
                job.done.set()

    def __enter__(self) -> RewardServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, images: torch.Tensor, prompts: list[str], metadata: dict[str, list]) -> torch.Tensor:
        """Queue one request and wait for its scores; a `RequestError` (500/503) when the reward fails."""
        job = _Job(images, prompts, metadata)
        if self._closed:
            raise RequestError(503, "the reward server is shutting down")
        self._queue.put(job)
        while not job.done.wait(timeout=1.0):
            if not self._worker.is_alive():  # closed while this request was being queued
                raise RequestError(503, "the reward server is shutting down")
        if job.error is not None:
            raise RequestError(503 if self._closed else 500, job.error)
        return job.scores

    def _next(self, timeout: float | None) -> _Job | None:
        if self._held:
            return self._held.popleft()
        return self._queue.get(timeout=timeout)

    def _work(self) -> None:
        while True:
            try:
                first = self._next(timeout=None)
            except queue.Empty:  # pragma: no cover (a blocking get does not time out)
                continue
            if first is None:
                return
            batch, size = [first], len(first.prompts)
            for job in list(self._held):  # earlier leftovers that fit join first
                if size >= self.max_batch:
                    break
                if job.key == first.key and size + len(job.prompts) <= self.max_batch:
                    self._held.remove(job)
                    batch.append(job)
                    size += len(job.prompts)
            deadline = time.monotonic() + self.batch_wait_s
            stop = False
            while size < self.max_batch:
                try:
                    job = self._queue.get(timeout=max(deadline - time.monotonic(), 0))
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                if job.key == first.key and size + len(job.prompts) <= self.max_batch:
                    batch.append(job)
                    size += len(job.prompts)
                else:
                    self._held.append(job)
            self._score(batch)
            if stop:
                return

    def _score(self, batch: list[_Job]) -> None:
        try:
            self._call(batch)
        except Exception as err:  # noqa: BLE001  (a reward error becomes the requests' 500, never a dead worker)
            if len(batch) > 1:  # one bad request must not fail the others merged with it
                for job in batch:
                    self._score([job])
                return
            message = f"reward {self.name!r} failed: {type(err).__name__}: {err}"
            logger.warning(message)
            batch[0].error = " ".join(message.split())
        for job in batch:
            job.done.set()

    def _call(self, batch: list[_Job]) -> None:
        images = torch.cat([job.images for job in batch]) if len(batch) > 1 else batch[0].images
        prompts = [p for job in batch for p in job.prompts]
        metadata = {key: [v for job in batch for v in job.metadata[key]] for key in batch[0].metadata}
        self.stats["reward_calls"] += 1
        scores = check_output(self.name, self.reward(images, prompts, **metadata), len(prompts))
        start = 0
        for job in batch:
            job.scores = scores[start : start + len(job.prompts)]
            start += len(job.prompts)
        self.stats["requests"] += len(batch)
        self.stats["images"] += len(prompts)


def _drain(q: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def parse_request(body: bytes, max_pixels: int | None = None) -> tuple[torch.Tensor, list[str], dict[str, list]]:
    """`(images, prompts, metadata)` of a `/score` request body; a `RequestError` (400) naming what is wrong."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, f"the body is not valid JSON: {err}") from None
    if not isinstance(request, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(request).__name__}")
    unknown = sorted(set(request) - {"prompts", "images", "metadata"})
    if unknown:
        raise RequestError(400, f"unknown key(s) {', '.join(map(repr, unknown))}; expected prompts, images, metadata")
    prompts = request.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError(400, "'prompts' must be a list of strings")
    if "images" not in request:
        raise RequestError(400, "'images' is missing")
    try:
        images = decode_images(request["images"], max_pixels=max_pixels)
    except ValueError as err:
        raise RequestError(400, str(err)) from None
    if len(images) != len(prompts):
        raise RequestError(400, f"got {len(images)} images but {len(prompts)} prompts")
    metadata = request.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise RequestError(400, "'metadata' must be an object of per-sample lists")
    for key, value in metadata.items():
        if not isinstance(value, list) or len(value) != len(prompts):
            raise RequestError(400, f"metadata {key!r} must be a list of {len(prompts)} values (one per image)")
    return images, prompts, metadata


def _make_handler(server: RewardServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "flowrl-reward"
        timeout = 120  # seconds a connection may sit idle (or trickle a body) before it is dropped

        def log_message(self, format: str, *args) -> None:  # requests are not logged; reward failures are
            pass

        def _send(self, status: int, payload: dict, close: bool = False) -> None:
            data = json.dumps(payload, allow_nan=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def _refuse(self, status: int, message: str, unread: int = 0) -> None:
            """Answer an error before reading the body; drop (never store) a bounded part of it, then close."""
            self._send(status, {"error": message}, close=True)
            if unread > 0:
                self.connection.settimeout(1.0)
                left, deadline = min(unread, _DRAIN_BYTES), time.monotonic() + _DRAIN_SECONDS
                try:
                    while left > 0 and time.monotonic() < deadline:
                        chunk = self.rfile.read1(min(left, 1 << 16))
                        if not chunk:
                            break
                        left -= len(chunk)
                except OSError:
                    pass

        def do_GET(self) -> None:
            if self.path.split("?")[0] == "/health":
                self._send(200, {"reward": server.name, "status": "ok"})
            elif self.path.split("?")[0] == "/score":
                self._send(405, {"error": "use POST /score"})
            else:
                self._send(404, {"error": f"no such endpoint {self.path!r}; use POST /score or GET /health"})

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length", ""))
                if length < 0:
                    raise ValueError
            except ValueError:
                self._send(411, {"error": "a Content-Length header is required"}, close=True)
                return
            if self.path.split("?")[0] != "/score":
                self._refuse(404, f"no such endpoint {self.path!r}; use POST /score", length)
                return
            if server.token is not None:
                given = self.headers.get("Authorization", "")
                scheme, _, token = given.partition(" ")
                valid = hmac.compare_digest(token.strip().encode(), server.token.encode())
                if scheme.lower() != "bearer" or not valid:
                    reason = "missing" if not given else "wrong"
                    self._refuse(401, f"{reason} token: send Authorization: Bearer TOKEN", length)
                    return
            if length > server.max_body_bytes:
                self._refuse(413, f"the body has {length} bytes; this server takes at most {server.max_body_bytes}",
                             length)  # fmt: skip
                return
            try:
                body = self.rfile.read(length)
                if len(body) != length:
                    raise RequestError(400, f"the body ended after {len(body)} of {length} bytes")
                images, prompts, metadata = parse_request(body, server.max_pixels)
                del body
                if not prompts:
                    self._send(200, {"scores": []})
                    return
                scores = server.submit(images, prompts, metadata)
                self._send(200, {"scores": scores_to_json(scores)})
            except RequestError as err:
                self._send(err.status, {"error": " ".join(str(err).split())}, close=err.status == 400)
            except Exception as err:  # noqa: BLE001  (never let a request kill the handler without an answer)
                logger.exception("reward server: unexpected error")
                self._send(500, {"error": f"internal error: {type(err).__name__}: {' '.join(str(err).split())}"})

    return Handler


def serve_reward(name: str, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
                 max_batch: int = 64, max_body_bytes: int = MAX_BODY_BYTES, max_pixels: int = MAX_PIXELS,
                 batch_wait_s: float = 0.01, reward_kwargs: dict[str, Any] | None = None,
                 ready: Callable[[RewardServer], None] | None = None) -> None:  # fmt: skip
    """Build the reward `name` once and serve it until Ctrl-C (or `RewardServer.close()` from another thread).

    Args:
        name (`str`): a registered reward or `package.module:attribute` (`rewards.get(name, **reward_kwargs)`).
        host, port, token, max_batch, max_body_bytes, max_pixels, batch_wait_s: see `RewardServer`.
        reward_kwargs (`dict`, *optional*): the reward's constructor arguments (`device`, `model`, ...).
        ready (`Callable`, *optional*): called with the server once it listens (the CLI prints its URL).
    """
    from flowrl import rewards

    reward = rewards.get(name, **(reward_kwargs or {}))
    server = RewardServer(reward, name=name, host=host, port=port, token=token, max_batch=max_batch,
                          max_body_bytes=max_body_bytes, max_pixels=max_pixels, batch_wait_s=batch_wait_s)  # fmt: skip
    if ready is not None:
        ready(server)
    server.serve_forever()
