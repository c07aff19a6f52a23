"""From a trained run to what a diffusers user loads in one line (`flowrl export`).

A checkpoint is for resuming; `export` loads the run's policy at a checkpoint without a trainer
(`flowrl.trainers.inference.load_run`) and writes its weights in diffusers' own formats:

- LoRA runs: `pytorch_lora_weights.safetensors` (with the adapter config as metadata), for
  `pipe.load_lora_weights(DIR)`;
- full fine-tunes of a diffusers pipeline: the whole pipeline folder with the trained network, for
  `<Pipeline>.from_pretrained(DIR)`;
- full fine-tunes of the digits world (not a diffusers pipeline: its text encoder is MiniLM, its decoder maps 8x8
  pixel latents to images): a digits model folder, `DIR/transformer` (an `SD3Transformer2DModel`) and
  `DIR/meta.json`, which `flowrl.digits.DigitsWorld(DIR, load_classifiers()).policy()` turns into a policy.

With EMA weights in the run (`ema_decay`), they are exported by default (`ema=False` exports the raw weights).
`flowrl_export.json` beside the weights records the run, the checkpoint, the epoch and the load line.
"""

from __future__ import annotations

import json
from pathlib import Path


def export(run_dir: str | Path, out: str | Path, *, checkpoint_path: str | Path | None = None,
           ema: bool | None = None) -> dict:  # fmt: skip
    """Export a run's (latest or given) checkpoint to `out`; returns what was written and how to load it."""
    from flowrl.trainers.inference import load_run
    from flowrl.trainers.run_folder import writable

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml)")
    writable(Path(out))
    run = load_run(run_dir, str(checkpoint_path) if checkpoint_path else "latest", ema=ema)
    record = write(run, out)
    record.update(run=str(run_dir), checkpoint=str(run.checkpoint))
    (Path(out) / "flowrl_export.json").write_text(json.dumps(record, indent=2))
    return record


def write(run, out: str | Path) -> dict:
    """Write a loaded run's policy weights (as loaded: EMA or raw) to `out` in diffusers' format; returns a record."""
    out = Path(out)
    policy = run.policy
    if run.algorithm.trained_module() is not getattr(policy, "model", None):
        raise ValueError(f"{run.config.trainer} trains {type(run.algorithm.trained_module()).__name__}, not the "
                         "diffusion model: there is no diffusers artefact to export (its weights are in the "
                         "run's checkpoints)")  # fmt: skip
    if not hasattr(policy, "adapter"):
        raise ValueError(f"{run.config.trainer} trains no diffusion model: flowrl export writes diffusers weights")
    out.mkdir(parents=True, exist_ok=True)
    if policy.has_lora:
        written = policy.save_lora(out)
        pipeline = type(policy.adapter.pipeline).__name__
        load = f"{pipeline}.from_pretrained(BASE).load_lora_weights({str(out)!r})"
        if getattr(policy.adapter, "lora_loader", None) is not None:  # a pipeline without a LoRA loader mixin
            load = f"pipe = {pipeline}.from_pretrained(BASE); " + policy.adapter.lora_load_line(out)
    elif policy.adapter.pipeline is not None:
        policy.adapter.pipeline.save_pretrained(out)
        written = out / "model_index.json"
        load = f"{type(policy.adapter.pipeline).__name__}.from_pretrained({str(out)!r})"
    else:  # the digits world: a digits model folder (its transformer and meta.json), which `DigitsWorld` loads
        policy.model.save_pretrained(out / "transformer")
        meta = {"exported_from": str(run.run_dir), "checkpoint": str(run.checkpoint), "epoch": run.epoch}
        (out / "meta.json").write_text(json.dumps(meta, indent=2))
        written = out / "transformer" / "config.json"
        load = f"flowrl.digits.DigitsWorld({str(out)!r}, flowrl.digits.load_classifiers()).policy()"
    record = {"epoch": run.epoch, "ema": run.ema, "kind": "lora" if policy.has_lora else "full",
              "written": str(written), "load": load}  # fmt: skip
    (out / "flowrl_export.json").write_text(json.dumps(record, indent=2))
    return record
