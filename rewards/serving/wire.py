"""The reward server's wire protocol: plain JSON (no pickle), so any endpoint that speaks it works.

    POST /score   {"prompts": [B strings],
                   "images": {"format": "raw", "dtype": "uint8" | "float32", "shape": [B, 3, H, W],
                              "data": base64 of the C-order little-endian bytes}
                          or {"format": "png" | "jpeg" | "webp", "data": [B base64 images]},
                   "metadata": {key: [B JSON values], ...}}            (optional)
                  headers: X-Request-ID (optional, echoed back), Authorization: Bearer TOKEN (with a token)
    -> 200        {"scores": [B numbers or null]}                     (null: NaN)
    -> 4xx / 5xx  {"error": "one line"}
    GET /health   -> {"reward": NAME, "status": "ok"}

PNG and uint8 pixels are `round(255 * x)` of the [0, 1] images; float32 pixels are sent as they are; JPEG and WebP
are lossy (at the client's `lossy_quality`). The encoding helpers here are shared by both sides: the client
(`flowrl.rewards.serving.http`, the `http` reward) and the server (`flowrl.rewards.serving.server`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from flowrl.rewards import RewardError


FORMATS = ("raw", "png", "jpeg", "webp")
"""Image encodings of the protocol: `raw` pixels and `png` are lossless (at 8 bits), `jpeg` and `webp` lossy."""
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
"""Protocol format -> Pillow format of the formats sent as one encoded file per image."""
RAW_DTYPES = {"uint8": np.dtype("<u1"), "float32": np.dtype("<f4")}
TOKEN_ENV = "FLOWRL_REWARD_TOKEN"
REQUEST_ID_HEADER = "X-Request-ID"


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """`[B, 3, H, W]` images in [0, 1] as `round(255 * x)` uint8 numpy `[B, 3, H, W]` (clamped first)."""
    return images.detach().float().clamp(0, 1).mul_(255).round_().to(torch.uint8).cpu().numpy()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encode_images(images: torch.Tensor, format: str = "png", dtype: str = "float32", quality: int = 90) -> dict:
    """The protocol's `images` object for `[B, 3, H, W]` images in [0, 1].

    Args:
        images (`torch.Tensor`): `[B, 3, H, W]` floats in [0, 1].
        format (`str`, defaults to `"png"`): `"png"` (one lossless 8-bit PNG per image), `"raw"` (one buffer),
            `"jpeg"` or `"webp"` (one lossy file per image).
        dtype (`str`, defaults to `"float32"`): pixel type of `"raw"`: `"float32"` (exact) or `"uint8"`.
        quality (`int`, defaults to 90): JPEG / WebP quality (1-100).
    """
    if format in IMAGE_FORMATS:
        from PIL import Image

        options = {
            "png": {"compress_level": 1},
            "jpeg": {"quality": quality, "subsampling": 0},
            "webp": {"quality": quality, "method": 0},
        }[format]
        data = []
        for array in to_uint8(images).transpose(0, 2, 3, 1):  # NCHW -> NHWC for PIL
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(array), mode="RGB").save(
                buffer, format=IMAGE_FORMATS[format], **options
            )
            data.append(_b64(buffer.getvalue()))
        return {"format": format, "data": data}
    if format == "raw":
        array = _raw_array(images, dtype)
        return {"format": "raw", "dtype": dtype, "shape": list(array.shape), "data": _b64(array.tobytes())}
    raise ValueError(f"image format must be one of {', '.join(FORMATS)}, got {format!r}")


def _raw_array(images: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype not in RAW_DTYPES:
        raise ValueError(f"raw image dtype must be one of {', '.join(RAW_DTYPES)}, got {dtype!r}")
    array = to_uint8(images) if dtype == "uint8" else images.detach().float().cpu().numpy()
    return np.ascontiguousarray(array, dtype=RAW_DTYPES[dtype])


def request_body(
    images: torch.Tensor,
    prompts: list[str],
    metadata: dict[str, list] | None = None,
    format: str = "raw",
    dtype: str = "uint8",
    quality: int = 90,
) -> bytes:
    """The JSON body of a `/score` request (the protocol's `images` object in `format`), built without passing the
    image data through a JSON encoder: base64 needs no escaping, and `json.dumps` of the 16 MB string of 16 raw
    512 px images costs 3x the concatenation."""
    head = json.dumps([str(p) for p in prompts]).encode()
    tail = b"" if not metadata else b', "metadata": ' + json.dumps(metadata, allow_nan=False).encode()
    if format == "raw":
        array = _raw_array(images, dtype)
        spec = json.dumps({"format": "raw", "dtype": dtype, "shape": list(array.shape)}).encode()[:-1]
        data = base64.b64encode(array.data)
        return b'{"prompts": ' + head + b', "images": ' + spec + b', "data": "' + data + b'"}' + tail + b"}"
    spec = json.dumps(encode_images(images, format, dtype, quality)).encode()
    return b'{"prompts": ' + head + b', "images": ' + spec + tail + b"}"


def _unb64(data: Any, what: str) -> bytes:
    if not isinstance(data, str):
        raise ValueError(f"{what} must be a base64 string, got {type(data).__name__}")
    try:
        if sys.version_info >= (3, 11):
            return binascii.a2b_base64(data, strict_mode=True)
        return base64.b64decode(data, validate=True)  # pragma: no cover (Python 3.10)
    except (ValueError, binascii.Error) as err:
        raise ValueError(f"{what} is not valid base64: {err}") from None


class TooLarge(ValueError):
    """A request whose images hold more pixels than the server takes (answered 413: the client sends fewer)."""


def _too_many_pixels(max_pixels: int) -> ValueError:
    return TooLarge(
        f"the images hold more than the server's limit of {max_pixels} pixels per request; send fewer "
        "or smaller images per request"
    )


def _check_image_size(i: int, width: int, height: int, max_image_pixels: int | None) -> None:
    if max_image_pixels is not None and width * height > max_image_pixels:
        mib = width * height * 12 / 2**20
        raise TooLarge(
            f"image {i} is {width}x{height} ({mib:.{0 if mib >= 10 else 2}f} MiB once decoded to float32 RGB); the "
            f"server takes at most {max_image_pixels} pixels per image"
        )


def decode_images(
    spec: Any,
    max_pixels: int | None = None,
    max_image_pixels: int | None = None,
    reserve: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """`[B, 3, H, W]` float32 images in [0, 1] from the protocol's `images` object; a one-line `ValueError` if bad.

    Every limit is checked from the images' headers, before any pixel is decoded (a small PNG can expand to a huge
    image: 8 KB of 1-bit PNG to 8000 x 8000 pixels, 768 MB as float32 RGB).

    Args:
        spec (`dict`): `{"format": "raw", "dtype", "shape", "data"}` or `{"format": "png" | "jpeg" | "webp",
            "data": [...]}`.
        max_pixels (`int`, *optional*): refuse more than this many pixels (`B * H * W`) in all (`TooLarge`).
        max_image_pixels (`int`, *optional*): refuse an image of more than this many pixels (`H * W`; `TooLarge`).
        reserve (`Callable`, *optional*): called with the request's pixel count (`B * H * W`) once the headers are
            read and before decoding (the server charges their decoded size to its memory budget; it may raise).
    """
    if not isinstance(spec, dict):
        raise ValueError(f"'images' must be an object with 'format' and 'data', got {type(spec).__name__}")
    format = spec.get("format")
    if format in IMAGE_FORMATS:
        from PIL import Image

        kind = IMAGE_FORMATS[format]
        data = spec.get("data")
        if not isinstance(data, list):
            raise ValueError(f"'images.data' must be a list of base64 {kind} strings for format {format!r}")
        opened, total = [], 0
        for i, item in enumerate(data):
            try:
                image = Image.open(io.BytesIO(_unb64(item, f"images.data[{i}]")), formats=[kind])
            except (OSError, Image.DecompressionBombError) as err:  # PIL raises UnidentifiedImageError (an OSError)
                raise ValueError(f"images.data[{i}] is not a {kind} image: {err}") from None
            if opened and image.size != opened[0].size:
                raise ValueError(
                    f"all images must have one size: image 0 is {opened[0].size[0]}x{opened[0].size[1]}, "
                    f"image {i} is {image.size[0]}x{image.size[1]} (width x height)"
                )
            _check_image_size(i, *image.size, max_image_pixels)
            total += image.size[0] * image.size[1]
            if max_pixels is not None and total > max_pixels:
                raise _too_many_pixels(max_pixels)
            opened.append(image)
        if not opened:
            return torch.zeros(0, 3, 1, 1)
        if reserve is not None:
            reserve(total)
        width, height = opened[0].size
        pixels = torch.empty(len(opened), 3, height, width)  # filled image by image: one decoded image at a time
        filled = pixels.numpy()
        try:
            for i, image in enumerate(opened):
                filled[i] = np.asarray(image if image.mode == "RGB" else image.convert("RGB")).transpose(2, 0, 1)
                opened[i] = None
                image.close()
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise ValueError(f"cannot decode a {kind} image: {err}") from None
        return pixels.div_(255)
    if format == "raw":
        dtype, shape = spec.get("dtype"), spec.get("shape")
        if dtype not in RAW_DTYPES:
            raise ValueError(f"'images.dtype' must be one of {', '.join(RAW_DTYPES)} for format 'raw', got {dtype!r}")
        if (
            not isinstance(shape, list)
            or len(shape) != 4
            or shape[1] != 3
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
        ):
            raise ValueError(f"'images.shape' must be [B, 3, H, W] (non-negative integers), got {shape!r}")
        _check_image_size(0, shape[3], shape[2], max_image_pixels)
        if max_pixels is not None and shape[0] * shape[2] * shape[3] > max_pixels:
            raise _too_many_pixels(max_pixels)
        if reserve is not None:
            reserve(shape[0] * shape[2] * shape[3])
        raw = _unb64(spec.get("data"), "images.data")
        expected = math.prod(shape) * RAW_DTYPES[dtype].itemsize
        if len(raw) != expected:
            raise ValueError(f"images.data holds {len(raw)} bytes; shape {shape} in {dtype} needs {expected}")
        if not raw:
            return torch.zeros(shape)
        if sys.byteorder == "little":  # torch converts 6x faster than numpy's astype here
            pixels = torch.frombuffer(bytearray(raw), dtype=torch.uint8 if dtype == "uint8" else torch.float32)
        else:  # pragma: no cover (big-endian machines)
            native = RAW_DTYPES[dtype].newbyteorder("=")
            pixels = torch.from_numpy(np.frombuffer(raw, dtype=RAW_DTYPES[dtype]).astype(native))
        del raw
        pixels = pixels.reshape(shape)
        if dtype == "uint8":
            return pixels.float().div_(255)
        if not torch.isfinite(pixels).all():
            raise ValueError("images.data holds NaN or infinite pixel values")
        return pixels
    raise ValueError(f"unknown image format {format!r}; use one of {', '.join(FORMATS)}")


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
