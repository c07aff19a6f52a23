"""From a trained run to what a diffusers user loads in one line (`flowrl export`).

A checkpoint is accelerate state for resuming; `export` writes the policy's weights in diffusers' own formats:

- LoRA runs: `pytorch_lora_weights.safetensors` (with the adapter config as metadata), for
  `pipe.load_lora_weights(DIR)`;
- full fine-tunes of a diffusers pipeline: the whole pipeline folder with the trained network, for
  `<Pipeline>.from_pretrained(DIR)`;
- full fine-tunes of the digits world: the transformer folder, for `SD3Transformer2DModel.from_pretrained(DIR)`.

With EMA weights in the run (`ema_decay`), they are exported by default (`ema=False` exports the raw weights).
`flowrl_export.json` beside the weights records the run, the checkpoint, the epoch and the load line.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

from flowrl import checkpoint


def export(run_dir: str | Path, out: str | Path, *, checkpoint_path: str | Path | None = None,
           ema: bool | None = None) -> dict:  # fmt: skip
    """Export a run's (latest or given) checkpoint to `out`; returns what was written and how to load it."""
    from flowrl.trainers import build_trainer, load_config

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml)")
    config = load_config(run_dir / "config.yaml", ["run.log_with=[]"])
    trainer = build_trainer(config, output_dir=run_dir)
    path = Path(checkpoint_path) if checkpoint_path else checkpoint.latest(run_dir)
    trainer.load_checkpoint(path)
    record = write(trainer, out, ema=ema)
    record.update(run=str(run_dir), checkpoint=str(path))
    (Path(out) / "flowrl_export.json").write_text(json.dumps(record, indent=2))
    return record


def write(trainer, out: str | Path, *, ema: bool | None = None) -> dict:
    """Write a trainer's current (or EMA) policy weights to `out` in diffusers' format; returns a record."""
    out = Path(out)
    policy = trainer.policy
    if trainer.trained_module() is not policy.model:
        raise ValueError(f"{trainer.config.trainer} trains {type(trainer.trained_module()).__name__}, not the "
                         "diffusion model: there is no diffusers artefact to export (its weights are in the "
                         "run's checkpoints)")  # fmt: skip
    use_ema = trainer.ema is not None if ema is None else ema
    if use_ema and trainer.ema is None:
        raise ValueError("the run kept no EMA weights (ema_decay is not set): export without --ema")
    out.mkdir(parents=True, exist_ok=True)
    with trainer.ema.swapped() if use_ema else nullcontext():
        if policy.has_lora:
            written = policy.save_lora(out)
            pipeline = type(policy.adapter.pipeline).__name__
            load = f"{pipeline}.from_pretrained(BASE).load_lora_weights({str(out)!r})"
        elif policy.adapter.pipeline is not None:
            policy.adapter.pipeline.save_pretrained(out)
            written = out / "model_index.json"
            load = f"{type(policy.adapter.pipeline).__name__}.from_pretrained({str(out)!r})"
        else:
            policy.model.save_pretrained(out)
            written = out / "config.json"
            load = f"{type(policy.model).__name__}.from_pretrained({str(out)!r})"
    record = {"epoch": trainer.epoch, "ema": use_ema, "kind": "lora" if policy.has_lora else "full",
              "written": str(written), "load": load}  # fmt: skip
    (out / "flowrl_export.json").write_text(json.dumps(record, indent=2))
    return record
