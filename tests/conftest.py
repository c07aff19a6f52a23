import os

import pytest
import torch

from flowrl.digits.nets import TransformerConfig


os.environ.setdefault("HF_HUB_OFFLINE", "1")
# trainers keep torch's thread count in tests: exactness tests compare runs, and a busy CI machine must not
# change the count between them (tests/test_threads.py and test_shared_loop.py cover `run.threads`)
os.environ.setdefault("FLOWRL_THREADING", "torch")
torch.set_num_threads(min(2, torch.get_num_threads()))

TEXT = {"max_sequence_length": 16}

TINY_DIGITS_RUN = {
    "trainer": "grpo_guard",
    "model": {"name": "digits", "digits_pretrain_steps": 2},
    "sampling": {"num_steps": 3, "guidance_scale": 1.0, "forward_batch_size": 8},
    "prompts": {"prompts_per_epoch": 2, "group_size": 4},
    "eval": {"every": 0, "samples_per_prompt": 1, "max_prompts": 4, "metrics": ["digits_gold"]},
    "optim": {"lr": 1e-4},
}
"""A `flowrl` run config on a 2-step digits base model (CLI tests add their `run` section)."""


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


TINY_MODEL = TransformerConfig(num_layers=1, attention_head_dim=8, num_attention_heads=2, caption_projection_dim=16)


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    """A tiny digits world (1-layer flow model, briefly trained classifiers) built once into a temporary cache."""
    from flowrl.digits import BuildConfig, DigitClassifiers, DigitsWorld, build_classifiers, build_model

    old = os.environ.get("FLOWRL_CACHE")
    os.environ["FLOWRL_CACHE"] = str(tmp_path_factory.mktemp("flowrl-cache"))
    try:
        config = BuildConfig(pretrain_steps=3, classifier_epochs=3, transformer=TINY_MODEL)
        model_path = build_model(config, log=None)
        yield DigitsWorld(model_path, DigitClassifiers(build_classifiers(config, log=None)))
    finally:
        if old is None:
            os.environ.pop("FLOWRL_CACHE", None)
        else:
            os.environ["FLOWRL_CACHE"] = old
