"""The reward server's client, the `http` reward (`HttpReward`): one reward-model copy (`flowrl serve-reward NAME`)
serves many trainers.

It posts the protocol of `flowrl.rewards.serving.wire` (plain JSON: `POST /score`, `GET /health`) over one pooled
keep-alive connection, waits for an unreachable server with back-off until `deadline_s`, retries failing answers and
turns every failure into a one-line `RewardServerError`. The protocol's names (`encode_images`, `decode_images`,
`request_body`, ...) are importable from here too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import threading
import time
import uuid
import warnings
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import torch

from flowrl.rewards import RewardError, register
from flowrl.rewards.base import Reward
from flowrl.rewards.serving.wire import (
    FORMATS,
    IMAGE_FORMATS,
    RAW_DTYPES,
    REQUEST_ID_HEADER,
    TOKEN_ENV,
    TooLarge,
    decode_images,
    encode_images,
    metadata_to_json,
    request_body,
    scores_to_json,
    to_uint8,
)


__all__ = [
    "FORMATS",
    "IMAGE_FORMATS",
    "RAW_DTYPES",
    "REQUEST_ID_HEADER",
    "TOKEN_ENV",
    "UNAVAILABLE_STATUSES",
    "HttpReward",
    "RewardServerError",
    "RewardServerUnavailable",
    "TooLarge",
    "decode_images",
    "encode_images",
    "metadata_to_json",
    "request_body",
    "scores_to_json",
    "to_uint8",
]

logger = logging.getLogger(__name__)

UNAVAILABLE_STATUSES = (502, 503, 504)
"""Answers that mean "the reward server is not there right now" (a proxy without its upstream, a server shutting
down): retried until `deadline_s`, like a refused connection."""
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class RewardServerError(RewardError):
    """A reward server answered with an error or with something that is not `{"scores": [B numbers or null]}`."""

    status: int | None = None
    """The HTTP status of an error answer (None for other failures)."""


class RewardServerUnavailable(RewardServerError, ConnectionError):
    """A reward server could not be reached (refused, reset, timed out, 502/503/504) for `deadline_s` seconds."""


def _score_url(url: str) -> str:
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"reward server URL must look like http://HOST:PORT, got {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/score"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


@register("http")
class HttpReward(Reward):
    """Scores from a reward server over HTTP (`flowrl serve-reward NAME`; needs: a running server at `url`).

    Posts each chunk of `batch_size` images as JSON to `url` over one pooled keep-alive connection (`httpx`). A
    server that is unreachable (refused, reset, no answer within `timeout_s`, 502/503/504) is waited for: the client
    logs a warning and retries with exponential back-off (`backoff`, doubled up to `max_backoff`, jittered) for up to
    `deadline_s` seconds, long enough for a large reward model to reload, then raises `RewardServerUnavailable` (a
    `RewardError` and a `ConnectionError`) naming the URL and how to start the server. Other 5xx answers (the reward
    raised) are retried `retries` times; a chunk the server refuses as too large (413) is sent again in halves.

    Exactly once: every request carries a fresh `X-Request-ID`, and a retry resends the same body with the same id.
    The client returns the scores of exactly one 200 answer per request (the answer must echo the id if it names
    one), in the order of the images, so the trainer gets each chunk's scores once, whatever was lost in between.
    A server that scored a request whose answer was lost scores the retry again (or, still up, answers it from the
    request it already scored or is scoring: `flowrl serve-reward` remembers recent ids).

    Args:
        url (`str`): the server (`http://127.0.0.1:8000`, scored at `/score`) or any endpoint speaking the protocol
            (a URL with a path is used as is).
        timeout_s (`float`, defaults to 60): seconds to wait for one answer (connecting: at most 10 of them).
        deadline_s (`float`, defaults to 600): how long to keep retrying while the server is unreachable, from the
            first failure of a request (0: fail at once).
        retries (`int`, defaults to 3): further attempts after a 5xx answer other than 502/503/504.
        backoff (`float`, defaults to 0.5): seconds before the first retry; doubled after each.
        max_backoff (`float`, defaults to 10): the longest wait between two tries.
        token (`str`, *optional*): sent as `Authorization: Bearer TOKEN`; defaults to `$FLOWRL_REWARD_TOKEN`.
        format (`str`, defaults to `"raw"`): `"raw"` (one buffer of `raw_dtype`: the fastest to encode and decode),
            `"png"` (lossless 8-bit, smaller for smooth images, slower: about 30 ms per 512 px image to encode),
            `"jpeg"` or `"webp"` (lossy at `lossy_quality`: smaller still; the scores then differ slightly).
        raw_dtype (`str`, defaults to `"uint8"`): pixel type of `"raw"`: `"uint8"` (`round(255 x)`, the same pixels
            as PNG) or `"float32"` (exact, 4x larger).
        lossy_quality (`int`, defaults to 90): JPEG / WebP quality (1-100).
        batch_size (`int`, defaults to 64): images per request.
        timeout (`float`, *optional*): the former name of `timeout_s` (deprecated).
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 60.0,
        deadline_s: float = 600.0,
        retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        token: str | None = None,
        format: str = "raw",
        raw_dtype: str = "uint8",
        lossy_quality: int = 90,
        batch_size: int = 64,
        timeout: float | None = None,
    ):
        super().__init__(device="cpu", batch_size=batch_size)
        if timeout is not None:
            warnings.warn("http reward: `timeout` is now `timeout_s`", DeprecationWarning, stacklevel=2)
            timeout_s = timeout
        if format not in FORMATS:
            raise ValueError(f"http reward: format must be one of {', '.join(FORMATS)}, got {format!r}")
        if raw_dtype not in RAW_DTYPES:
            raise ValueError(f"http reward: raw_dtype must be one of {', '.join(RAW_DTYPES)}, got {raw_dtype!r}")
        if timeout_s <= 0 or deadline_s < 0 or retries < 0 or backoff < 0 or max_backoff < backoff:
            raise ValueError(
                f"http reward: need timeout_s > 0, deadline_s >= 0, retries >= 0 and 0 <= backoff <= "
                f"max_backoff; got {timeout_s}, {deadline_s}, {retries}, {backoff}, "
                f"{max_backoff}"
            )
        if not 1 <= lossy_quality <= 100:
            raise ValueError(f"http reward: lossy_quality must be in 1..100, got {lossy_quality}")
        self.url = _score_url(url)
        self.name = f"http {self.url}"
        self.timeout_s, self.deadline_s = float(timeout_s), float(deadline_s)
        self.retries, self.backoff, self.max_backoff = int(retries), float(backoff), float(max_backoff)
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.format, self.raw_dtype, self.lossy_quality = format, raw_dtype, int(lossy_quality)
        self._client = self._target = None
        self._lock = threading.Lock()
        self._metrics = {"requests": 0, "retries": 0, "waited_s": 0.0}

    def pop_metrics(self) -> dict[str, float]:
        """Counters since the last call: requests answered, retries (resent requests) and seconds spent waiting for
        an unreachable server (a trainer logs them as `reward/NAME/...`)."""
        metrics, self._metrics = self._metrics, {"requests": 0, "retries": 0, "waited_s": 0.0}
        return metrics

    @property
    def timeout(self) -> float:
        """The former name of `timeout_s`."""
        return self.timeout_s

    def __getstate__(self) -> dict:  # copies and pickles open their own connections
        return {**self.__dict__, "_client": None, "_target": None, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def close(self) -> None:
        """Close the pooled connections (a later call opens new ones)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _http(self):
        """The `httpx.Client` of this reward (one connection pool, kept alive between calls)."""
        with self._lock:
            if self._client is None:
                import httpx

                # a proxy from the environment must not capture requests to this machine
                local = urlsplit(self.url).hostname in _LOOPBACK
                timeout = httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 10.0))
                self._client = httpx.Client(timeout=timeout, trust_env=not local, follow_redirects=False)
                self._target = httpx.URL(self.url)  # parsed once
            return self._client

    def health(self) -> dict | None:
        """The server's `GET /health` answer (`{"reward": NAME, "status": "ok"}`); None if it gives none (one try)."""
        parts = urlsplit(self.url)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            response = self._http().get(
                urlunsplit((parts.scheme, parts.netloc, "/health", "", "")),
                headers=headers,
                timeout=min(self.timeout_s, 10.0),
            )
            answer = response.json() if response.status_code == 200 else None
        except Exception:  # noqa: BLE001  (down, or not JSON: no health to report)
            return None
        return answer if isinstance(answer, dict) else None

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        try:
            return self._request(images, prompts, metadata)
        except RewardServerError as err:
            if err.status != 413 or len(prompts) < 2:
                raise
        # the server's body limit is below this chunk: score it in halves
        half = len(prompts) // 2
        parts = [
            {
                k: v[:half] if isinstance(v, (list, tuple, torch.Tensor, np.ndarray)) else v
                for k, v in metadata.items()
            },
            {
                k: v[half:] if isinstance(v, (list, tuple, torch.Tensor, np.ndarray)) else v
                for k, v in metadata.items()
            },
        ]
        return torch.cat(
            [
                self.score(images[:half], prompts[:half], **parts[0]),
                self.score(images[half:], prompts[half:], **parts[1]),
            ]
        )

    def _request(self, images: torch.Tensor, prompts: list[str], metadata: dict[str, Any]) -> torch.Tensor:
        meta = metadata_to_json(metadata, len(prompts)) if metadata else None
        body = request_body(images, prompts, meta, self.format, self.raw_dtype, self.lossy_quality)
        answer = self._post(body)
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise RewardServerError(
                f"reward server at {self.url} answered without a 'scores' list: {str(answer)[:200]}"
            )
        if len(scores) != len(prompts):
            raise RewardServerError(
                f"reward server at {self.url} returned {len(scores)} scores for {len(prompts)} images"
            )
        bad = [s for s in scores if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)))]
        if bad:
            raise RewardServerError(
                f"reward server at {self.url} returned a score that is not a number or null: {bad[0]!r}"
            )
        return torch.tensor([math.nan if s is None else float(s) for s in scores], dtype=torch.float32)

    def _delay(self, attempt: int) -> float:
        """Seconds before retry number `attempt` (1-based): exponential, capped, jittered down by up to half."""
        return min(self.backoff * 2 ** (attempt - 1), self.max_backoff) * random.uniform(0.5, 1.0)

    def _post(self, body: bytes) -> Any:
        """POST `body` until one answer (see the class docstring); the decoded JSON answer, or a one-line
        `RewardServerError`."""
        import httpx

        request_id = uuid.uuid4().hex
        headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        failed, tries, down_since, waits = 0, 0, None, 0
        while True:
            tries += 1
            try:
                client = self._http()
                response = client.post(self._target or self.url, content=body, headers=headers)
            except (httpx.UnsupportedProtocol, httpx.LocalProtocolError):
                raise
            except httpx.TransportError as err:  # refused, reset, timed out, DNS, a closed keep-alive connection
                reason = self._unreachable(err, len(body))
            else:
                status = response.status_code
                if status < 300:
                    self._metrics["requests"] += 1
                    self._metrics["retries"] += tries - 1
                    if down_since is not None:
                        waited = time.monotonic() - down_since
                        self._metrics["waited_s"] += waited
                        logger.warning("reward server %s answers again, after %.1f s", self.url, waited)
                    return self._answer(response, request_id)
                message = _error_message(response)
                if status not in UNAVAILABLE_STATUSES:
                    if status >= 500 and failed < self.retries:
                        failed += 1
                        time.sleep(self._delay(failed))
                        continue
                    tries_text = f"{failed + 1} {'tries' if failed else 'try'}"
                    if status >= 500:  # the server is up but failing: its message says why
                        text = f"reward server at {self.url} answered {status} ({message}) on each of {tries_text}"
                    else:
                        text = self._client_error(status, message, len(body))
                    error = RewardServerError(text)
                    error.status = status
                    raise error
                reason = f"answered {status} ({message})"
            now = time.monotonic()
            if down_since is None:
                down_since = now
                logger.warning(
                    "reward server %s unreachable, retrying for up to %g s (%s)", self.url, self.deadline_s, reason
                )
            waited = now - down_since
            if waited >= self.deadline_s:
                port = urlsplit(self.url).port or (443 if self.url.startswith("https") else 80)
                raise RewardServerUnavailable(
                    f"reward server at {self.url} {reason}; gave up after {tries} {'tries' if tries > 1 else 'try'} "
                    f"in {waited:.1f} s (deadline_s={self.deadline_s:g}); start it with `flowrl serve-reward NAME "
                    f"--port {port}` (NAME: the reward to serve), fix the url or raise deadline_s"
                )
            waits += 1
            time.sleep(min(self._delay(waits), self.deadline_s - waited))

    def _answer(self, response, request_id: str) -> Any:
        echoed = response.headers.get(REQUEST_ID_HEADER)
        if echoed is not None and echoed != request_id:
            raise RewardServerError(
                f"reward server at {self.url} answered request {echoed}, not {request_id} (a proxy mixing up answers?)"
            )
        try:
            return json.loads(response.content)
        except ValueError:
            raise RewardServerError(
                f"reward server at {self.url} answered with something that is not JSON: {response.content[:200]!r}"
            ) from None

    def _unreachable(self, err: Exception, size: int) -> str:
        """Why a request got no answer, in a few words, from an `httpx.TransportError`."""
        import httpx

        if isinstance(err, httpx.TimeoutException) and not isinstance(err, httpx.ConnectTimeout):
            return f"did not answer within timeout_s={self.timeout_s:g} s ({type(err).__name__})"
        inner = err  # httpx's error wraps httpcore's, which wraps the socket's: name the socket's
        wrapped = ("httpx", "httpcore")
        while (inner.__cause__ or inner.__context__) is not None and type(inner).__module__.startswith(wrapped):
            inner = inner.__cause__ or inner.__context__
        text = " ".join(str(inner).split()) or "no details"
        reason = f"is unreachable ({type(inner).__name__}: {text})"
        broken = isinstance(inner, (BrokenPipeError, ConnectionResetError)) or isinstance(err, httpx.WriteError)
        if broken and size > 1 << 20:
            reason += (
                f"; the {size}-byte request may exceed the server's body limit: lower batch_size or start the "
                "server with a larger --max-body-mb"
            )
        return reason

    def _client_error(self, code: int, message: str, size: int) -> str:
        where = f"reward server at {self.url}"
        if code == 401:
            hint = (
                f"the server was started with --token: pass the same token=... or set ${TOKEN_ENV}"
                if not self.token
                else "the token differs from the server's --token"
            )
            return f"{where} refused the request (401: {message}); {hint}"
        if code == 413 and "this server takes at most" not in message:  # its pixels: an image too large to score
            return f"{where} refused a request for one image (413: {message})"
        if code == 413:
            smaller = "use format='png' or 'jpeg' or " if self.format == "raw" else ""
            return (
                f"{where} refused a {size}-byte request for one image (413: {message}); {smaller}start the server "
                "with a larger --max-body-mb"
            )
        return f"{where} refused the request ({code}: {message})"


def _error_message(response) -> str:
    """The one-line `error` of a JSON error answer, else the start of the body (or the HTTP reason)."""
    try:
        message = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        message = response.content[:200].decode("utf-8", "replace").strip() or response.reason_phrase
    return " ".join(str(message).split())
