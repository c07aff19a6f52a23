"""flowrl's cache folder (`$FLOWRL_CACHE`, default `~/.cache/flowrl`) and building into it once: a folder is written
to a temporary name and renamed (never half-written), under a lock, so processes that build the same folder at once
share one build (the digits world, the text world, tiny model pipelines)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """`$FLOWRL_CACHE` or `~/.cache/flowrl`."""
    return Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl")).expanduser()


@contextmanager
def cache_lock(target: Path):
    """Hold an exclusive lock on `target` while building it: a second process (a rank of the same run, or another
    run) building the same folder waits, then finds it built. POSIX `flock`; elsewhere only the atomic rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no flock; `write_atomic` still never exposes a half-written folder
        yield
        return
    with open(target.parent / f".{target.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_file_atomic(path: Path, write) -> Path:
    """Run `write(tmp)` on a temporary file beside `path`, then rename it to `path`: a reader never sees half a file,
    and writers racing on one name each rename a whole file of their own. The temporary file goes on any failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def build_once(target: Path, force: bool, build, marker: str = "meta.json", timeout: float = 1800) -> Path:
    """`build(target)` unless `target` is built (`marker`, written last), under `cache_lock`: a process that waited
    for the lock finds the other's build and returns it.

    Under a torch.distributed group only rank 0 builds; the other ranks wait up to `timeout` seconds for its
    `marker` (transformers' `save_pretrained` writes weights on rank 0 only: a build by another rank, whichever
    took the lock first, was a folder without weights). `force` rebuilds on rank 0 alone."""
    done = target / marker
    if done.is_file() and not force:
        return target
    if _a_later_rank():
        deadline = time.monotonic() + timeout
        while not done.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target}: rank 0 did not build it within {timeout:.0f} s (only rank 0 builds)")
            time.sleep(0.2)
        return target
    with cache_lock(target):
        if force or not done.is_file():
            build(target)
    return target


def _a_later_rank() -> bool:
    """A process of an initialised torch.distributed group other than rank 0 (no group unless torch was imported)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def write_atomic(target: Path, write) -> Path:
    """Run `write(tmp_folder)`, then rename the folder to `target` (never a half-written `target`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
