"""What a run downloads, checked before anything loads: every missing artifact in one message.

A real-model recipe needs several hub repositories: the model, each reward's model and processor. Loading them one
by one, a machine without hub access meets them one at a time, each after the hub client's retries (22 lines and
45 s for the first). `check_artifacts(config)` lists what the config names (`model.name`; each reward's and gold
metric's locations: its arguments, given or default, that are hub ids `org/name` or local paths), finds each in the
local Hugging Face cache (no network), and asks the hub once (one connection, no retries) only when something is
needed. When the hub cannot be reached (or `HF_HUB_OFFLINE=1`):

- what is missing is one `MissingArtifacts` error naming each with its `hf download` line and where to point the
  config at the downloaded folder;
- with everything in the cache, the process is switched to the hub's offline mode, so that the libraries read the
  cache without trying the network first.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from flowrl.sections import PromptedConfig


class MissingArtifacts(FileNotFoundError):
    """Files a run needs that are neither on this machine nor reachable; the message lists each with its fix."""


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A file or folder a run loads: a hub repository or a local path, and where the config names it."""

    what: str
    """In words: `the model`, `reward 'pickscore' processor`."""
    location: str
    """A hub id (`org/name`) or a local path."""
    setting: str
    """The config setting that points at a local copy, with `DIR` for the folder: `model.name: DIR`."""

    @property
    def on_hub(self) -> bool:
        return is_hub_id(self.location)


def is_hub_id(location: str) -> bool:
    """Whether `location` names a hub repository (`org/name`) rather than a local path or a URL."""
    from flowrl.rewards.loading import looks_like_path

    text = str(location)
    return "://" not in text and text.count("/") == 1 and not looks_like_path(text) and not Path(text).exists()


def _is_location(value) -> bool:
    from flowrl.rewards.loading import looks_like_path

    return isinstance(value, str) and "://" not in value and (is_hub_id(value) or looks_like_path(value))


def needed(config) -> list[Artifact]:
    """The hub repositories and local paths the config's model, rewards and gold metrics load."""
    if not isinstance(config, PromptedConfig):
        return []  # control: the environment and the policy are made here
    found = []
    model = config.model.name  # (the image and text configs' model sections)
    if isinstance(model, str) and _is_location(model):
        found.append(Artifact("the model", model, "model.name: DIR"))
    for spec in config.rewards:
        found += _reward_artifacts(spec.name, dict(spec.kwargs))
    for name in config.eval.gold_metrics():
        found += _reward_artifacts(name, {})
    unique = {}
    for artifact in found:
        unique.setdefault((artifact.what, artifact.location), artifact)
    return list(unique.values())


def _reward_artifacts(name: str, kwargs: dict, depth: int = 0) -> list[Artifact]:
    """A reward's locations: each argument (given, else its default) that names a hub id or a local path; a reward
    that wraps another by name (`reward=`) is followed."""
    from flowrl import rewards

    if ":" in name or name not in rewards.list_rewards() or depth > 2:
        return []
    try:
        parameters = inspect.signature(rewards.REWARDS.get(name)).parameters
    except (TypeError, ValueError):
        return []
    found = []
    for key, parameter in parameters.items():
        value = kwargs.get(key, parameter.default)
        if key == "reward" and isinstance(value, str):  # a wrapper (per_frame): the reward it wraps
            inner = {k: v for k, v in kwargs.items() if k not in parameters}
            found += _reward_artifacts(value, inner, depth + 1)
        elif _is_location(value):
            setting = f"rewards: [{{name: {name}, kwargs: {{{key}: DIR}}}}]"
            found.append(Artifact(f"reward {name!r} {key}", value, setting))
    return found


def _cached(repo: str) -> bool:
    """Whether the local Hugging Face cache holds a snapshot of hub repository `repo` (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot_download(repo, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        return False
    return True


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached (`HF_HUB_OFFLINE=1`, or one connection to its endpoint failed within 3 s, no
    retries), or None when it can."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "the hub is switched off (HF_HUB_OFFLINE=1)"
    endpoint = urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=3).close()
    except OSError as err:
        return f"the hub at {constants.ENDPOINT} cannot be reached ({err.strerror or type(err).__name__})"
    return None


def go_offline() -> None:
    """The hub's offline mode for this process (and the processes it starts): the libraries read the cache and
    never try the network (no retries)."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def check_artifacts(config) -> None:
    """Raise one `MissingArtifacts` listing every artifact the run needs that is neither on this machine nor
    reachable (see the module docstring); with the hub unreachable and nothing missing, go offline."""
    artifacts = needed(config)
    local_missing = [a for a in artifacts if not a.on_hub and not Path(a.location).expanduser().exists()]
    hub = [a for a in artifacts if a.on_hub]
    not_cached = [a for a in hub if not _cached(a.location)]
    why = hub_unreachable() if hub else None
    missing = local_missing + (not_cached if why else [])
    if not missing:
        if why:
            go_offline()
        return
    items = []
    for i, artifact in enumerate(missing, 1):
        if artifact.on_hub:
            fix = f"`hf download {artifact.location} --local-dir DIR`, then {artifact.setting}"
            items.append(f"({i}) {artifact.what} {artifact.location}: {fix}")
        else:
            items.append(f"({i}) {artifact.what}: no such file or folder {artifact.location} ({artifact.setting})")
    reason = f"; {why}" if why and not_cached else ""
    gated = " (gated models such as SD3.5 and FLUX.1-dev need `hf auth login` first)" if not_cached else ""
    raise MissingArtifacts(
        f"this run needs {len(missing)} artifact(s) that are not on this machine{reason}: {'; '.join(items)}{gated}"
    )
