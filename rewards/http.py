"""A reward scored by a server over HTTP: one reward-model copy (`flowrl serve-reward NAME`) serves many trainers.

The protocol is plain JSON (no pickle), so any endpoint that speaks it works:

    POST /score   {"prompts": [B strings],
                   "images": {"format": "png", "data": [B base64 PNGs]}
                          or {"format": "raw", "dtype": "uint8" | "float32", "shape": [B, 3, H, W],
                              "data": base64 of the C-order little-endian bytes},
                   "metadata": {key: [B JSON values], ...}}            (optional)
    -> 200        {"scores": [B numbers or null]}                     (null: NaN)
    -> 4xx / 5xx  {"error": "one line"}
    GET /health   -> {"reward": NAME, "status": "ok"}

PNG and uint8 pixels are `round(255 * x)` of the [0, 1] images; float32 pixels are sent as they are. A token goes
in `Authorization: Bearer TOKEN`. The server is `flowrl.rewards.server`; the encoding helpers here are shared by both
sides.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import torch

from flowrl.rewards import RewardError, register
from flowrl.rewards.base import Reward


FORMATS = ("png", "raw")
RAW_DTYPES = {"uint8": np.dtype("<u1"), "float32": np.dtype("<f4")}
TOKEN_ENV = "FLOWRL_REWARD_TOKEN"
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class RewardServerError(RewardError):
    """A reward server answered with an error or with something that is not `{"scores": [B numbers or null]}`."""

    status: int | None = None
    """The HTTP status of an error answer (None for other failures)."""


class RewardServerUnavailable(RewardServerError, ConnectionError):
    """A reward server could not be reached (or kept failing with 5xx) after every retry."""


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """`[B, 3, H, W]` images in [0, 1] as `round(255 * x)` uint8 numpy `[B, 3, H, W]` (clamped first)."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()


def encode_images(images: torch.Tensor, format: str = "png", dtype: str = "float32") -> dict[str, Any]:
    """The protocol's `images` object for `[B, 3, H, W]` images in [0, 1].

    Args:
        images (`torch.Tensor`): `[B, 3, H, W]` floats in [0, 1].
        format (`str`, defaults to `"png"`): `"png"` (one lossless 8-bit PNG per image) or `"raw"` (one buffer).
        dtype (`str`, defaults to `"float32"`): pixel type of `"raw"`: `"float32"` (exact) or `"uint8"`.
    """
    if format == "png":
        from PIL import Image

        data = []
        for array in to_uint8(images).transpose(0, 2, 3, 1):  # NCHW -> NHWC for PIL
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(array), mode="RGB").save(buffer, format="PNG", compress_level=1)
            data.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
        return {"format": "png", "data": data}
    if format == "raw":
        if dtype not in RAW_DTYPES:
            raise ValueError(f"raw image dtype must be one of {', '.join(RAW_DTYPES)}, got {dtype!r}")
        if dtype == "uint8":
            array = to_uint8(images)
        else:
            array = images.detach().float().cpu().numpy()
        raw = np.ascontiguousarray(array, dtype=RAW_DTYPES[dtype]).tobytes()
        return {"format": "raw", "dtype": dtype, "shape": list(array.shape),
                "data": base64.b64encode(raw).decode("ascii")}  # fmt: skip
    raise ValueError(f"image format must be one of {', '.join(FORMATS)}, got {format!r}")


def _b64(data: Any, what: str) -> bytes:
    if not isinstance(data, str):
        raise ValueError(f"{what} must be a base64 string, got {type(data).__name__}")
    try:
        return base64.b64decode(data, validate=True)
    except ValueError as err:
        raise ValueError(f"{what} is not valid base64: {err}") from None


def decode_images(spec: Any, max_pixels: int | None = None) -> torch.Tensor:
    """`[B, 3, H, W]` float32 images in [0, 1] from the protocol's `images` object; a one-line `ValueError` if bad.

    Args:
        spec (`dict`): `{"format": "png", "data": [...]}` or `{"format": "raw", "dtype", "shape", "data"}`.
        max_pixels (`int`, *optional*): refuse more than this many pixels (`B * H * W`) in all, checked before
            decoding (a small PNG can expand to a huge image).
    """
    if not isinstance(spec, dict):
        raise ValueError(f"'images' must be an object with 'format' and 'data', got {type(spec).__name__}")
    format = spec.get("format")
    if format == "png":
        from PIL import Image

        data = spec.get("data")
        if not isinstance(data, list):
            raise ValueError("'images.data' must be a list of base64 PNG strings for format 'png'")
        opened, total = [], 0
        for i, item in enumerate(data):
            try:
                image = Image.open(io.BytesIO(_b64(item, f"images.data[{i}]")), formats=["PNG"])
            except (OSError, Image.DecompressionBombError) as err:  # PIL raises UnidentifiedImageError (an OSError)
                raise ValueError(f"images.data[{i}] is not a PNG image: {err}") from None
            if opened and image.size != opened[0].size:
                raise ValueError(f"all images must have one size: image 0 is {opened[0].size[0]}x{opened[0].size[1]}, "
                                 f"image {i} is {image.size[0]}x{image.size[1]} (width x height)")  # fmt: skip
            total += image.size[0] * image.size[1]
            if max_pixels is not None and total > max_pixels:
                raise ValueError(f"the images hold more than the server's limit of {max_pixels} pixels per request; "
                                 "send fewer or smaller images per request")  # fmt: skip
            opened.append(image)
        try:
            arrays = [np.asarray(image.convert("RGB")) for image in opened]
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise ValueError(f"cannot decode a PNG image: {err}") from None
        if not arrays:
            return torch.zeros(0, 3, 1, 1)
        pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # NHWC -> NCHW
        return pixels.float().div_(255)
    if format == "raw":
        dtype, shape = spec.get("dtype"), spec.get("shape")
        if dtype not in RAW_DTYPES:
            raise ValueError(f"'images.dtype' must be one of {', '.join(RAW_DTYPES)} for format 'raw', got {dtype!r}")
        if (not isinstance(shape, list) or len(shape) != 4 or shape[1] != 3
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):  # fmt: skip
            raise ValueError(f"'images.shape' must be [B, 3, H, W] (non-negative integers), got {shape!r}")
        if max_pixels is not None and shape[0] * shape[2] * shape[3] > max_pixels:
            raise ValueError(f"the images hold more than the server's limit of {max_pixels} pixels per request; "
                             "send fewer or smaller images per request")  # fmt: skip
        raw = _b64(spec.get("data"), "images.data")
        expected = math.prod(shape) * RAW_DTYPES[dtype].itemsize
        if len(raw) != expected:
            raise ValueError(f"images.data holds {len(raw)} bytes; shape {shape} in {dtype} needs {expected}")
        array = np.frombuffer(raw, dtype=RAW_DTYPES[dtype]).reshape(shape)
        if dtype == "uint8":
            return torch.from_numpy(array.astype(np.float32)).div_(255)
        images = torch.from_numpy(array.astype(np.float32))  # a native-endian, writable copy
        if not torch.isfinite(images).all():
            raise ValueError("images.data holds NaN or infinite pixel values")
        return images
    raise ValueError(f"unknown image format {format!r}; use 'png' or 'raw'")


def scores_to_json(scores: torch.Tensor) -> list[float | None]:
    """Scores as JSON values: floats, and `None` (JSON null) for NaN or infinite ones."""
    return [value if math.isfinite(value) else None for value in scores.double().tolist()]


def metadata_to_json(metadata: dict[str, Any], batch_size: int) -> dict[str, list]:
    """Per-sample metadata as JSON lists of length `batch_size` (a single value is repeated for every sample)."""
    out = {}
    for key, value in metadata.items():
        if isinstance(value, (torch.Tensor, np.ndarray)):
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            value = [v.tolist() if isinstance(v, (torch.Tensor, np.ndarray, np.generic)) else v for v in value]
        else:
            value = [value] * batch_size
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise RewardError(f"metadata {key!r} cannot be sent as JSON: {err}") from None
        out[str(key)] = value
    return out


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

    Posts each chunk of `batch_size` images as JSON to `url`, retries connection errors and 5xx answers with
    exponential back-off (`backoff * 2**attempt` seconds), halves a chunk the server refuses as too large (413), and
    raises `RewardServerUnavailable` (a `RewardError` and a
    `ConnectionError`) naming the URL and how to start the server when it stays down.

    Args:
        url (`str`): the server (`http://127.0.0.1:8000`, scored at `/score`) or any endpoint speaking the protocol
            (a URL with a path is used as is).
        timeout (`float`, defaults to 60): seconds to wait for one answer.
        retries (`int`, defaults to 3): further attempts after a connection error or a 5xx answer.
        backoff (`float`, defaults to 0.5): seconds before the first retry; doubled after each.
        token (`str`, *optional*): sent as `Authorization: Bearer TOKEN`; defaults to `$FLOWRL_REWARD_TOKEN`.
        format (`str`, defaults to `"png"`): `"png"` (8-bit, lossless, small) or `"raw"` (one buffer of `raw_dtype`).
        raw_dtype (`str`, defaults to `"float32"`): pixel type of `"raw"` (`"float32"` exact, or `"uint8"`).
        batch_size (`int`, defaults to 64): images per request.
    """

    name = "http"

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5,
                 token: str | None = None, format: str = "png", raw_dtype: str = "float32",
                 batch_size: int = 64):  # fmt: skip
        super().__init__(device="cpu", batch_size=batch_size)
        if format not in FORMATS:
            raise ValueError(f"http reward: format must be one of {', '.join(FORMATS)}, got {format!r}")
        if raw_dtype not in RAW_DTYPES:
            raise ValueError(f"http reward: raw_dtype must be one of {', '.join(RAW_DTYPES)}, got {raw_dtype!r}")
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise ValueError(f"http reward: need timeout > 0, retries >= 0, backoff >= 0; got {timeout}, {retries}, "
                             f"{backoff}")  # fmt: skip
        self.url = _score_url(url)
        self.name = f"http {self.url}"
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.format, self.raw_dtype = format, raw_dtype
        self._opener = None

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        try:
            return self._request(images, prompts, metadata)
        except RewardServerError as err:
            if err.status != 413 or len(prompts) < 2:
                raise
        # the server's body limit is below this chunk: score it in halves
        half = len(prompts) // 2
        parts = [{k: v[:half] if isinstance(v, (list, tuple, torch.Tensor, np.ndarray)) else v
                  for k, v in metadata.items()},
                 {k: v[half:] if isinstance(v, (list, tuple, torch.Tensor, np.ndarray)) else v
                  for k, v in metadata.items()}]  # fmt: skip
        return torch.cat([self.score(images[:half], prompts[:half], **parts[0]),
                          self.score(images[half:], prompts[half:], **parts[1])])  # fmt: skip

    def _request(self, images: torch.Tensor, prompts: list[str], metadata: dict[str, Any]) -> torch.Tensor:
        payload = {"prompts": [str(p) for p in prompts], "images": encode_images(images, self.format, self.raw_dtype)}
        if metadata:
            payload["metadata"] = metadata_to_json(metadata, len(prompts))
        answer = self._post(json.dumps(payload).encode())
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise RewardServerError(f"reward server at {self.url} answered without a 'scores' list: "
                                    f"{str(answer)[:200]}")  # fmt: skip
        if len(scores) != len(prompts):
            raise RewardServerError(f"reward server at {self.url} returned {len(scores)} scores for {len(prompts)} "
                                    "images")  # fmt: skip
        bad = [s for s in scores if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)))]
        if bad:
            raise RewardServerError(f"reward server at {self.url} returned a score that is not a number or null: "
                                    f"{bad[0]!r}")  # fmt: skip
        return torch.tensor([math.nan if s is None else float(s) for s in scores], dtype=torch.float32)

    def _open(self, request, timeout: float):
        import urllib.request

        if self._opener is None:
            # a proxy from the environment must not capture requests to this machine
            local = urlsplit(self.url).hostname in _LOOPBACK
            handlers = [urllib.request.ProxyHandler({})] if local else []
            self._opener = urllib.request.build_opener(*handlers)
        return self._opener.open(request, timeout=timeout)

    def _post(self, body: bytes) -> Any:
        """POST `body` with retries; the decoded JSON answer, or a one-line `RewardServerError`."""
        import urllib.error
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        attempts = self.retries + 1
        last, answered = "", False
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with self._open(request, self.timeout) as response:
                    text = response.read()
            except urllib.error.HTTPError as err:
                message = _error_message(err)
                if err.code >= 500:
                    last, answered = f"answered {err.code} ({message})", True
                    continue
                error = RewardServerError(self._client_error(err.code, message, len(body)))
                error.status = err.code
                raise error from None
            except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out, DNS
                reason = getattr(err, "reason", err)
                last, answered = f"is unreachable ({type(reason).__name__}: {reason})", False
                if isinstance(reason, (BrokenPipeError, ConnectionResetError)) and len(body) > 1 << 20:
                    last += (f"; the {len(body)}-byte request may exceed the server's body limit: lower batch_size or "
                             "start the server with a larger --max-body-mb")  # fmt: skip
                continue
            try:
                return json.loads(text)
            except ValueError:
                raise RewardServerError(f"reward server at {self.url} answered with something that is not JSON: "
                                        f"{text[:200]!r}") from None  # fmt: skip
        tries = f"{attempts} {'tries' if attempts > 1 else 'try'}"
        if answered:  # the server is up but failing: its message says why
            raise RewardServerError(f"reward server at {self.url} {last} on each of {tries}")
        port = urlsplit(self.url).port or (443 if self.url.startswith("https") else 80)
        raise RewardServerUnavailable(
            f"reward server at {self.url} {last} after {tries}; start it with `flowrl serve-reward NAME --port "
            f"{port}` (NAME: the reward to serve) or fix the url"
        )

    def _client_error(self, code: int, message: str, size: int) -> str:
        where = f"reward server at {self.url}"
        if code == 401:
            hint = (f"the server was started with --token: pass the same token=... or set ${TOKEN_ENV}"
                    if not self.token else "the token differs from the server's --token")  # fmt: skip
            return f"{where} refused the request (401: {message}); {hint}"
        if code == 413:
            png = "use format='png' or " if self.format == "raw" else ""
            return (f"{where} refused a {size}-byte request for one image (413: {message}); {png}start the server "
                    "with a larger --max-body-mb")  # fmt: skip
        return f"{where} refused the request ({code}: {message})"


def _error_message(err) -> str:
    """The one-line `error` of a JSON error answer, else the start of the body (or the HTTP reason)."""
    try:
        body = err.read()
    except OSError:
        body = b""
    try:
        message = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode("utf-8", "replace").strip() or str(err.reason)
    return " ".join(str(message).split())
