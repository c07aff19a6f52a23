"""Every shipped real-model recipe builds its trainer and trains one epoch on tiny stand-ins of its models.

The algorithm settings (objective, clip range, advantages, KL, EMA, step selection and weighting, LoRA) stay
as shipped; only the model and reward weights are swapped for tiny random models of the same architecture
saved to a folder, and the sizes (image size, steps, group) shrink so one epoch takes seconds.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from flowrl.models.families import MODEL_FAMILIES
from flowrl.trainers import build_trainer, load_config
from tests.rewards.tiny_models import imagereward_official_state, save_tiny_clip, write_bert_vocab


CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SKIP = ("digits", "control", "llm", "accelerate")
RECIPES = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name not in SKIP and p.name != "tiny.yaml")
"""The image recipes (control configs: tests/control/test_control.py; text configs: tests/llm/test_text.py; the
tiny-model configs: tests/models/test_tiny_configs.py)."""
SHRINK = {
    "diffusion_nft": ["num_draws=2"],
    "awm": ["num_draws=1"],
    "tempflow_grpo": ["seeds_per_prompt=1", "branches=2", "prompts.group_size=4"],  # 1 x 2 x 2 branch steps
    "mix_grpo": ["sampling.window_size=2"],
    "mix_grpo_flash": ["sampling.window_size=1"],
    "flow_grpo_fast": ["sampling.window_size=2", "sampling.window_span=[0, 3]"],
    "dance_grpo": ["sampling.sde_window=[0, 2]", "steps.k=1"],
    "wan": ["sampling.window_span=[1, 3]"],  # configs/wan: Flow-Factory's one SDE step drawn from steps 1..3
    "wan_i2v": ["sampling.window_span=[1, 3]"],
    "kandinsky5": ["sampling.window_span=[1, 3]"],
    "qwen_image_21": ["sampling.window_span=[1, 3]"],
    # configs/ltx2*: 5 frames (121 shrink too slowly on a CPU), windows inside 3 steps
    "ltx2": ["sampling.window_span=[0, 3]", "model.options.num_frames=5"],
    "ltx2_i2v": ["sampling.window_span=[1, 3]", "model.options.num_frames=5"],
    # configs/flux_kontext: the same window; source images at the shrunk target size, not 384 px
    "flux_kontext": ["sampling.window_span=[1, 3]", "model.options.condition_size=[64, 64]"],
    # configs/qwen_image_edit*: sources at the target size, few vision tokens, room for the tiny tokenizer's prompts
    "qwen_image_edit": ["model.options.condition_size=[64, 64]", "model.options.max_sequence_length=64"],
    "qwen_image_edit_plus": [
        "sampling.window_span=[1, 3]",
        "model.options.condition_size=[64, 64]",
        "model.options.vision_size=[56, 56]",
        "model.options.max_sequence_length=64",
    ],
}
"""What else shrinks with 3 steps and groups of 2: draws, branches, windows (by trainer, or by config folder)."""


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    folders = {}
    for family in MODEL_FAMILIES.names():
        MODEL_FAMILIES.get(family).tiny(seed=1).save_pretrained(root / family)
        folders[family] = root / family
    folders["clip"] = save_tiny_clip(root / "clip")
    folders["imagereward"] = root / "ImageReward.pt"
    torch.save(imagereward_official_state(), folders["imagereward"])
    folders["bert"] = write_bert_vocab(root / "bert")
    return folders


def test_every_real_model_config_is_covered():
    assert {p.relative_to(CONFIGS).as_posix() for p in RECIPES} >= {
        "sd35m/grpo_guard_pickscore.yaml",
        "sd35m/flow_grpo_geneval_style.yaml",
        "sd35m/flow_grpo_fast_pickscore.yaml",
        "sd35m/diffusion_nft_pickscore.yaml",
        "sd35m/awm_pickscore.yaml",
        "sd35m/tempflow_grpo_pickscore.yaml",
        "flux/grpo_guard_pickscore.yaml",
        "flux/mix_grpo_pickscore.yaml",
        "flux/mix_grpo_flash_pickscore.yaml",
        "flux/dance_grpo_pickscore.yaml",
        "sd15/dpok_imagereward.yaml",
    }


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_recipe_trains_one_epoch_on_tiny_stand_ins(path, tiny_folders, tmp_path):
    shipped = load_config(path)
    options = {f.name for f in dataclasses.fields(MODEL_FAMILIES.get(shipped.model.family).Options)}
    assert shipped.model.family in MODEL_FAMILIES.names() and shipped.model.lora_rank > 0
    overrides = [
        f"model.name={tiny_folders[shipped.model.family]}",
        "model.dtype=fp32",
        *(["model.options.max_sequence_length=16"] if "max_sequence_length" in options else []),
        "sampling.height=64",
        "sampling.width=64",
        "sampling.num_steps=3",
        "batch.mini_batch_size=4",
        "batch.micro_batch_size=2",
        "prompts.prompts_per_epoch=2",
        "prompts.group_size=2",
        "eval.samples_per_prompt=1",
        "eval.max_prompts=2",
        "eval.num_steps=2",
        "run.epochs=1",
        "run.log_with=[]",
        "run.mixed_precision=no",
        f"run.output_dir={tmp_path}",
        "ema_every=1",
        *SHRINK.get(shipped.trainer, []),
        *SHRINK.get(path.parent.name, []),
    ]
    # the CLIP-family rewards (PickScore, CLIP score) on a tiny CLIP folder that holds model and processor;
    # ImageReward on a tiny checkpoint in the official layout and a BERT vocabulary
    clip = {"model": str(tiny_folders["clip"]), "processor": None}
    imagereward = {"checkpoint": str(tiny_folders["imagereward"]), "tokenizer": str(tiny_folders["bert"])}
    # no weights to swap: ocr (its models ship in its wheel) and the pixel rewards of conditioned video
    weights = {"imagereward": imagereward, "ocr": {}, "first_frame_fidelity": {}, "motion": {}}
    rewards = [
        {"name": r.name, "weight": r.weight, "kwargs": {**weights.get(r.name, clip), "device": "cpu", "dtype": "fp32"}}
        for r in shipped.rewards
    ]
    if [r["name"] for r in rewards] == ["ocr"]:  # tiny models draw no text: OCR scores 0 everywhere, every group has
        rewards.append({"name": "jpeg_compressibility", "weight": 1.0, "kwargs": {}})  # zero std and is dropped
    overrides.append("rewards=" + yaml.safe_dump(rewards, default_flow_style=True).strip())
    config = load_config(path, overrides)
    # the algorithm is as shipped: every top-level field but the sections the overrides shrink
    shrunk = {"model", "sampling", "batch", "prompts", "rewards", "eval", "run", "ema_every"}
    shrunk |= {item.split("=")[0].split(".")[0] for item in SHRINK.get(shipped.trainer, [])}
    for field in dataclasses.fields(config):
        if field.name not in shrunk:
            assert getattr(config, field.name) == getattr(shipped, field.name), field.name
    trainer = build_trainer(config)
    before = [p.detach().clone() for p in trainer.params]
    record = trainer.train_epoch(0)
    assert torch.isfinite(torch.tensor(float(record["loss"])))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))
    assert all(torch.isfinite(p).all() for p in trainer.params)
