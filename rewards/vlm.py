"""A client for OpenAI-compatible chat-completions servers, which the VLM judges (`flowrl.rewards.vlm_judges`) ask
about images: vLLM (`vllm serve`), SGLang, `transformers serve`, or a hosted API.

Each question is one `POST {url}/chat/completions` with the images as base64 PNG `data:` URLs (`image_url` content
parts, in order, before the text part):

    {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},                           (optional)
                                  {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}},
                                                               ..., {"type": "text", "text": TEXT}]}],
     "temperature": 0, "max_tokens": N, "logprobs": true, "top_logprobs": 20, ...}       (the judge's fields)

`JudgeClient` sends at most `max_concurrency` requests at once (a thread pool over one pooled `httpx.Client`),
retries connection errors, timeouts, 429 and 5xx with exponential back-off and jitter (never another 4xx), caches
answers by the sha256 of the pixels, the text, the request fields and the model (in memory, optionally as JSON files
in a folder), and counts what it did for `pop_metrics`. A server that keeps failing raises a one-line `RewardError`
naming the judge, the URL and the cause.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import random
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import torch

from flowrl.cache import write_file_atomic
from flowrl.rewards import RewardError


API_KEY_ENV = "FLOWRL_JUDGE_API_KEY"
"""The environment variable a judge's API key is read from when no `api_key` is given."""
METRICS = ("requests", "cache_hits", "retries", "unparsable", "failures")
"""The counters of `JudgeClient.pop_metrics`."""
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def to_pixels(image: torch.Tensor, size: int | None = None) -> np.ndarray:
    """`[H, W, 3]` uint8 `round(255 x)` of one `[3, H, W]` image in [0, 1]; resized to `size x size` first (bilinear,
    antialiased) when `size` is given."""
    image = image.detach().float().clamp(0, 1)
    if size is not None and tuple(image.shape[-2:]) != (size, size):
        image = torch.nn.functional.interpolate(
            image[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False
        )[0].clamp(0, 1)
    return np.ascontiguousarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy())


def png_data_url(pixels: np.ndarray) -> str:
    """A `data:image/png;base64,...` URL of `[H, W, 3]` uint8 pixels (lossless)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass(frozen=True)
class Question:
    """One chat request: `images` (`[H, W, 3]` uint8 arrays, shown in order before the text), the user `text`, and an
    optional `system` message."""

    images: tuple[np.ndarray, ...]
    text: str
    system: str | None = None

    def messages(self) -> list[dict[str, Any]]:
        """The request's `messages`: the images as PNG data URLs, then the text."""
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": png_data_url(p)}} for p in self.images
        ]
        content.append({"type": "text", "text": self.text})
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, {"role": "user", "content": content}]


@dataclass(frozen=True)
class Answer:
    """A server's answer: the generated `text` and, when logprobs were asked for and sent, the first generated token's
    candidates `first_token` as `(token, logprob)` pairs (the token itself first, then its `top_logprobs`)."""

    text: str
    first_token: tuple[tuple[str, float], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        first = None if self.first_token is None else [list(t) for t in self.first_token]
        return {"text": self.text, "first_token": first}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Answer:
        first = data.get("first_token")
        return cls(str(data["text"]), None if first is None else tuple((str(t), float(lp)) for t, lp in first))

    @classmethod
    def from_response(cls, data: Any) -> Answer:
        """The answer in an OpenAI chat-completions response body; a `ValueError` if it has none."""
        try:
            choice = data["choices"][0]
            text = choice["message"].get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ValueError(f"the answer has no choices[0].message: {_one_line(json.dumps(data))}") from None
        content = (choice.get("logprobs") or {}).get("content") or []
        if not content:
            return cls(str(text))
        token = content[0]
        candidates = [(token.get("token", ""), token.get("logprob"))]
        candidates += [(t.get("token", ""), t.get("logprob")) for t in token.get("top_logprobs") or []]
        return cls(str(text), tuple((str(t), float(lp)) for t, lp in candidates if lp is not None))


def chat_url(url: str) -> str:
    """The chat-completions endpoint of `url`: `http://host:port` -> `.../v1/chat/completions`, a base URL such as
    `https://api.example.com/v1` -> `.../v1/chat/completions`, a URL ending in `/chat/completions` as it is."""
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"judge URL must look like http://HOST:PORT[/v1], got {url!r}")
    path = parts.path.rstrip("/")
    if not path:
        path = "/v1/chat/completions"
    elif not path.endswith("/chat/completions"):
        path += "/chat/completions"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _one_line(text: str, limit: int = 200) -> str:
    return " ".join(str(text).split())[:limit]


class JudgeClient:
    """Asks an OpenAI-compatible chat-completions server about images: concurrently, with retries and a cache.

    Args:
        url (`str`): the server: `http://HOST:PORT` (asked at `/v1/chat/completions`), a base URL ending in `/v1`, or
            the full chat-completions URL.
        model (`str`): the served model's name (vLLM's `--served-model-name`; `transformers serve`: the model id or
            path it serves).
        api_key (`str`, *optional*): sent as `Authorization: Bearer KEY`; defaults to `$FLOWRL_JUDGE_API_KEY` (none:
            no header, as local servers expect).
        max_concurrency (`int`, defaults to 8): requests in flight at most (a thread pool and a connection pool of
            that size, shared by every call, from any thread).
        timeout (`float`, defaults to 60): seconds per request (connecting, sending, waiting for the answer).
        retries (`int`, defaults to 3): further attempts after a connection error, a timeout, 429 or 5xx.
        backoff (`float`, defaults to 1): seconds before the first retry, doubled after each (at most `max_backoff`),
            times a random factor in [0.5, 1.5) so that many clients do not retry in step; a 429/503 `Retry-After`
            (seconds) is waited for instead when longer, up to `max_backoff`.
        max_backoff (`float`, defaults to 30): the longest wait between two attempts.
        cache_size (`int`, defaults to 4096): answers kept in memory (least recently used dropped; 0: none).
        cache_dir (`str`, *optional*): a folder where every answer is also kept as a JSON file (`KEY[:2]/KEY.json`),
            so that a restarted run or another process asks nothing twice.
        request (`dict`, *optional*): fields added to every request body, over the judge's own (e.g.
            `{"max_completion_tokens": 8}`, `{"chat_template_kwargs": {"enable_thinking": false}}`, `{"seed": 0}`).
        name (`str`, defaults to `"vlm judge"`): how errors name the judge.
        transport (`httpx.BaseTransport`, *optional*): the HTTP transport (custom networking, tests).
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        max_concurrency: int = 8,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        cache_size: int = 4096,
        cache_dir: str | os.PathLike | None = None,
        request: dict | None = None,
        name: str = "vlm judge",
        transport=None,
    ):
        if max_concurrency < 1 or timeout <= 0 or retries < 0 or backoff < 0 or max_backoff < 0 or cache_size < 0:
            raise ValueError(
                f"{name}: need max_concurrency >= 1, timeout > 0, retries, backoff, max_backoff, "
                f"cache_size >= 0; got {max_concurrency}, {timeout}, {retries}, {backoff}, "
                f"{max_backoff}, {cache_size}"
            )
        if not model:
            raise ValueError(f"{name}: model= (the served model's name) is required")
        self.url, self.model, self.name = chat_url(url), str(model), name
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.max_concurrency, self.timeout, self.retries = int(max_concurrency), float(timeout), int(retries)
        self.backoff, self.max_backoff = float(backoff), float(max_backoff)
        self.cache_size = int(cache_size)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.request = dict(request or {})
        self.transport = transport
        self._cache: OrderedDict[str, Answer] = OrderedDict()
        self._lock = threading.Lock()
        self._metrics = dict.fromkeys(METRICS, 0)
        self._http = None
        self._pool: ThreadPoolExecutor | None = None

    # ----- counters -----

    def count(self, metric: str, n: int = 1) -> None:
        """Add `n` to a counter of `METRICS` (thread-safe)."""
        with self._lock:
            self._metrics[metric] += n

    def pop_metrics(self) -> dict[str, float]:
        """The counters since the last call, then zeroed: `requests` (questions sent, first attempts), `cache_hits`
        (questions answered from the cache or by an identical question of the same call), `retries` (further
        attempts), `unparsable` (answers the judge could not read), `failures` (questions that failed for good)."""
        with self._lock:
            out = {k: float(v) for k, v in self._metrics.items()}
            self._metrics = dict.fromkeys(METRICS, 0)
        return out

    # ----- cache -----

    def key(self, question: Question, fields: dict[str, Any]) -> str:
        """The cache key: sha256 of the model, the request fields, the texts and each image's shape and pixels."""
        digest = hashlib.sha256()
        head = {
            "model": self.model,
            "fields": {**fields, **self.request},
            "system": question.system,
            "text": question.text,
            "images": [list(p.shape) for p in question.images],
        }
        digest.update(json.dumps(head, sort_keys=True, default=str).encode())
        for pixels in question.images:
            digest.update(hashlib.sha256(pixels.tobytes()).digest())
        return digest.hexdigest()

    def _cached(self, key: str) -> Answer | None:
        with self._lock:
            answer = self._cache.get(key)
            if answer is not None:
                self._cache.move_to_end(key)
                return answer
        if self.cache_dir is not None:
            path = self.cache_dir / key[:2] / f"{key}.json"
            try:
                answer = Answer.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError):  # absent, or a torn/foreign file: ask again
                return None
            self._remember(key, answer, write=False)
            return answer
        return None

    def _remember(self, key: str, answer: Answer, write: bool = True) -> None:
        if self.cache_size:
            with self._lock:
                self._cache[key] = answer
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if write and self.cache_dir is not None:
            text = json.dumps(answer.to_json())
            write_file_atomic(self.cache_dir / key[:2] / f"{key}.json", lambda tmp: tmp.write_text(text))

    # ----- asking -----

    def ask(self, questions: list[Question], fields: dict[str, Any]) -> list[Answer]:
        """The answers to `questions`, each asked with the request `fields` (`temperature`, `max_tokens`, ...): from
        the cache when asked before, else from the server, at most `max_concurrency` at once.

        Raises:
            RewardError: a question failed for good (the server stayed unreachable or failing after every retry,
                refused it with a 4xx other than 429, or answered without `choices`); the others are cancelled.
        """
        keys = [self.key(q, fields) for q in questions]
        answers: dict[str, Answer] = {}
        todo: dict[str, Question] = {}
        hits = 0
        for key, question in zip(keys, questions):
            if key in answers or key in todo:
                hits += 1
                continue
            cached = self._cached(key)
            if cached is not None:
                answers[key] = cached
                hits += 1
            else:
                todo[key] = question
        self.count("cache_hits", hits)
        if todo:
            pool = self._executor()
            futures: dict[Future, str] = {pool.submit(self._ask_one, q, fields): k for k, q in todo.items()}
            _, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for future in pending:  # a question failed for good: the rest is not asked
                future.cancel()
            wait(pending)  # the requests already in flight end (and are cached) before the error surfaces
            error = None
            for future, key in futures.items():
                if future.cancelled():
                    continue
                if future.exception() is not None:
                    error = error or future.exception()
                    continue
                answers[key] = future.result()
                self._remember(key, answers[key])
            if error is not None:
                raise error
        return [answers[k] for k in keys]

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="vlm-judge")
            return self._pool

    def _client(self):
        with self._lock:
            if self._http is None:
                try:
                    import httpx
                except ImportError as err:
                    raise ImportError(f"{self.name} needs httpx: pip install 'flowrl-toolkit[judge]'") from err
                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                limits = httpx.Limits(
                    max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
                )
                # a proxy from the environment must not capture requests to this machine
                local = urlsplit(self.url).hostname in _LOOPBACK
                self._http = httpx.Client(
                    timeout=self.timeout, limits=limits, headers=headers, trust_env=not local, transport=self.transport
                )
            return self._http

    def _ask_one(self, question: Question, fields: dict[str, Any]) -> Answer:
        body = {"model": self.model, "messages": question.messages(), **fields, **self.request}
        self.count("requests")
        try:
            data = self._post(body)
            try:
                return Answer.from_response(data)
            except ValueError as err:
                raise RewardError(f"{self.name} at {self.url}: {err}") from None
        except RewardError:
            self.count("failures")
            raise

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        delay = min(self.max_backoff, self.backoff * 2 ** (attempt - 1)) * (0.5 + random.random())
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.max_backoff))
        return delay

    def _post(self, body: dict[str, Any]) -> Any:
        """POST `body` with retries; the decoded JSON answer, or a one-line `RewardError`."""
        import httpx

        http = self._client()
        attempts = self.retries + 1
        last, retry_after = "", None
        for attempt in range(attempts):
            if attempt:
                self.count("retries")
                time.sleep(self._delay(attempt, retry_after))
            retry_after = None
            try:
                response = http.post(self.url, json=body)
            except httpx.TransportError as err:  # refused, reset, timed out, DNS
                last = f"is unreachable ({type(err).__name__}: {_one_line(err) or 'no detail'})"
                continue
            status = response.status_code
            if status == 429 or status >= 500:
                last = f"answered {status} ({_error_message(response)})"
                retry_after = _retry_after(response)
                continue
            if status >= 400:
                raise RewardError(
                    f"{self.name} at {self.url} refused the request ({status}: "
                    f"{_error_message(response)}); check model={self.model!r}, the api key and the "
                    "request fields"
                )
            try:
                return response.json()
            except ValueError:
                raise RewardError(
                    f"{self.name} at {self.url} answered with something that is not JSON: {_one_line(response.text)!r}"
                ) from None
        tries = f"{attempts} {'tries' if attempts > 1 else 'try'}"
        raise RewardError(f"{self.name} at {self.url} {last} after {tries}; start the server or fix the url")

    def close(self) -> None:
        """Close the connections and the thread pool (a later question opens them again)."""
        with self._lock:
            http, pool, self._http, self._pool = self._http, self._pool, None, None
        if pool is not None:
            pool.shutdown(wait=True)
        if http is not None:
            http.close()

    def __getstate__(self) -> dict[str, Any]:  # the connections and threads are rebuilt where it is unpickled
        state = {k: v for k, v in self.__dict__.items() if k not in ("_http", "_pool", "_lock")}
        return {**state, "_http": None, "_pool": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _error_message(response) -> str:
    """The one-line message of an error answer: its JSON `error`/`detail`/`message`, else the start of the body."""
    try:
        data = response.json()
    except ValueError:
        return _one_line(response.text) or response.reason_phrase
    if isinstance(data, dict):
        for key in ("error", "detail", "message"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return _one_line(value if isinstance(value, str) else json.dumps(value))
    return _one_line(json.dumps(data))


def _retry_after(response) -> float | None:
    try:
        return max(0.0, float(response.headers.get("retry-after", "")))
    except ValueError:
        return None
