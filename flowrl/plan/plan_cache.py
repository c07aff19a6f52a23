"""The plan `flowrl train` checks before a GPU run, traced once and kept in the cache folder: the trace of a 20B
network takes a minute or more of CPU time, and every process of a launch (8 on an 8-GPU machine) and every resume
would trace it again. The key is everything the trace reads: the config (but its run folder), the process count,
the GPU's memory, the versions of the libraries that build the network, flowrl's own source and data files, and a
local model folder's JSON configs. Processes that start at once wait for the first one's plan (`cache_lock`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from contextlib import ExitStack, suppress
from functools import lru_cache
from pathlib import Path

from flowrl.cache import cache_lock, cache_root, write_file_atomic
from flowrl.plan.planner import MemoryPlan, PhasePeak, plan


LIBRARIES = ("torch", "diffusers", "transformers", "peft", "accelerate")
"""The libraries whose code the trace runs (the network's classes, LoRA, autocast's op lists)."""


@lru_cache(maxsize=1)
def _source_digest() -> str:
    """flowrl's Python and data files, hashed once per process (a few hundred small files: milliseconds)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json", ".yaml") and p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    return found


def _local_model(name: str) -> dict[str, str]:
    """A local model folder's JSON configs (what the architecture is built from), hashed by relative path."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return {}
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.glob("**/*.json"))
        if p.is_file()
    }


def plan_key(config, gpus: int, gpu_memory: float) -> str:
    """The cache key of `config`'s plan on `gpus` GPUs of `gpu_memory` GiB (see the module docstring)."""
    from flowrl.config import to_dict

    data = to_dict(config)
    data["run"] = {k: v for k, v in data["run"].items() if k != "output_dir"}  # a new folder per run: not traced
    key = {
        "config": data,
        "gpus": gpus,
        "gpu_memory": round(gpu_memory, 3),
        "libraries": _versions(),
        "flowrl": _source_digest(),
        "model_folder": _local_model(str(config.model.name)),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read(path: Path) -> MemoryPlan | None:
    try:
        data = json.loads(path.read_text())
        return MemoryPlan(**{**data, "phases": [PhasePeak(**p) for p in data["phases"]]})
    except (OSError, ValueError, KeyError, TypeError):  # absent, half-written by a killed process, or an old layout
        return None


def _write(path: Path, result: MemoryPlan) -> None:
    text = json.dumps(dataclasses.asdict(result), indent=1)
    with suppress(OSError):  # a full or read-only cache folder: the plan is used without being kept
        write_file_atomic(path, lambda tmp: tmp.write_text(text))


def cached_plan(config, *, gpus: int, gpu_memory: float) -> MemoryPlan:
    """`plan(config, gpus=gpus, gpu_memory=gpu_memory)`, read from `$FLOWRL_CACHE/plans/` when an identical trace
    was kept there (errors are not kept: the run raises them each time)."""
    path = cache_root() / "plans" / f"{plan_key(config, gpus, gpu_memory)}.json"
    found = _read(path)
    if found is not None:
        return found
    with ExitStack() as stack:
        try:
            stack.enter_context(cache_lock(path))
        except OSError:  # a read-only cache folder: traced here, not kept
            return plan(config, gpus=gpus, gpu_memory=gpu_memory)
        found = _read(path)  # another process of the launch traced it while this one waited
        if found is None:
            found = plan(config, gpus=gpus, gpu_memory=gpu_memory)
            _write(path, found)
        return found
