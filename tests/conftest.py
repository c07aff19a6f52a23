import os

import pytest
import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

TEXT = {"max_sequence_length": 16}


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
