"""What the reward server (`flowrl.rewards.serving.server`) accepts: the request parser, the per-request and per-image
pixel limits, the memory budget of the requests in flight, and the address checks.

Every limit is checked before the work it bounds: the announced body size before the body is read, its memory
charged to the budget before it is read, the image headers' pixel counts before any pixel is decoded (a 7,840-byte
PNG can claim 8000 x 8000 pixels, 768 MB as float32 RGB), their decoded size charged before decoding.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import zlib
from collections.abc import Callable

import torch

from flowrl.rewards.serving.wire import TooLarge, decode_images


MAX_BODY_BYTES = 256 * 1024 * 1024
"""Default request size limit (256 MiB: 64 noisy 1024 px PNGs after base64 come close to it)."""
MAX_PIXELS = 64 * 1024 * 1024
"""Default limit on the pixels (`B * H * W`) of one request, checked before decoding (256 images of 512 x 512)."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""Default limit on the pixels (`H * W`) of one image, checked before decoding (192 MiB as float32 RGB)."""
MAX_INFLIGHT_BYTES = 2 * 1024**3
"""Default memory budget of the requests in flight together (2 GiB): see `RewardServer`."""
BODY_COST, PIXEL_COST = 3, 16
"""What a request is charged against the memory budget: `BODY_COST` bytes per body byte while its body is read and
parsed (the body and its JSON strings), `PIXEL_COST` bytes per pixel from the moment its image headers are read
until it is answered (12 for the float32 RGB pixels, 4 for decoding's scratch)."""


def one_line(text: str) -> str:
    return " ".join(str(text).split())


class RequestError(Exception):
    """A request the server answers with `status` and the one-line `{"error": message}`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class MemoryBudget:
    """Bytes charged to the requests in flight, at most `limit` together (thread-safe): `charge` refuses what does
    not fit with a `RequestError`: 413 when it could never fit (the client sends less), 503 when it does not fit
    beside the others now (the client waits and sends it again)."""

    def __init__(self, limit: int):
        self.limit, self.used, self.peak = int(limit), 0, 0
        self._lock = threading.Lock()

    def charge(self, amount: int, what: str) -> None:
        if amount > self.limit:
            raise RequestError(
                413,
                f"the request needs {amount} bytes of this server's memory for {what}, more than "
                f"its budget of {self.limit} (--max-inflight-mb): send fewer or smaller images",
            )
        with self._lock:
            if self.used + amount > self.limit:
                raise RequestError(
                    503,
                    f"the reward server is busy: {self.used} of its {self.limit} bytes of memory "
                    f"for requests in flight are taken; send it again shortly",
                )
            self.used += amount
            self.peak = max(self.peak, self.used)

    def release(self, amount: int) -> None:
        with self._lock:
            self.used -= amount


def check_address(host: str, port: int, token: str | None, insecure: bool = False) -> None:
    """Refuse, in one line, a port out of range and a host other than this machine's loopback without a token
    (unless `insecure`): anyone who reaches such a port could use the reward's model and memory."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535 (0 picks a free port), got {port!r}")
    if token or insecure or is_loopback(host):
        return
    raise ValueError(
        f"--host {host} without a token lets anyone who reaches the port use the reward: set --token "
        "(or $FLOWRL_REWARD_TOKEN), or pass --insecure to serve it without one"
    )


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback interface (localhost, 127.0.0.0/8, ::1)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _libc():
    """glibc through ctypes, or None elsewhere (musl, macOS: the memory calls below do nothing there)."""
    import ctypes
    import ctypes.util

    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC or None


_LIBC = None
_M_MMAP_THRESHOLD = -3


def map_large_allocations(threshold: int = 4 << 20) -> None:
    """Serve every allocation of `threshold` bytes or more from its own memory mapping, returned to the system when
    freed (the serving process only). glibc's default raises that threshold to the size of the last large buffer
    freed (up to 32 MiB) and serves later ones from its heap, which keeps their pages after they are freed: a
    server that has read a few 16 MB bodies stays 30-50 MB larger than before them."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)


def release_memory() -> None:
    """Hand the pages of freed heap memory back to the system (glibc's `malloc_trim`; a no-op elsewhere), after
    a large request: its smaller buffers (body chunks, JSON strings under `map_large_allocations`' threshold)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def body_fingerprint(body: bytes) -> tuple:
    """What tells a retried request from another one reusing its id: the body's length and the CRC-32 of its first
    and last 64 KiB (prompts, image header, metadata; a checksum of all of it would cost 8 ms per 16 MB)."""
    return len(body), zlib.crc32(body[:65536]), zlib.crc32(body[-65536:])


def bind(host: str, port: int, name: str) -> socket.socket:
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


def parse_request(
    body: bytes,
    max_pixels: int | None = None,
    max_image_pixels: int | None = None,
    reserve: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, list[str], dict[str, list]]:
    """`(images, prompts, metadata)` of a `/score` request body; a `RequestError` naming what is wrong (400; 413 for
    more pixels than `max_pixels` or `max_image_pixels`; `reserve` is `decode_images`')."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, f"the body is not valid JSON: {err}") from None
    except RecursionError:
        raise RequestError(400, "the body is not valid JSON: it nests arrays or objects too deeply") from None
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
        images = decode_images(request["images"], max_pixels, max_image_pixels, reserve)
    except TooLarge as err:
        raise RequestError(413, str(err)) from None
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
