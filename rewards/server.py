"""Serve a registered reward over HTTP: one model copy, many clients, requests batched together.

    flowrl serve-reward pickscore --port 8000 --set device=cuda      # or, in Python:
    serve_reward("pickscore", port=8000, reward_kwargs={"device": "cuda"})

The stack is FastAPI on uvicorn (the `serve` extra: `pip install 'flowrl-toolkit[serve]'`). uvicorn's event loop
reads the requests and checks the token and the announced size before any body is read; a thread pool decodes each
body (JSON, base64 raw pixels or PNG/JPEG/WebP; never pickle) and queues it; one worker thread owns the reward and
takes the queued requests that arrive within `batch_wait_s` of each other (up to `max_batch` images, same image size
and metadata keys), scores them with one reward call and hands each request its own scores. The protocol is in
`flowrl.rewards.http`, whose `HttpReward` is the client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import hmac
import json
import logging
import queue
import re
import socket
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.rewards import check_output
from flowrl.rewards.http import REQUEST_ID_HEADER, decode_images, scores_to_json


logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024
"""Default request size limit (256 MiB: 64 noisy 1024 px PNGs after base64 come close to it)."""
MAX_PIXELS = 64 * 1024 * 1024
"""Default limit on the pixels (`B * H * W`) of one request, checked before decoding (256 images of 512 x 512)."""
BODY_TIMEOUT_S = 120.0
"""A request body must arrive within this many seconds (a client trickling one is answered 408 and dropped)."""
KEEP_ALIVE_S = 120.0
"""How long an idle keep-alive connection stays open."""
REMEMBERED = 256
"""Request ids (`X-Request-ID`) whose requests the server remembers: a retry of one is answered from it."""
_DRAIN_BYTES, _DRAIN_SECONDS = 1 << 30, 5.0  # after an early 401/413, drop at most this much of the body (never
# stored) so that a client still sending it reads the answer instead of a reset connection
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
_INLINE_BYTES = 1 << 16  # smaller bodies are decoded on the event loop (a thread hop would cost more)
SERVE_EXTRA = "pip install 'flowrl-toolkit[serve]'"


def require_serve_stack() -> None:
    """Raise a one-line `RuntimeError` saying how to install FastAPI and uvicorn when either is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        missing = err.name or "fastapi or uvicorn"
        raise RuntimeError(f"the reward server needs FastAPI and uvicorn ({missing} is not installed): "
                           f"{SERVE_EXTRA}") from None  # fmt: skip


class RequestError(Exception):
    """A request the server answers with `status` and the one-line `{"error": message}`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class _Job:
    images: torch.Tensor | None
    prompts: list[str]
    metadata: dict[str, list]
    fingerprint: tuple = ()
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    scores: torch.Tensor | None = None
    error: str | None = None
    status: int = 500
    """The HTTP status of `error`: 500 (the reward raised) or 503 (the server closed before scoring it)."""

    @property
    def key(self) -> tuple:
        """Requests with equal keys can be scored in one call (same image size, same metadata keys)."""
        return tuple(self.images.shape[1:]), tuple(sorted(self.metadata))

    def finish(self, error: str | None = None, status: int = 500) -> None:
        """Hand the scores (or `error`, answered with `status`) to whoever waits; the pixels are dropped (a
        remembered job keeps its scores only)."""
        if error is not None and self.scores is None and self.error is None:
            self.error, self.status = error, status
        self.images = None
        try:
            self.future.set_result(None)
        except concurrent.futures.InvalidStateError:  # finished already
            pass


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


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

    The port is bound here (a busy one is a one-line `OSError`); `start()` serves from a background thread,
    `serve_forever()` from this one.
    """

    def __init__(self, reward: Callable[..., Any], name: str = "reward", host: str = "127.0.0.1", port: int = 8000,
                 token: str | None = None, max_batch: int = 64, max_body_bytes: int = MAX_BODY_BYTES,
                 max_pixels: int = MAX_PIXELS, batch_wait_s: float = 0.01):  # fmt: skip
        if max_batch < 1 or max_body_bytes < 1 or max_pixels < 1 or batch_wait_s < 0:
            raise ValueError(f"reward server: need max_batch, max_body_bytes, max_pixels >= 1 and batch_wait_s >= 0; "
                             f"got {max_batch}, {max_body_bytes}, {max_pixels}, {batch_wait_s}")  # fmt: skip
        require_serve_stack()
        import uvicorn

        self.reward, self.name, self.token = reward, name, token or None
        self.max_batch, self.max_body_bytes, self.max_pixels = max_batch, max_body_bytes, max_pixels
        self.batch_wait_s = batch_wait_s
        self.stats = {"requests": 0, "reward_calls": 0, "images": 0, "repeats": 0}
        """Scored requests, reward calls (fewer than requests when batching merged some), images, and retried
        requests answered from the one with their request id (never scored twice)."""
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._held: deque[_Job] = deque()  # taken from the queue but not mergeable into the batch being built
        self._recent: OrderedDict[str, _Job] = OrderedDict()  # request id -> its job (the event loop's only)
        self._lock = threading.Lock()
        self._closed = False
        self._accepting = True  # False once the worker has stopped: nothing may be queued then
        self._socket = _bind(host, port, name)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        """`(host, port)` of the bound socket (the real port when `port=0`)."""
        config = uvicorn.Config(_make_app(self), log_config=None, log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=int(KEEP_ALIVE_S), timeout_graceful_shutdown=5,
                                server_header=False, headers=[("server", "flowrl-reward")])  # fmt: skip
        self._uvicorn = uvicorn.Server(config)
        self._serving = False
        self._worker = threading.Thread(target=self._work, name="flowrl-reward-server", daemon=True)
        self._worker.start()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """`http://HOST:PORT` of the bound socket (the real port when `port=0`)."""
        host, port = self.address
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    @property
    def closed(self) -> bool:
        return self._closed

    def serve_forever(self) -> None:
        """Answer requests until `close()` (from another thread) or Ctrl-C (the requests being scored are answered
        first); closes the server on the way out."""
        self._serving = True
        try:
            self._uvicorn.run(sockets=[self._socket])
        finally:
            self.close()

    def start(self, timeout: float = 30.0) -> RewardServer:
        """Answer requests in a background thread (for tests and notebooks); `close()` stops it."""
        self._serving = True
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]},
                                        name="flowrl-reward-http", daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the reward server for {self.name!r} did not start")
            time.sleep(0.005)
        return self

    def close(self) -> None:
        """Stop answering: the requests being scored are answered, the queued ones get 503; the port is released."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._worker.join(timeout=10)
        self._fail_queued()  # the worker fails what it holds itself (it may still be scoring a batch)
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not self._serving:  # never served: uvicorn does not own the socket yet
            self._socket.close()

    def __enter__(self) -> RewardServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, images: torch.Tensor, prompts: list[str], metadata: dict[str, list]) -> torch.Tensor:
        """Queue one request and wait for its scores (from any thread but the event loop's); a `RequestError`
        (500/503) when the reward fails."""
        job = self._enqueue(_Job(images, prompts, metadata))
        job.future.result()
        return self._scores(job)

    def _enqueue(self, job: _Job) -> _Job:
        """Queue `job` for the worker; a 503 `RequestError` once the server closes (a queued job is always
        answered: scored, or failed by the worker on its way out)."""
        with self._lock:
            if self._closed or not self._accepting:
                raise RequestError(503, "the reward server is shutting down")
            self._queue.put(job)
        return job

    def _scores(self, job: _Job) -> torch.Tensor:
        if job.error is not None:
            raise RequestError(job.status, job.error)
        return job.scores

    async def _score_body(self, body: bytes, request_id: str | None) -> torch.Tensor:
        """The scores of a request body: decoded in a worker thread, queued, awaited. A retry (a request id this
        server remembers, with the same body) waits for the first one's scores instead of being scored again."""
        from starlette.concurrency import run_in_threadpool

        known = self._recent.get(request_id) if request_id else None
        if known is not None and not (known.future.done() and known.error is not None):
            if _fingerprint(body) == known.fingerprint:
                self._recent.move_to_end(request_id)
                self.stats["repeats"] += 1
                return await self._wait(known)
        if len(body) <= _INLINE_BYTES:
            fingerprint, (images, prompts, metadata) = self._parse(body)
        else:
            fingerprint, (images, prompts, metadata) = await run_in_threadpool(self._parse, body)
        if not prompts:
            return torch.zeros(0)
        job = self._enqueue(_Job(images, prompts, metadata, fingerprint))
        if request_id:
            self._recent[request_id] = job
            self._recent.move_to_end(request_id)
            while len(self._recent) > REMEMBERED:
                self._recent.popitem(last=False)
        return await self._wait(job)

    def _parse(self, body: bytes) -> tuple[tuple, tuple]:
        return _fingerprint(body), parse_request(body, self.max_pixels)

    async def _wait(self, job: _Job) -> torch.Tensor:
        # shielded: a cancelled request (uvicorn's forced shutdown) must not cancel the job others may wait for
        await asyncio.shield(asyncio.wrap_future(job.future))
        return self._scores(job)

    def _next(self, timeout: float | None) -> _Job | None:
        if self._held:
            return self._held.popleft()
        return self._queue.get(timeout=timeout)

    def _work(self) -> None:
        try:
            while True:
                first = self._next(timeout=None)
                if first is None or self._closed:
                    if first is not None:
                        self._held.appendleft(first)
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
        finally:
            with self._lock:
                self._accepting = False
            while self._held:
                self._held.popleft().finish("the reward server is shutting down", 503)
            self._fail_queued()

    def _fail_queued(self) -> None:
        """Answer every queued request with 503 (the server is closing)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.finish("the reward server is shutting down", 503)

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
            batch[0].error = _one_line(message)
        for job in batch:
            job.finish()

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


def _fingerprint(body: bytes) -> tuple:
    """What tells a retried request from another one reusing its id: the body's length and the CRC-32 of its first
    and last 64 KiB (prompts, image header, metadata; a checksum of all of it would cost 8 ms per 16 MB)."""
    return len(body), zlib.crc32(body[:65536]), zlib.crc32(body[-65536:])


def _bind(host: str, port: int, name: str) -> socket.socket:
    """A listening TCP socket on `host:port`, or a one-line `OSError` (a busy port says so)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off only for sockets that say TCP (accepted ones
    # inherit it); with it on, a response written in two parts waits 40 ms for a delayed ACK on keep-alive connections
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        # a server restarted on its port must not wait for the old connections' TIME_WAIT (the port is still
        # refused while another program listens on it)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as err:
        sock.close()
        busy = " (another program holds the port: pick another with --port)" if err.errno == errno.EADDRINUSE else ""
        raise OSError(f"cannot serve reward {name!r} on {host}:{port}: {err.strerror or err}{busy}") from None
    return sock


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


def _make_app(server: RewardServer):
    """The FastAPI application of `server`: `POST /score`, `GET /health`, one-line JSON errors."""
    from fastapi import FastAPI, Request
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    def answer(status: int, payload: dict, request_id: str | None = None, close: bool = False) -> Response:
        headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
        if close:
            headers["Connection"] = "close"
        data = json.dumps(payload, allow_nan=False).encode()
        return Response(data, status_code=status, headers=headers, media_type="application/json")

    class Refusal(Response):
        """An error answered before the body is read: sent at once, then a bounded part of the body is read and
        dropped (never stored) so that a client still sending it reads the answer, then the connection closes."""

        def __init__(self, request: Request, status: int, message: str):
            headers = {"Connection": "close", **({"WWW-Authenticate": "Bearer"} if status == 401 else {})}
            super().__init__(json.dumps({"error": _one_line(message)}).encode(), status_code=status,
                             headers=headers, media_type="application/json")  # fmt: skip
            try:
                unread = int(request.headers.get("content-length", "0"))
            except ValueError:
                unread = 0
            # a client waiting for `100 Continue` sends nothing: there is nothing to drop
            self.unread = 0 if request.headers.get("expect", "").lower() == "100-continue" else unread

        async def __call__(self, scope, receive, send) -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.body, "more_body": self.unread > 0})
            if self.unread <= 0:
                return
            loop = asyncio.get_running_loop()
            left, deadline = min(self.unread, _DRAIN_BYTES), loop.time() + _DRAIN_SECONDS
            try:
                while left > 0 and loop.time() < deadline:
                    message = await asyncio.wait_for(receive(), deadline - loop.time())
                    if message["type"] != "http.request":
                        break
                    left -= len(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
            except asyncio.TimeoutError:
                pass
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    app = FastAPI(title=f"flowrl reward server ({server.name})", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        path = request.url.path
        if err.status_code == 404:
            message = f"no such endpoint {path!r}; use POST /score or GET /health"
        elif err.status_code == 405:
            message = "use POST /score" if path == "/score" else "use GET /health"
        else:
            message = str(err.detail)
        return Refusal(request, err.status_code, message)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> Response:
        logger.error("reward server: unexpected error", exc_info=err)
        return answer(500, {"error": f"internal error: {type(err).__name__}: {_one_line(err)}"}, close=True)

    async def health(request: Request) -> Response:
        if server.closed:
            return answer(503, {"error": "the reward server is shutting down"})
        return answer(200, {"reward": server.name, "status": "ok"})

    async def score(request: Request) -> Response:
        headers = request.headers
        try:
            length = int(headers.get("content-length", ""))
            if length < 0:
                raise ValueError
        except ValueError:
            return answer(411, {"error": "a Content-Length header is required"}, close=True)
        if server.token is not None:
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            valid = hmac.compare_digest(token.strip().encode(), server.token.encode())
            if scheme.lower() != "bearer" or not valid:
                reason = "missing" if not given else "wrong"
                return Refusal(request, 401, f"{reason} token: send Authorization: Bearer TOKEN")
        if length > server.max_body_bytes:
            return Refusal(request, 413, f"the body has {length} bytes; this server takes at most "
                                         f"{server.max_body_bytes}")  # fmt: skip
        if server.closed:
            return Refusal(request, 503, "the reward server is shutting down")
        request_id = headers.get(REQUEST_ID_HEADER)
        request_id = request_id if request_id and _REQUEST_ID.fullmatch(request_id) else None
        try:
            body = await asyncio.wait_for(request.body(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            return answer(408, {"error": f"the body did not arrive within {BODY_TIMEOUT_S:g} s"}, close=True)
        except ClientDisconnect:
            return Response(status_code=400)  # nobody reads it
        try:
            scores = await server._score_body(body, request_id)
        except RequestError as err:
            return answer(err.status, {"error": _one_line(err)}, request_id, close=err.status == 400)
        except Exception as err:  # noqa: BLE001  (never let a request end without an answer)
            logger.exception("reward server: unexpected error")
            return answer(500, {"error": f"internal error: {type(err).__name__}: {_one_line(err)}"}, request_id)
        return answer(200, {"scores": scores_to_json(scores)}, request_id)

    # plain routes: the handlers take the raw request (no FastAPI parameter parsing: the body is read by hand, after
    # the token and size checks)
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/score", score, methods=["POST"])
    return app


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

    require_serve_stack()  # before a large model is loaded
    reward = rewards.get(name, **(reward_kwargs or {}))
    server = RewardServer(reward, name=name, host=host, port=port, token=token, max_batch=max_batch,
                          max_body_bytes=max_body_bytes, max_pixels=max_pixels, batch_wait_s=batch_wait_s)  # fmt: skip
    if ready is not None:
        ready(server)
    server.serve_forever()
