import os
from pathlib import Path

import pytest
import torch

from flowrl.digits.nets import TransformerConfig


os.environ.setdefault("HF_HUB_OFFLINE", "1")
# trainers keep torch's thread count in tests: exactness tests compare runs, and a busy CI machine must not
# change the count between them (tests/test_threads.py and test_shared_loop.py cover `run.threads`)
os.environ.setdefault("FLOWRL_THREADING", "torch")
# under pytest-xdist each worker takes one thread: two workers on two cores, no oversubscription
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    """Tests marked `long` first, the rest in their order: a long test started last keeps the other workers idle
    (`--dist worksteal` moves only tests not yet started)."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): a worker per core, at most 8 (each builds the session's tiny worlds
    and holds its own models)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


TEXT = {"max_sequence_length": 16}

TINY_DIGITS_RUN = {
    "trainer": "grpo_guard",
    "model": {"name": "digits", "digits_pretrain_steps": 2},
    "sampling": {"num_steps": 3, "guidance_scale": 1.0},
    "batch": {"mini_batch_size": 8, "micro_batch_size": 8},
    "prompts": {"prompts_per_epoch": 2, "group_size": 4},
    "eval": {"every": 0, "samples_per_prompt": 1, "max_prompts": 4, "metrics": ["digits_gold"]},
    "optim": {"lr": 1e-4},
}
"""A `flowrl` run config on a 2-step digits base model, run by the CLI in a subprocess (tests add their `run`
section); in-process tests take `tiny_config` on the tiny world instead."""

DIGITS_BASE = ["model.digits_pretrain_steps=2"]
"""Overrides for runs on the shipped digits architecture that do not need its trained base: pretrained 2 steps
instead of 220 (what such tests compare does not depend on the base, and the full base costs about 40 s to build
in a fresh cache)."""

PPO_TRAINERS = ("flow_grpo", "grpo_guard", "loop")
"""Image trainers whose tiny configs clip at 1e-2 (the tiny world's log-ratios move that far)."""

TINY = {
    "image": {
        "sampling": {"num_steps": 4, "guidance_scale": 2.0},
        "prompts": {"prompts_per_epoch": 4, "group_size": 4},
        "eval": {"every": 1, "samples_per_prompt": 2, "max_prompts": 4, "metrics": ["digits_gold"]},
        "optim": {"lr": 1e-3},
        "batch": {"mini_batch_size": 16, "micro_batch_size": 8},
        "run": {"epochs": 2, "save_every": 1, "samples_every": 0, "log_with": [], "plots": False},
    },
    "control": {
        "env": {"id": "Pendulum-v1", "num_envs": 2, "steps_per_env": 32},
        "batch": {"mini_batch_size": 16, "micro_batch_size": 16, "inner_epochs": 2},
        "run": {"epochs": 2, "log_with": [], "plots": False},
        "eval": {"episodes": 2, "every": 0},
    },
    "text": {
        "prompts": {"prompts_per_epoch": 8, "group_size": 4},
        "generation": {"max_new_tokens": 4},
        "batch": {"mini_batch_size": 16, "micro_batch_size": 16},
        "run": {"epochs": 2, "log_with": [], "save_every": 0, "samples_every": 0, "plots": False},
        "eval": {"every": 0, "max_prompts": 16},
    },
}
"""The shared tiny sizes of each modality's test configs (`tiny_config`); no PNG curves or sample grids (matplotlib's
0.1-0.2 s each, 13% of the default tier; tests/trainers/test_shared_loop.py and tests/test_cli.py draw them)."""


def tiny_config(trainer="grpo_guard", tmp_path=None, overrides=(), **sections):
    """A tiny config of any trainer: its modality's `TINY` sizes (2 epochs; images: 4 prompts x 4 samples, 4 steps,
    mini-batches of 16 in micro-batches of 8, clip 1e-2 for the PPO family; control: 2 Pendulum environments x 32
    steps; text: 8 arith prompts x 4 completions), then `sections` (each replaces its whole section) and
    `overrides` (`key=value` strings), its run folder `tmp_path`."""
    from flowrl.trainers import TRAINERS, load_config

    modality = {
        "ImageModality": "image",
        "ControlModality": "control",
        "DemoModality": "control",
        "TextModality": "text",
    }[TRAINERS.get(trainer).modality_class.__name__]
    data = {"trainer": trainer, **TINY[modality]}
    if trainer in PPO_TRAINERS:
        data["objective"] = {"clip_eps_low": 1e-2}
    if tmp_path is not None:
        data["run"] = {**data["run"], "output_dir": str(tmp_path)}
    return load_config({**data, **sections}, list(overrides))


@pytest.fixture
def tiny():
    """`tiny_config` as a fixture (for test folders that prefer one)."""
    return tiny_config


@pytest.fixture(scope="session")
def sd3_pipe():
    from flowrl.models import tiny_sd3

    pipe = tiny_sd3()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def flux_pipe():
    from flowrl.models import tiny_flux

    pipe = tiny_flux()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def unet_pipe():
    from flowrl.models import tiny_unet

    pipe = tiny_unet()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def small_edit_sources(monkeypatch):
    """Qwen-Image-Edit's pipelines size sources at about 1024^2 (and Plus's vision copy 384^2) pixels: here 64^2 and
    32^2, for the pipeline and flowrl's adapter alike (the adapter reads the pipeline module's rules). At full size a
    tiny edit model's step costs minutes on a CPU (thousands of image and vision tokens)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: (64, 64, None))
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 64 * 64)
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", 32 * 32)


TINY_MODEL = TransformerConfig(num_layers=1, attention_head_dim=8, num_attention_heads=2, caption_projection_dim=16)


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """One temporary `$FLOWRL_CACHE` for the whole session, shared by its xdist workers (builds under a file lock):
    what the tests build (the arith base, digits bases and classifiers, prompt conditionings) is built once, and the
    user's own cache is neither read nor written. `$FLOWRL_TEST_CACHE` names one for several sessions (CI's tiers)."""
    folder = os.environ.get("FLOWRL_TEST_CACHE")
    if not folder:
        base = tmp_path_factory.getbasetemp()
        folder = base.parent / "flowrl-cache" if os.environ.get("PYTEST_XDIST_WORKER") else base / "flowrl-cache"
    Path(folder).mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLOWRL_CACHE", str(folder))
        yield os.environ["FLOWRL_CACHE"]


@pytest.fixture(scope="session")
def tiny_world(session_cache):
    """A tiny digits world (1-layer flow model, briefly trained classifiers) built once into the session's cache."""
    from flowrl.digits import BuildConfig, DigitClassifiers, DigitsWorld, build_classifiers, build_model

    config = BuildConfig(pretrain_steps=3, classifier_epochs=3, transformer=TINY_MODEL)
    model_path = build_model(config, log=None)
    return DigitsWorld(model_path, DigitClassifiers(build_classifiers(config, log=None)))


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """A test that builds an `Accelerator` with mixed precision (gpu_bench's tiny mode) leaves accelerate's
    process-wide state behind, which a later test's `Accelerator(mixed_precision=...)` in the same worker refuses."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
