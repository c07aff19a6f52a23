"""Finding reward-model weights: local folders and files, or hub ids, with one clear error when they are missing.

Every model-backed reward takes its model location(s) as constructor arguments. A location is a local folder,
a local file, or a hub id (`org/name`). Hub ids resolve through the local Hugging Face cache, and through the
network when it is reachable and `HF_HUB_OFFLINE` is not set. Whatever fails (a missing folder, a missing file,
an offline hub, a tokenizer that silently came back almost empty) ends in a `RewardWeightsError` that names
the reward, the files it expects and how to get them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from flowrl.rewards import RewardWeightsError


def hub_state() -> str:
    """Why a hub id may not resolve, in words, for error messages."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return "the hub is switched off (HF_HUB_OFFLINE=1) and the files are not in the local cache"
    return "the hub could not be reached (or the id does not exist) and the files are not in the local cache"


def download_hint(repo: str, files: Sequence[str] = ()) -> str:
    """The command that fetches `files` (all files when empty) of hub repo `repo` into a local folder."""
    return "`" + " ".join(["hf download", repo, *files, "--local-dir DIR"]) + "`"


def weights_error(reward: str, what: str, location: Any, needs: str, fix: str, reason: str) -> RewardWeightsError:
    """A `RewardWeightsError` in the one format every reward uses."""
    reason = " ".join(reason.split())  # library messages carry newlines; keep the error on one line
    return RewardWeightsError(
        f"reward {reward!r}: cannot load the {what} from {str(location)!r}: {reason}. "
        f"It needs: {needs}. To provide it: {fix}."
    )


def is_local(location: str | os.PathLike | None) -> bool:
    """Whether `location` names an existing local file or folder."""
    return location is not None and Path(location).expanduser().exists()


_FILE_SUFFIXES = {".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".json", ".txt"}


def looks_like_path(location: str | os.PathLike) -> bool:
    """Whether `location` was meant as a local path rather than a hub id `org/name`.

    Absolute or explicitly relative paths, `~`, more than one `/`, or a weights-file extension.
    """
    text = str(location)
    explicit = text.startswith(("/", "./", "../", "~", "\\"))
    return explicit or text.count("/") > 1 or Path(text).suffix.lower() in _FILE_SUFFIXES


def _reason(location: str | os.PathLike) -> str:
    if looks_like_path(location):
        return "no such file or folder"
    return hub_state()


def load_pretrained(
    reward: str, loader: Callable[..., Any], location: str | os.PathLike, *, what: str, needs: str, fix: str, **kwargs
) -> Any:
    """`loader(location, **kwargs)` (a `from_pretrained`), with failures turned into a `RewardWeightsError`."""
    if is_local(location):
        location = str(Path(location).expanduser())
        reason = "the folder exists but the files are missing or unreadable"
    else:
        reason = _reason(location)
    try:
        return loader(str(location), **kwargs)
    except (OSError, ValueError) as err:
        raise weights_error(reward, what, location, needs, fix, f"{reason} ({type(err).__name__}: {err})") from err


def resolve_file(
    reward: str,
    location: str | os.PathLike | None,
    filenames: Sequence[str],
    *,
    what: str,
    fix: str,
    repo_type: str | None = None,
) -> Path:
    """The local path of a single weights file.

    `location` is the file itself, a folder holding one of `filenames` (first match wins), or a hub id from
    which `filenames[0]` is downloaded (through the cache). `None` means "not given".
    """
    needs = " or ".join(filenames)
    if location is None:
        raise weights_error(reward, what, None, needs, fix, "no location was given")
    path = Path(location).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        for name in filenames:
            if (path / name).is_file():
                return path / name
        found = sorted(p.name for p in path.iterdir())[:10]
        raise weights_error(reward, what, location, needs, fix, f"the folder holds none of them (it has {found})")
    if looks_like_path(location):
        raise weights_error(reward, what, location, needs, fix, "no such file or folder")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(str(location), filenames[0], repo_type=repo_type))
    except Exception as err:  # offline, missing repo or file, network errors: all mean "not available here"
        raise weights_error(reward, what, location, needs, fix, f"{hub_state()} ({type(err).__name__})") from err


def load_state_dict(reward: str, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from `.safetensors` or a torch pickle, loaded with `weights_only=True` (no code runs)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # pickle errors come in many types; all mean "not a plain tensor file"
        raise ValueError(
            f"reward {reward!r}: {str(path)!r} is not a plain tensor checkpoint (torch.load with weights_only=True "
            f"refused it: {err}). Convert it to .safetensors in a trusted environment and pass that file instead."
        ) from err
    if not isinstance(state, dict):
        raise ValueError(f"reward {reward!r}: {str(path)!r} holds a {type(state).__name__}, not a state dict")
    return state


def check_tokenizer(reward: str, tokenizer: Any, *, minimum: int, location: Any, needs: str, fix: str) -> Any:
    """Refuse a tokenizer with fewer than `minimum` tokens.

    transformers 5 returns a near-empty tokenizer (2-5 tokens) instead of raising when the hub is offline and
    the files are not cached; every prompt would then tokenize to unknown tokens without any error.
    """
    size = len(tokenizer)
    if size < minimum:
        raise weights_error(
            reward,
            "tokenizer",
            location,
            needs,
            fix,
            f"it loaded with only {size} tokens (expected at least {minimum}): its vocabulary files are missing",
        )
    return tokenizer
