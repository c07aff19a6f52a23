"""Prompt sets shipped with flowrl and a loader for text and jsonl files.

`prompts.load(name_or_path)` returns a list of `Prompt(text, metadata)`:

- `.txt`: one prompt per line; blank lines and lines starting with `#` are skipped.
- `.jsonl`: one JSON object per line with a `"prompt"` key; every other key goes to `metadata`
  (e.g. the GenEval-style `tag` / `include` / `exclude` of the compositional set).

Either way, a prompt holding a double-quoted span gets `metadata["text"]` = the first quoted span (unless the
jsonl already sets `text`): the target string of text-rendering (OCR) rewards, as Flow-GRPO's OCR reward reads it.

Names resolve to files shipped in this package (`"simple_animals"`, `"compositional/train"`, `"ocr/test"`,
`"digits/train"`, ...); anything else is read as a path. `prompts.list_sets()` lists the shipped names.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parent
SUFFIXES = (".txt", ".jsonl")
_QUOTED = re.compile(r'"([^"]+)"')


@dataclass
class Prompt:
    """One prompt: its `text` and free-form `metadata` (passed to rewards as keyword arguments by trainers)."""

    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    images: tuple = ()
    """Conditioning images: the source images the prompt edits, or the start frame of an image-to-video prompt (paths
    or PIL images; a jsonl row's `image`, a path or a list of paths relative to the file). Empty: text only."""

    def __str__(self) -> str:
        return self.text


def quoted_text(prompt: str) -> str | None:
    """The first double-quoted span of `prompt` (the text an OCR reward looks for), or `None`."""
    match = _QUOTED.search(prompt)
    return match.group(1) if match else None


BUILT_SETS = {
    "edit_shapes/train": "flowrl.prompts.edit_shapes:train",
    "edit_shapes/test": "flowrl.prompts.edit_shapes:test",
    "motion_shapes/train": "flowrl.prompts.motion_shapes:train",
    "motion_shapes/test": "flowrl.prompts.motion_shapes:test",
}
"""Shipped sets built in code (name -> `module:function` returning `list[Prompt]`): the editing set's source images
and the image-to-video set's start frames are drawn with PIL, so no image files ship."""


def group_key(prompt) -> str:
    """What a prompt's samples are grouped by: its text, or for an editing prompt its (text, source images) pair
    (`flowrl.policies.sources.edit_key`)."""
    images = getattr(prompt, "images", ())
    if not images:
        return str(prompt)
    from flowrl.policies.sources import edit_key

    return edit_key(str(prompt), images)


def source_images(prompts: list) -> list | None:
    """Each prompt's source images (`Prompt.images`), or None when no prompt has any (text-to-image)."""
    images = [tuple(getattr(p, "images", ())) for p in prompts]
    return images if any(images) else None


def list_sets() -> list[str]:
    """Names of the shipped prompt sets (paths under the package without the extension), sorted."""
    names = {
        path.relative_to(ROOT).with_suffix("").as_posix()
        for suffix in SUFFIXES
        for path in ROOT.rglob(f"*{suffix}")
        if "__pycache__" not in path.parts
    }
    return sorted(names | set(BUILT_SETS))


def resolve(name_or_path: str | os.PathLike) -> Path:
    """The file behind a shipped set name or a path; `ValueError` listing the shipped sets otherwise."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    name = str(name_or_path).replace("\\", "/")
    candidates = [ROOT / name] if name.endswith(SUFFIXES) else [ROOT / f"{name}{s}" for s in SUFFIXES]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    shipped = ", ".join(list_sets())
    raise ValueError(f"unknown prompt set {str(name_or_path)!r}: not a file nor one of the shipped sets: {shipped}")


def _with_quoted(text: str, metadata: dict[str, Any]) -> dict[str, Any]:
    if "text" not in metadata and (target := quoted_text(text)) is not None:
        metadata = {**metadata, "text": target}
    return metadata


def _read_txt(path: Path) -> list[Prompt]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if text and not text.startswith("#"):
            out.append(Prompt(text, _with_quoted(text, {})))
    return out


def _read_jsonl(path: Path) -> list[Prompt]:
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err})") from err
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line must be a JSON object with a string 'prompt'")
        text = record.pop("prompt").strip()
        images = record.pop("image", None)  # editing: source image path(s), relative to the file
        images = [] if images is None else [images] if isinstance(images, str) else images
        if not all(isinstance(i, str) for i in images):
            raise ValueError(f"{path}:{number}: 'image' must be a path or a list of paths")
        images = tuple(str((path.parent / i).resolve()) for i in images)
        out.append(Prompt(text, _with_quoted(text, record), images))
    return out


def load(name_or_path: str | os.PathLike) -> list[Prompt]:
    """The prompts of a shipped set (`"simple_animals"`, `"compositional/train"`, ...) or of a `.txt`/`.jsonl` file."""
    if str(name_or_path) in BUILT_SETS and not Path(name_or_path).is_file():
        from flowrl.registry import import_path

        return import_path(BUILT_SETS[str(name_or_path)], "prompt set")()
    path = resolve(name_or_path)
    try:
        prompts = _read_jsonl(path) if path.suffix == ".jsonl" else _read_txt(path)
    except UnicodeDecodeError as err:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    if not prompts:
        raise ValueError(f"prompt set {str(name_or_path)!r} ({path}) holds no prompts")
    return prompts


def epoch_prompts(prompts: list, m: int, k: int, seed: int, epoch: int) -> list:
    """Epoch `epoch`'s m prompts drawn from `(seed, epoch)` without replacement (cycling through a reshuffle when
    the set holds fewer than m), each repeated k times: the same list on every process."""
    import torch

    from flowrl.runtime import seeded

    g = seeded(seed, epoch, 1)
    order = torch.randperm(len(prompts), generator=g).tolist()
    while len(order) < m:
        order += torch.randperm(len(prompts), generator=g).tolist()
    return [prompts[i] for i in order[:m] for _ in range(k)]
