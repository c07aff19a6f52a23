"""Every `configs/<family>/tiny.yaml` runs the whole path of a real-weights run on the family's tiny random pipeline
(`model.name: tiny:<family>`, built offline into the cache): `flowrl train` for its epochs, then `flowrl export`
and `flowrl sample` on the run, and the exported LoRA loads into the family's diffusers pipeline."""

import json
from pathlib import Path

import pytest
import torch

from flowrl.cli import main
from flowrl.models.families import MODEL_FAMILIES
from flowrl.models.loaders import load_pipeline
from flowrl.trainers import load_config


CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY_CONFIGS = sorted(CONFIGS.glob("*/tiny.yaml"))


def test_every_family_has_a_tiny_config():
    families = {load_config(path).model.name.split(":", 1)[1].split("@")[0] for path in TINY_CONFIGS}
    assert families == set(MODEL_FAMILIES.names())


@pytest.mark.models
@pytest.mark.parametrize("path", TINY_CONFIGS, ids=lambda p: p.parent.name)
def test_a_tiny_config_trains_exports_and_samples(path, tmp_path, monkeypatch):
    """The tiny config's own commands (its header's train, export and sample), its training cut to one of its two
    epochs: that epoch evaluates, draws samples and checkpoints as each of its epochs does, and a second would
    repeat it (tests/test_export.py checks each family's exported weights against the run's own samples)."""
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    config = load_config(path)
    assert config.model.name.startswith("tiny:") and config.model.lora_rank > 0
    assert config.run.epochs > 1 and (config.eval.every, config.run.save_every, config.run.samples_every) == (1, 1, 1)
    run = tmp_path / "run"
    assert main(["train", str(path), "--output-dir", str(run), "--set", "run.epochs=1"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("optimizer_steps")]
    assert len(trained) == 1 and all(torch.isfinite(torch.tensor(r["loss"])) for r in trained)
    assert "eval/reward" in trained[0] and (run / "checkpoints" / "epoch_1").is_dir()
    assert main(["export", str(run), "--out", str(tmp_path / "lora")]) == 0
    prompts, start = "a cat", []
    if MODEL_FAMILIES.get(config.model.name[5:].split("@")[0]).conditioning == "start_frame":
        from flowrl.prompts.edit_shapes import draw  # image-to-video: a start frame per prompt

        draw("circle", "red", (12, 10, 40, 38)).save(tmp_path / "start.png")
        draw("square", "blue", (20, 20, 50, 50)).save(tmp_path / "start2.png")
        (tmp_path / "prompts.txt").write_text("a cat\na dog\n")
        images = [str(tmp_path / "start.png"), str(tmp_path / "start2.png")]
        prompts, start = str(tmp_path / "prompts.txt"), ["--image", images[0], "--image", images[1]]
    assert main(["sample", str(run), "--prompts", prompts, "--out", str(tmp_path / "samples"), *start]) == 0
    record = json.loads((tmp_path / "samples" / "sample.json").read_text())
    assert record["files"] and all((tmp_path / "samples" / f["file"]).is_file() for f in record["files"])
    if start:
        assert record["images"] == [[start[1]], [start[3]]]  # one start frame per prompt, in order
    for entry in record["files"]:  # a video's contact sheet: its first, middle and last frames side by side
        if entry["file"].endswith(".mp4"):
            from PIL import Image

            sheet = Image.open(tmp_path / "samples" / entry["frames"])
            width, height = config.sampling.width, config.sampling.height
            assert sheet.size == (3 * width + 2 * max(1, width // 32), height)
    pipe = load_pipeline(config.model.name)
    assert type(pipe).__name__ == MODEL_FAMILIES.get(config.model.name[5:].split("@")[0]).pipeline_class
    before = {
        k: v.clone()
        for k, v in pipe.components[MODEL_FAMILIES.get(pipe_family(pipe)).lora_prefix].state_dict().items()
    }
    MODEL_FAMILIES.get(pipe_family(pipe)).load_lora_into(pipe, tmp_path / "lora")  # or the family's `lora_loader`
    after = pipe.components[MODEL_FAMILIES.get(pipe_family(pipe)).lora_prefix].state_dict()
    assert any("lora" in k for k in after) and set(before) <= {k.replace(".base_layer", "") for k in after}


def pipe_family(pipe) -> str:
    return {MODEL_FAMILIES.get(n).pipeline_class: n for n in MODEL_FAMILIES.names()}[type(pipe).__name__]
