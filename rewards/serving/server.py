"""Serve a registered reward over HTTP: one model copy, many clients, requests batched together.

    flowrl serve-reward pickscore --port 8000 --set device=cuda      # or, in Python:
    serve_reward("pickscore", port=8000, reward_kwargs={"device": "cuda"})

The stack is FastAPI on uvicorn (the `serve` extra: `pip install 'flowrl-toolkit[serve]'`). uvicorn's event loop
reads the requests and checks the token and the announced size before any body is read; a thread pool decodes each
body (JSON, base64 raw pixels or PNG/JPEG/WebP; never pickle) and queues it; one worker thread owns the reward and
takes the queued requests that arrive within `batch_wait_s` of each other (up to `max_batch` images, same image size
and metadata keys), scores them with one reward call and hands each request its own scores. The protocol is in
`flowrl.rewards.serving.wire`; `flowrl.rewards.serving.http`'s `HttpReward` is the client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.rewards import check_output
from flowrl.rewards.serving.server_app import make_app
from flowrl.rewards.serving.server_requests import (
    MAX_BODY_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_INFLIGHT_BYTES,
    MAX_PIXELS,
    PIXEL_COST,
    MemoryBudget,
    RequestError,
    bind,
    body_fingerprint,
    check_address,
    map_large_allocations,
    one_line,
    parse_request,
)


logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 120.0
"""How long an idle keep-alive connection stays open."""
REMEMBERED = 256
"""Request ids (`X-Request-ID`) whose requests the server remembers: a retry of one is answered from it."""
_INLINE_BYTES = 1 << 16  # smaller bodies are decoded on the event loop (a thread hop would cost more)
SERVE_EXTRA = "pip install 'flowrl-toolkit[serve]'"


def require_serve_stack() -> None:
    """Raise a one-line `RuntimeError` saying how to install FastAPI and uvicorn when either is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        missing = err.name or "fastapi or uvicorn"
        raise RuntimeError(
            f"the reward server needs FastAPI and uvicorn ({missing} is not installed): {SERVE_EXTRA}"
        ) from None


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
        max_pixels (`int`, defaults to 64 Mi): more pixels (`B * H * W`) in one request get 413 before decoding.
        max_image_pixels (`int`, defaults to 16 Mi): an image of more pixels (`H * W`: 4096 x 4096) gets 413 before
            decoding (a few KB of PNG can claim 8000 x 8000 pixels: 768 MB once decoded).
        max_inflight_bytes (`int`, defaults to 2 GiB): the memory budget of all requests in flight together: each
            is charged `BODY_COST` bytes per body byte from before its body is read and `PIXEL_COST` bytes per
            pixel from before its images are decoded, until it is answered. A request that does not fit now gets
            503 (the client waits and sends it again); one that could never fit gets 413 (the client halves it).
        batch_wait_s (`float`, defaults to 0.01): how long the worker waits for more requests to merge.
        insecure (`bool`, defaults to False): allow a host other than this machine's loopback without a token.

    The port is bound here (a busy one is a one-line `OSError`); `start()` serves from a background thread,
    `serve_forever()` from this one.
    """

    def __init__(
        self,
        reward: Callable[..., Any],
        name: str = "reward",
        host: str = "127.0.0.1",
        port: int = 8000,
        token: str | None = None,
        max_batch: int = 64,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_pixels: int = MAX_PIXELS,
        batch_wait_s: float = 0.01,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
        insecure: bool = False,
    ):
        limits = (max_batch, max_body_bytes, max_pixels, max_image_pixels, max_inflight_bytes)
        if min(limits) < 1 or batch_wait_s < 0:
            raise ValueError(
                "reward server: need max_batch, max_body_bytes, max_pixels, max_image_pixels, "
                f"max_inflight_bytes >= 1 and batch_wait_s >= 0; got {', '.join(map(str, limits))}, "
                f"{batch_wait_s}"
            )
        check_address(host, port, token, insecure)
        require_serve_stack()
        import uvicorn

        self.reward, self.name, self.token = reward, name, token or None
        self.max_batch, self.max_body_bytes, self.max_pixels = max_batch, max_body_bytes, max_pixels
        self.max_image_pixels, self.batch_wait_s = max_image_pixels, batch_wait_s
        self.budget = MemoryBudget(max_inflight_bytes)
        """The memory charged to the requests in flight (`budget.used`, `budget.limit`)."""
        self.stats = {"requests": 0, "reward_calls": 0, "images": 0, "repeats": 0}
        """Scored requests, reward calls (fewer than requests when batching merged some), images, and retried
        requests answered from the one with their request id (never scored twice)."""
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._held: deque[_Job] = deque()  # taken from the queue but not mergeable into the batch being built
        self._recent: OrderedDict[str, _Job] = OrderedDict()  # request id -> its job (the event loop's only)
        self._lock = threading.Lock()
        self._closed = False
        self._accepting = True  # False once the worker has stopped: nothing may be queued then
        self._socket = bind(host, port, name)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        """`(host, port)` of the bound socket (the real port when `port=0`)."""
        config = uvicorn.Config(
            make_app(self),
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=int(KEEP_ALIVE_S),
            timeout_graceful_shutdown=5,
            server_header=False,
            headers=[("server", "flowrl-reward")],
        )
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
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self._socket]}, name="flowrl-reward-http", daemon=True
        )
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
            if body_fingerprint(body) == known.fingerprint:
                self._recent.move_to_end(request_id)
                self.stats["repeats"] += 1
                return await self._wait(known)
        parsed = self._parse(body) if len(body) <= _INLINE_BYTES else await run_in_threadpool(self._parse, body)
        if isinstance(parsed, RequestError):
            try:
                raise parsed
            finally:
                del parsed  # else the error (its traceback: this frame, the body) and this frame form a cycle
        fingerprint, (images, prompts, metadata), charged = parsed
        try:
            if not prompts:
                return torch.zeros(0)
            job = self._enqueue(_Job(images, prompts, metadata, fingerprint))
            del images
            if request_id:
                self._recent[request_id] = job
                self._recent.move_to_end(request_id)
                while len(self._recent) > REMEMBERED:
                    self._recent.popitem(last=False)
            return await self._wait(job)
        finally:
            self.budget.release(charged)

    def _parse(self, body: bytes) -> tuple[tuple, tuple, int] | RequestError:
        """`(fingerprint, (images, prompts, metadata), bytes charged to the budget for the pixels)`, or the
        `RequestError` that refuses the body, returned without its traceback: raised through the thread pool's
        future, its frames (the body, the parsed JSON) would stay in a reference cycle until the next garbage
        collection."""
        charged = []

        def reserve(pixels: int) -> None:
            self.budget.charge(pixels * PIXEL_COST, f"its {pixels} pixels")
            charged.append(pixels * PIXEL_COST)

        try:
            parsed = parse_request(body, self.max_pixels, self.max_image_pixels, reserve)
        except RequestError as err:
            self.budget.release(sum(charged))
            return err.with_traceback(None)
        except BaseException:
            self.budget.release(sum(charged))
            raise
        return body_fingerprint(body), parsed, sum(charged)

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
            batch[0].error = one_line(message)
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


def serve_reward(
    name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    max_batch: int = 64,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_pixels: int = MAX_PIXELS,
    batch_wait_s: float = 0.01,
    reward_kwargs: dict[str, Any] | None = None,
    ready: Callable[[RewardServer], None] | None = None,
    **limits: Any,
) -> None:
    """Build the reward `name` once and serve it until Ctrl-C (or `RewardServer.close()` from another thread).

    Args:
        name (`str`): a registered reward or `package.module:attribute` (`rewards.get(name, **reward_kwargs)`).
        host, port, token, max_batch, max_body_bytes, max_pixels, batch_wait_s: see `RewardServer`.
        reward_kwargs (`dict`, *optional*): the reward's constructor arguments (`device`, `model`, ...).
        ready (`Callable`, *optional*): called with the server once it listens (the CLI prints its URL).
        limits: `max_image_pixels`, `max_inflight_bytes`, `insecure` (see `RewardServer`).
    """
    from flowrl import rewards

    check_address(host, port, token, limits.get("insecure", False))  # before a large model is loaded
    require_serve_stack()
    map_large_allocations()  # this process only serves: request buffers go back to the system when freed
    reward = rewards.get(name, **(reward_kwargs or {}))
    server = RewardServer(
        reward,
        name=name,
        host=host,
        port=port,
        token=token,
        max_batch=max_batch,
        max_body_bytes=max_body_bytes,
        max_pixels=max_pixels,
        batch_wait_s=batch_wait_s,
        **limits,
    )
    if ready is not None:
        ready(server)
    server.serve_forever()
