"""`flowrl score`: a reward's scores for image (or video) files, to check a reward before training with it.

`score_files(reward, paths, prompt=..., prompts_file=..., server=..., kwargs=...)` loads each file into the reward
convention (`[3, H, W]` floats in [0, 1] for an image, `[3, F, H, W]` for a video through `flowrl.video.read_mp4`),
scores files of one shape together, and returns a record: each file's score (NaN kept and counted), the `multi`
reward's per-component scores, the mean over the finite scores. `format_table` prints it; `--json` prints the record.

Prompts: one `prompt` for every file, or a prompt file (`.txt` / `.jsonl` / a shipped set, `flowrl.prompts.load`)
with one row per file whose metadata goes to the reward as keyword arguments (as a trainer passes it); neither:
the empty prompt. With `server`, the `http` reward scores through `flowrl serve-reward` (the reward is the server's).
A conditioning image (`image`, or a prompt file's `image` column: an image-to-video start frame, an edit's source)
goes to the rewards that read it (`first_frame_fidelity`, `edit_consistency`, ...).
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from typing import Any

import torch


VIDEO_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi")


def parse_kwargs(text: str | None) -> dict[str, Any]:
    """The reward's constructor arguments from `--kwargs` JSON (an object); a one-line `ValueError` otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--kwargs is not valid JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--kwargs must be a JSON object like '{{\"quality\": 50}}', got {text!r}")
    return value


def load_file(path: str | Path) -> torch.Tensor:
    """One image file as `[3, H, W]` floats in [0, 1] (any PIL mode, converted to RGB), or one video file
    (`VIDEO_SUFFIXES`) as `[3, F, H, W]`; a one-line error naming the file if it is missing or unreadable."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder: pass image files (e.g. {path}/*.png)")
    if not path.is_file():
        raise FileNotFoundError(f"no such image file: {path}")
    if path.suffix.lower() in VIDEO_SUFFIXES:
        try:
            from flowrl.video import read_mp4

            video = read_mp4(path)
        except ImportError:
            raise ValueError(
                f"reading the video {path} needs imageio and imageio-ffmpeg: pip install 'flowrl-toolkit[video]'"
            ) from None
        except Exception as err:  # noqa: BLE001  (imageio/ffmpeg fail in many ways; all mean "cannot read it")
            raise ValueError(f"cannot read the video {path}: {type(err).__name__}: {err}") from None
        if video.ndim != 4 or video.shape[0] != 3 or video.shape[1] == 0:
            raise ValueError(f"cannot read the video {path}: got frames of shape {tuple(video.shape)}")
        return video
    import numpy as np
    from PIL import Image

    try:
        with Image.open(path) as image:
            array = np.asarray(image.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError) as err:  # UnidentifiedImageError is an OSError
        raise ValueError(f"cannot read the image {path}: {err}") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255)  # HWC uint8 -> CHW in [0, 1]


def file_prompts(n: int, prompt: str | None = None, prompts_file: str | None = None) -> list:
    """`n` prompts: `prompt` for each file, or the rows of `prompts_file` (exactly `n`), or the empty prompt."""
    from flowrl import prompts

    if prompt is not None and prompts_file is not None:
        raise ValueError("give --prompt or --prompts, not both")
    if prompts_file is not None:
        rows = prompts.load(prompts_file)
        if len(rows) != n:
            raise ValueError(
                f"--prompts {prompts_file} holds {len(rows)} prompts for {n} "
                f"{'file' if n == 1 else 'files'}: give one prompt per file, in order"
            )
        return rows
    text = prompt or ""
    quoted = prompts.quoted_text(text)
    return [prompts.Prompt(text, {"text": quoted} if quoted is not None else {}) for _ in range(n)]


SERVER_DEADLINE_S = 10.0
"""With `server`: the http client's `deadline_s` unless `kwargs` give one."""


def build_reward(name: str, kwargs: dict[str, Any], server: str | None = None):
    """The reward to score with: `rewards.get(name, **kwargs)`, or with `server` the `http` reward at that URL (kwargs:
    the client's), after checking that the server serves `name`."""
    from flowrl import rewards

    if server is None:
        try:
            return rewards.get(name, **kwargs)
        except TypeError as err:  # a constructor argument the reward does not take
            raise ValueError(f"reward {name!r} does not take these --kwargs {sorted(kwargs)}: {err}") from None
    import inspect

    from flowrl.rewards.serving.http import HttpReward

    allowed = [p for p in inspect.signature(HttpReward).parameters if p != "url"]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(
            f"with --server the reward's own arguments are the server's (`flowrl serve-reward {name} "
            f"--set KEY=VALUE`); --kwargs {unknown} are not the http client's: "
            f"{', '.join(allowed)}"
        )
    # a command run by hand: a server that is not there is said within seconds, not after the training default's
    # 10 minutes of waiting for it
    client = HttpReward(server, **{"deadline_s": SERVER_DEADLINE_S, **kwargs})
    served = _served_name(client)
    if served is not None and served != name:
        raise ValueError(
            f"the reward server at {client.url} serves {served!r}, not {name!r}: run "
            f"`flowrl score {served} ... --server {server}` or start a server for {name!r}"
        )
    return client


def _served_name(client) -> str | None:
    """The reward name a `flowrl serve-reward` server gives at `GET /health`; None if it does not answer so (another
    endpoint speaking the protocol, or down: then scoring says so)."""
    from urllib.parse import urlsplit

    if urlsplit(client.url).path != "/score":
        return None
    served = (client.health() or {}).get("reward")
    return served if isinstance(served, str) else None


def _groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of the files of each shape (files of one shape are scored as one batch), in first-seen order."""
    groups: dict[tuple, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(tuple(tensor.shape), []).append(i)
    return list(groups.values())


def conditioning_images(rows: list, image: str | None = None) -> list[torch.Tensor] | None:
    """Each file's conditioning images `[N, 3, H, W]` (an image-to-video start frame, an edit's sources): `image` for
    every file, else each prompt row's own (`Prompt.images`, a jsonl row's `image`); None when there are none."""
    from flowrl.policies.sources import load_source

    if image is not None:
        return [load_file(image)[None]] * len(rows)
    entries = [tuple(getattr(row, "images", ())) for row in rows]
    if not any(entries):
        return None
    if not all(entries):
        raise ValueError("some rows of --prompts have an `image` and some do not: give every row one (or --image)")
    return [torch.stack([_pixels(load_source(i)) for i in entry]) for entry in entries]


def _pixels(image) -> torch.Tensor:
    """A PIL image as `[3, H, W]` floats in [0, 1]."""
    import numpy as np

    return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1).float().div_(255)


def score_files(
    reward: str,
    paths: list[str],
    prompt: str | None = None,
    prompts_file: str | None = None,
    server: str | None = None,
    kwargs: dict[str, Any] | None = None,
    image: str | None = None,
) -> dict[str, Any]:
    """Score image/video files with the reward `reward` (see the module doc); the record `format_table` prints.

    `image` (or a prompt file's rows' `image`): each file's conditioning image (an image-to-video start frame, an
    edit's source), given as `source_images [B, N, 3, H, W]` to the rewards that read them (`needs_source_images`;
    images of one batch are resized to the first one's size).

    Returns `{"reward", "server", "components": [labels of a multi reward], "weights": {label: weight}, "files":
    [{"file", "prompt", "score", "components": {label: score}}], "count", "nan", "mean"}` (NaN scores are
    `float("nan")`; `mean` is over the finite ones, NaN when none is).
    """
    from flowrl.rewards import MultiReward
    from flowrl.rewards.scoring import call_reward, source_kwargs, texts_and_metadata

    if not paths:
        raise ValueError("give at least one image file")
    rows = file_prompts(len(paths), prompt, prompts_file)  # a count mismatch fails before any file is read
    sources = conditioning_images(rows, image)
    tensors = [load_file(path) for path in paths]
    fn = build_reward(reward, dict(kwargs or {}), server)
    multi = isinstance(fn, MultiReward)
    labels = list(fn.rewards) if multi else []
    totals = [math.nan] * len(paths)
    parts: list[dict[str, float]] = [{} for _ in paths]
    for index in _groups(tensors):
        batch = torch.stack([tensors[i] for i in index])
        texts, metadata = texts_and_metadata([rows[i] for i in index])
        if multi:
            components: dict[str, torch.Tensor] = {}
            out = call_reward(reward, partial(_evaluate, fn, batch, texts, metadata, components), len(index))
            for label, values in components.items():
                for i, value in zip(index, values.tolist()):
                    parts[i][label] = value
        else:
            given = None if sources is None else _stack([sources[i] for i in index])
            out = call_reward(reward, partial(fn, batch, texts, **metadata, **source_kwargs(fn, given)), len(index))
        for i, value in zip(index, out.tolist()):
            totals[i] = value
    finite = [s for s in totals if math.isfinite(s)]
    files = [
        {"file": str(path), "prompt": str(row), "score": total, **({"components": part} if multi else {})}
        for path, row, total, part in zip(paths, rows, totals, parts)
    ]
    return {
        "reward": reward,
        "server": server,
        "components": labels,
        "weights": dict(fn.weights) if multi else {},
        "files": files,
        "count": len(files),
        "nan": len(files) - len(finite),
        "mean": sum(finite) / len(finite) if finite else math.nan,
    }


def _stack(images: list[torch.Tensor]) -> torch.Tensor:
    """`[B, N, 3, H, W]` from `B` tensors `[N, 3, H_i, W_i]`, each resized to the first one's size (bilinear)."""
    size = images[0].shape[-2:]
    resize = torch.nn.functional.interpolate
    return torch.stack(
        [i if i.shape[-2:] == size else resize(i, size=size, mode="bilinear", antialias=True) for i in images]
    )


def _evaluate(fn, batch: torch.Tensor, texts: list[str], metadata: dict, components: dict) -> torch.Tensor:
    """A `MultiReward`'s total, its per-component scores stored in `components`."""
    output = fn.evaluate(batch, texts, **metadata)
    components.update(output.scores)
    return output.total


def _number(value: float) -> str:
    return "NaN" if math.isnan(value) else f"{value:.4f}"


def format_table(record: dict[str, Any], max_prompt: int = 40) -> str:
    """The record of `score_files` as an aligned text table, one row per file, and a summary line."""
    labels = record["components"]
    with_prompt = any(row["prompt"] for row in record["files"])
    header = ["file", *(["prompt"] if with_prompt else []), "score", *labels]
    lines = []
    for row in record["files"]:
        text = row["prompt"] if len(row["prompt"]) <= max_prompt else row["prompt"][: max_prompt - 3] + "..."
        parts = row.get("components", {})
        lines.append(
            [
                row["file"],
                *([text] if with_prompt else []),
                _number(row["score"]),
                *(_number(parts.get(label, math.nan)) for label in labels),
            ]
        )
    widths = [max(len(cells[c]) for cells in [header, *lines]) for c in range(len(header))]
    numeric = {c for c, name in enumerate(header) if name not in ("file", "prompt")}
    out = [
        "  ".join(
            cell.rjust(w) if c in numeric else cell.ljust(w) for c, (cell, w) in enumerate(zip(cells, widths))
        ).rstrip()
        for cells in [header, *lines]
    ]
    where = f" (served at {record['server']})" if record["server"] else ""
    count, nan = record["count"], record["nan"]
    summary = f"{count} {'file' if count == 1 else 'files'} scored by {record['reward']!r}{where}: mean "
    summary += f"{_number(record['mean'])}" + (" over the finite scores" if nan else "") + f"; NaN: {nan}"
    weights = record.get("weights") or {}
    if weights:
        summary += "; score = " + " + ".join(f"{w:g} * {label}" for label, w in weights.items())
    return "\n".join([*out, summary])


def to_json(record: dict[str, Any]) -> str:
    """The record as JSON, NaN scores as null."""

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(record), indent=2)
