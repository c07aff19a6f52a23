"""Typed run configs: dataclasses with a docstring per field, filled from YAML plus `--set key=value` overrides.

YAML files only override defaults. An unknown key fails with a message naming it, the close matches and the
valid keys; a value of the wrong type or outside a `Literal` fails naming the key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from flowrl.registry import unknown_name_error


class ConfigError(ValueError):
    """An invalid config key or value; the message names the key."""


# ----------------------------------------------------------------------------------------------
# shared sections
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelConfig:
    name: str = "digits"
    """`digits` (the embedded offline world), or a diffusers hub id / local folder (SD3.5, Flux.1, SD1.x)."""
    family: Literal["sd3", "flux", "unet"] | None = None
    """Model family for hub ids (`sd3`, `flux`, `unet`); detected from `model_index.json` for folders."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Weights dtype (bf16 for SD3.5/Flux on GPU; log-prob math is fp32 regardless)."""
    lora_rank: int = 0
    """LoRA rank; 0 trains every weight (full fine-tuning)."""
    lora_alpha: float | None = None
    """LoRA alpha (defaults to the rank; Flow-GRPO uses rank 32, alpha 64)."""
    lora_targets: list[str] | None = None
    """LoRA target modules (defaults: the attention projections of the family)."""
    max_sequence_length: int | None = None
    """Text tokens for T5 (SD3 256, Flux 512 by default)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, more time)."""
    digits_pretrain_steps: int = 220
    """Digits world only: pretraining steps of the base model (few, so RL has headroom)."""


@dataclasses.dataclass
class SamplingConfig:
    num_steps: int = 10
    """Denoising steps T of training rollouts."""
    guidance_scale: float = 4.5
    """Classifier-free guidance in rollouts and training (Flux: its guidance embedding)."""
    noise_level: float = 0.7
    """The sampler's noise (`flow_sde` a, `dance_sde` eta, `cps` a, `ddim` eta)."""
    sampler: str = "flow_sde"
    """Step kernel: `flow_sde`, `dance_sde`, `cps` (flow models) or `ddim` (UNets)."""
    sde_window: tuple[int, int] | None = None
    """Stochastic steps `[start, end)`; the others are ODE steps (MixGRPO / Flow-GRPO-Fast). None: all."""
    height: int | None = None
    """Image height (default: the model's)."""
    width: int | None = None
    """Image width (default: the model's)."""
    train_batch_size: int = 32
    """Rows per network forward, in rollouts and in training minibatches (equal, so ratios are exactly 1)."""
    reward_overlap: int = 1
    """Sample the epoch in this many sequential parts and score each finished part on reward threads
    (`rewards.RewardExecutor`) while the next part samples; 1: sample everything, then score. Each part draws
    its noise from its own seeded stream, so runs with different values sample different trajectories."""

    def __post_init__(self):
        if self.reward_overlap < 1:
            raise ValueError(f"sampling.reward_overlap must be >= 1, got {self.reward_overlap}")


@dataclasses.dataclass
class PromptConfig:
    train: str = "digits/train"
    """Training prompt set: a shipped name (`flowrl.prompts`) or a .txt / .jsonl path."""
    test: str = "digits/test"
    """Evaluation prompt set."""
    prompts_per_epoch: int = 16
    """Distinct prompts m sampled per epoch."""
    group_size: int = 8
    """Samples k per prompt (the group of group-relative advantages)."""


@dataclasses.dataclass
class RewardConfig:
    name: str = "digits_alignment"
    """A registered reward (`flowrl list rewards`) or `package.module:attribute`."""
    weight: float = 1.0
    """Weight in the combined reward."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Constructor arguments of the reward (weights paths, device, batch_size, ...)."""


@dataclasses.dataclass
class EvalConfig:
    every: int = 5
    """Evaluate every this many epochs (and always before the first and after the last); 0: start and end only."""
    samples_per_prompt: int = 4
    """Samples per test prompt."""
    max_prompts: int | None = None
    """Evaluate on at most this many test prompts (None: all)."""
    num_steps: int | None = None
    """Denoising steps of evaluation (default: the training steps)."""
    guidance_scale: float | None = None
    """Guidance of evaluation (default: the training guidance)."""
    metrics: list[str] = dataclasses.field(default_factory=list)
    """Extra per-sample metrics that are never optimised (gold metrics), by reward name."""
    seed: int = 1234
    """Noise seed of evaluation: the same noise at every evaluation, so curves compare like with like."""


@dataclasses.dataclass
class OptimConfig:
    lr: float = 3e-4
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float | None = 1.0
    """Gradient-norm clipping (None: off)."""
    gradient_accumulation: int = 1
    """Minibatches per optimizer step (each minibatch contributes all its trained steps)."""


@dataclasses.dataclass
class RunConfig:
    output_dir: str = "runs/{trainer}-{time}"
    """Run folder; `{trainer}` and `{time}` are filled in."""
    seed: int = 0
    """Seeds prompt sampling, rollout noise and minibatch order (per epoch, so resumed runs are identical)."""
    epochs: int = 50
    """Training epochs (one rollout batch each)."""
    save_every: int = 10
    """Checkpoint every this many epochs (and at the end); 0: only at the end."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep (older ones are deleted)."""
    images_every: int = 10
    """Save an image grid with prompts and rewards every this many epochs (0: never)."""
    log_with: list[str] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    """accelerate trackers (`tensorboard`, `wandb`); metrics.jsonl and PNG plots are always written."""
    max_bad_reward_frac: float = 0.1
    """Abort when more than this fraction of an epoch's rewards is NaN/inf (they are dropped and counted)."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """accelerate mixed precision (GPU)."""
    cpu: bool = False
    """Force the CPU even when a GPU is present."""


# ----------------------------------------------------------------------------------------------
# dict <-> dataclass with validation
# ----------------------------------------------------------------------------------------------


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp, key: str) -> Any:
    """`value` checked against (and lightly converted to) the annotation `tp`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(value, option, key)
            except ConfigError as err:
                errors.append(str(err))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"invalid value {value!r} for {key}: {'; '.join(errors)}")
    if origin is Literal:
        if isinstance(value, bool) and not any(isinstance(a, bool) for a in args):
            # YAML 1.1 reads no/off/false (yes/on/true) as booleans: map them back to a spelled-out choice
            spellings = ("no", "off", "false") if value is False else ("yes", "on", "true")
            value = next((a for a in args if a in spellings), value)
        if value not in args:
            raise ConfigError(f"invalid value {value!r} for {key}; choose from {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key} must have {len(args)} entries, got {value!r}")
            return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        converted = [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(converted) if origin is tuple else converted
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {_type_name(tp)}")


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _merge(base: dict, update: dict) -> dict:
    """`update` over `base`, recursively for nested mappings."""
    merged = dict(base)
    for key, value in update.items():
        nested = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if nested else value
    return merged


def from_dict(cls, data: dict, prefix: str = ""):
    """Build the dataclass `cls` from `data`, validating every key and value."""
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields or not fields[key].init:
            valid = [n for n, f in fields.items() if f.init]
            where = f"in section {prefix!r}" if prefix else "at the top level"
            message = str(unknown_name_error("config key", key, valid, where=where))
            raise ConfigError(message.replace(f"config key {key!r}", f"config key {full!r}", 1))
        default = _default(fields[key])
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            # a partial section overrides the *field's* defaults (a trainer may change them, e.g. GRPO-Guard's
            # step weighting), not the section class's
            value = _merge(to_dict(default), value)
        kwargs[key] = _convert(value, hints[key], full)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{prefix or cls.__name__}: {err}") from err


def to_dict(config) -> dict:
    """A YAML-friendly nested dict of a config (tuples become lists)."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(config)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides (values parsed as YAML: `1e-4`, `true`, `[1, 2]`, `null`)."""
    data = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def load_config(source: str | Path | dict, overrides: list[str] = ()):
    """A trainer config from a YAML file (or dict) plus overrides; its `trainer` key picks the config class."""
    from flowrl.trainers import TRAINERS

    data = read_yaml(source) if not isinstance(source, dict) else dict(source)
    data = apply_overrides(data, list(overrides))
    name = data.get("trainer")
    if name is None:
        raise ConfigError(f"the config must name its trainer (trainer: one of {', '.join(TRAINERS.names())})")
    try:
        trainer_cls = TRAINERS.get(name)
    except ValueError as err:
        raise ConfigError(f"trainer: {err}") from None
    return from_dict(trainer_cls.config_class, data)


def save_config(config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
