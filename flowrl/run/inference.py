"""A trained run's policy, loaded without a trainer: what `flowrl sample`, `flowrl export` and `flowrl eval` build.

`load_run(RUN_OR_CHECKPOINT)` reads the run's own config, builds its modality (the policy; the rewards only when
asked, for evaluation) and its algorithm's own pieces (FIND's noise policy), and loads the checkpoint's trained
weights (the EMA weights when the run kept them, unless `ema=False`) and the modality's state (control's
normalisers). No accelerator, optimizer or reward model is made that the command does not use, and nothing is
written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowrl import checkpoint as checkpoints
from flowrl.run import sharding
from flowrl.run.registry import TRAINERS, load_config
from flowrl.runtime import RunContext


class InferenceEngine:
    """What an algorithm reads of the engine outside training: the device, the processes, the trained module."""

    def __init__(self, context: RunContext):
        self.context, self.processes, self.device = context, context.processes, context.device
        self.model = None
        self.ema = None
        self.optimizer_steps = 0

    def unwrapped(self) -> torch.nn.Module:
        return self.model


@dataclasses.dataclass
class LoadedRun:
    """A run's policy at one of its checkpoints."""

    run_dir: Path
    checkpoint: Path
    config: object
    epoch: int
    modality: object
    algorithm: object
    ema: bool
    """Whether the EMA weights were loaded."""

    @property
    def policy(self):
        return self.modality.policy


def resolve(target: str | Path, which: str | None = "latest") -> tuple[Path, Path]:
    """`(run folder, checkpoint folder)` for a run folder (its `latest` or `best` checkpoint, or `which` as a
    path) or a checkpoint folder (`RUN/checkpoints/epoch_N`)."""
    target = Path(target)
    if (target / "trainer_state.json").is_file() and target.parent.name == "checkpoints":
        return target.parent.parent, target
    if not (target / "config.yaml").is_file():
        raise FileNotFoundError(
            f"{target} is neither a run folder (no config.yaml) nor a checkpoint folder (no trainer_state.json)"
        )
    if which in (None, "latest"):
        try:
            return target, checkpoints.latest(target)
        except checkpoints.CheckpointError as err:
            found = checkpoints.list_checkpoints(target)
            raise checkpoints.with_previous(err, target, found[-1], "--checkpoint") if found else err from None
    if which == "best":
        best = target / "checkpoints" / "best"
        if not best.is_dir():
            raise FileNotFoundError(f"{target} kept no best checkpoint (set eval.best_metric to keep one)")
        return target, best
    return target, Path(which)


def load_run(
    target: str | Path,
    which: str | None = "latest",
    *,
    ema: bool | None = None,
    rewards: bool = False,
    device: str | None = None,
    overrides: list[str] = (),
) -> LoadedRun:
    """The policy of a run's checkpoint (see the module docstring).

    Args:
        target: a run folder or one of its checkpoint folders.
        which (`str`): `latest`, `best` or a checkpoint folder (with a run folder).
        ema (`bool`, *optional*): load the EMA weights (default: when the run kept them).
        rewards (`bool`): also build the training rewards and gold metrics (evaluation).
        device (`str`, *optional*): default: the CUDA device when there is one.
        overrides (`list[str]`): `section.key=value` changes to the run's config (evaluation settings).
    """
    run_dir, path = resolve(target, which)
    try:
        path = checkpoints.verify(path)
    except checkpoints.CheckpointError as err:
        raise checkpoints.with_previous(err, run_dir, path, "--checkpoint") from None
    config = load_config(run_dir / "config.yaml", [*overrides, "run.log_with=[]"])
    modality, algorithm = build_parts(config, rewards=rewards, device=device)
    module = algorithm.trained_module()
    state = json.loads((path / "trainer_state.json").read_text())
    if state.get("trainer") != config.trainer:
        raise checkpoints.CheckpointMismatch(
            f"checkpoint {path} is from trainer {state.get('trainer')!r}, not {config.trainer!r}"
        )
    load_weights(module, path)
    extra = load_file(path / "extra.safetensors")
    modality.load_state_dict({k.removeprefix("modality."): v for k, v in extra.items() if k.startswith("modality.")})
    algorithm.load_state_dict(state, extra)
    kept = any(k.startswith("ema.") for k in extra)
    use_ema = kept if ema is None else ema
    if use_ema and not kept:
        raise ValueError("the run kept no EMA weights (ema_decay is not set): use the raw weights (no --ema)")
    if use_ema:
        params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():
            for i, p in enumerate(params):
                p.copy_(extra[f"ema.{i}"])
    module.eval()
    return LoadedRun(run_dir, path, config, int(state.get("epoch", 0)), modality, algorithm, use_ema)


def build_parts(config, *, rewards: bool = False, device: str | None = None):
    """`(modality, algorithm)` of a config on one process, the algorithm's own models built (its base weights)."""
    algorithm_class = TRAINERS.get(config.trainer)
    device = device or ("cuda" if torch.cuda.is_available() and not config.run.cpu else "cpu")
    context = RunContext.single(device, log=None)
    modality = algorithm_class.modality_class(config, context, scoring=rewards)
    engine = InferenceEngine(context)
    algorithm = algorithm_class(config, modality, engine)
    algorithm.build()
    engine.model = algorithm.trained_module()
    return modality, algorithm


def load_weights(module: torch.nn.Module, folder: Path) -> None:
    """A checkpoint's trained weights into `module`: the full state a sharded run gathered, or accelerate's first
    model file; a checkpoint of another model or LoRA config is refused naming what differs."""
    sharded = folder / sharding.MODEL_FILE
    weights = load_file(sharded if sharded.is_file() else folder / "accelerate" / "model.safetensors")
    try:
        module.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        detail = " ".join(str(err).split())[:300]
        raise checkpoints.CheckpointMismatch(
            f"checkpoint {folder} does not fit this run's model (another model or LoRA config?): {detail}"
        ) from None
