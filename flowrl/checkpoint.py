"""Checkpoints that are either complete or refused.

A checkpoint folder `checkpoints/epoch_N/` holds `accelerator.save_state` output (weights as safetensors,
optimizer and RNG states loaded back with `weights_only=True`), flowrl's own state as JSON and safetensors
(`trainer_state.json`, `extra.safetensors`) and, written last, `manifest.json` with every file's size and
SHA-256. It is written to a temporary folder and renamed, so a crash never leaves a half-written checkpoint
under a real name; loading verifies the manifest and refuses anything missing or altered.
"""

from __future__ import annotations

import errno
import hashlib
import json
import pickle
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


MANIFEST = "manifest.json"
_NAME = re.compile(r"^epoch_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt; the message names the file."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint that belongs to another run: another trainer, model or LoRA config."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def verify(folder: str | Path) -> Path:
    """Check `folder` against its manifest; raise `CheckpointError` naming what is wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"checkpoint {folder} is partial: it has no {MANIFEST} (interrupted while saving?)")
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is corrupt ({err})") from err
    for name, info in entries.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is missing {name}")
        if path.stat().st_size != info["bytes"] or _sha256(path) != info["sha256"]:
            raise CheckpointError(f"checkpoint {folder}: {name} is corrupt (size or SHA-256 differs from manifest)")
    return folder


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """`checkpoints/epoch_N` folders of a run, oldest first (complete or not)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest(run_dir: str | Path) -> Path:
    """The newest checkpoint of a run, verified."""
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"no checkpoints under {Path(run_dir) / 'checkpoints'} to resume from")
    return verify(found[-1])


def _disk_full(err: BaseException) -> bool:
    """Whether a write failed for lack of space (torch's zip writer reports it as "enforce fail ... pos")."""
    text = str(err)
    return (
        (isinstance(err, OSError) and err.errno == errno.ENOSPC)
        or "No space left" in text
        or ("enforce fail" in text and "pos" in text)
    )


def save(
    folder: Path,
    accelerator,
    state: dict,
    tensors: dict[str, torch.Tensor],
    keep: int | None = None,
    files: dict[str, tuple[dict[str, torch.Tensor], dict[str, str] | None]] | None = None,
) -> Path:
    """Write a complete checkpoint to `folder` (via a temporary sibling and a rename).

    `files` adds safetensors files by name, `(tensors, metadata)` each (a sharded run's gathered model and
    optimizer state), written by the main process like the rest.

    `keep` prunes the oldest checkpoints so that `keep` remain, counting only checkpoints up to this one: a
    checkpoint with a later epoch (which a resumed run has not reached yet) is never removed. A failed write
    (a full disk) removes the partial folder, keeps every earlier checkpoint and raises a `CheckpointError`.
    """
    folder = Path(folder)
    tmp = folder.parent / f".tmp-{folder.name}"
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp / "accelerate"), safe_serialization=True)
        # every process writes its own RNG state into tmp: none may still be writing when the main one renames it
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, allow_nan=True))
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / "extra.safetensors")
            for name, (contents, metadata) in (files or {}).items():
                save_file(contents, tmp / name, metadata=metadata)
            write_manifest(tmp)
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err):
            raise CheckpointError(
                f"no space left on {folder.parent} while writing {folder.name}: the partial "
                "checkpoint was removed, earlier checkpoints are kept"
            ) from None
        raise
    if accelerator.is_main_process:
        # a complete checkpoint under the name at every instant but between the two renames (`best` is rewritten)
        aside = folder.parent / f".old-{folder.name}"
        if folder.exists():
            shutil.rmtree(aside, ignore_errors=True)
            folder.rename(aside)
        tmp.rename(folder)
        shutil.rmtree(aside, ignore_errors=True)
        if keep:
            number = int(_NAME.match(folder.name).group(1)) if _NAME.match(folder.name) else None
            earlier = [
                p
                for p in list_checkpoints(folder.parent.parent)
                if number is None or int(_NAME.match(p.name).group(1)) <= number
            ]
            for old in earlier[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return folder


def previous_verified(run_dir: str | Path, before: str | Path) -> Path | None:
    """The newest checkpoint of `run_dir` older than `before` that verifies (None if none does)."""
    before = Path(before).resolve()
    found = list_checkpoints(run_dir)
    resolved = [p.resolve() for p in found]
    older = found[: resolved.index(before)] if before in resolved else found
    for path in reversed(older):
        try:
            return verify(path)
        except CheckpointError:
            continue
    return None


def with_previous(err: Exception, run_dir: str | Path, bad: str | Path, option: str) -> CheckpointError:
    """`err` (about the checkpoint `bad`) with the newest verified checkpoint older than it offered, as `option`
    names it (`--resume`, `--checkpoint`)."""
    earlier = previous_verified(run_dir, bad)
    hint = f"; the previous verified checkpoint is {earlier} ({option} {earlier})" if earlier else ""
    return CheckpointError(f"{err}{hint}")


def _unpickling_reason(err: Exception) -> str:
    """What torch's weights-only unpickler refused, in one whole sentence: the object it names (`GLOBAL
    module.name`), else the first sentence of its message (which opens with advice about `weights_only=False`)."""
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(err)).split())
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return f"it names {named.group(1)}, which the weights-only loader does not import."
    return (text.split(". ")[0].rstrip(".") or type(err).__name__) + "."


def load(folder: str | Path, accelerator, trainer: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Verify and restore a checkpoint: accelerate state in place, returns `(trainer_state, extra tensors)`.

    A checkpoint of another trainer (`trainer`), or one whose weights or optimizer do not fit this run's (another
    model, LoRA rank or target set), is refused with a `CheckpointError` before anything is half-loaded where
    possible; nothing of the checkpoint is changed.
    """
    folder = verify(folder)
    state = json.loads((folder / "trainer_state.json").read_text())
    if trainer is not None and state.get("trainer") != trainer:
        raise CheckpointMismatch(f"checkpoint {folder} is from trainer {state.get('trainer')!r}, not {trainer!r}")
    try:
        accelerator.load_state(str(folder / "accelerate"))
    except pickle.UnpicklingError as err:  # `torch.load(weights_only=True)` met an object that is not a tensor
        raise CheckpointError(
            f"checkpoint {folder} holds pickled objects that are not plain tensors; refused "
            f"(flowrl never unpickles code): {_unpickling_reason(err)}"
        ) from None
    except (RuntimeError, ValueError, KeyError) as err:
        detail = " ".join(line.strip() for line in str(err).strip().splitlines()[:2])
        raise CheckpointMismatch(
            f"checkpoint {folder} does not fit this run's model or optimizer (written with "
            f"another model or LoRA config?): {detail[:300]}"
        ) from None
    return state, load_file(folder / "extra.safetensors")
