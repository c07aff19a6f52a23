import pytest
import torch

from tests.rewards.tiny_models import (
    aesthetic_head_state,
    imagereward_official_state,
    save_tiny_clip,
    write_bert_vocab,
)


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="session")
def head_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("aesthetic") / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(aesthetic_head_state(), path)
    return path


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory):
    return write_bert_vocab(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="session")
def imagereward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("imagereward") / "ImageReward.pt"
    torch.save(imagereward_official_state(), path)
    return path


@pytest.fixture
def images():
    """Three non-square images in [0, 1] (the rewards resize and crop them)."""
    return torch.rand(3, 3, 40, 48, generator=torch.Generator().manual_seed(0))


PROMPTS = ["a photo of a cat", "a red dog", "a photo of a cat"]
