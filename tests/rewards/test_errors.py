"""Missing weights, offline hub ids and near-empty tokenizers end in one clear error naming the reward."""

import pytest
import torch

from flowrl import rewards
from flowrl.rewards import RewardWeightsError
from tests.rewards.tiny_models import save_tiny_clip


MISSING_REPO = "flowrl-tests/no-such-model"  # never in the cache; HF_HUB_OFFLINE=1 in the test session


def test_error_type_is_a_file_not_found_error():
    assert issubclass(RewardWeightsError, FileNotFoundError)


def test_aesthetic_without_head_says_where_to_get_it(clip_dir):
    with pytest.raises(RewardWeightsError) as err:
        rewards.get("aesthetic", model=str(clip_dir))
    message = str(err.value)
    assert "'aesthetic'" in message and "sac+logos+ava1-l14-linearMSE.pth" in message
    assert "github.com/christophschuhmann/improved-aesthetic-predictor" in message and "head=PATH" in message
    with pytest.raises(RewardWeightsError, match="no such file or folder"):
        rewards.get("aesthetic", model=str(clip_dir), head="/no/such/dir/head.pth")


def test_folder_without_the_file(clip_dir, tmp_path):
    (tmp_path / "other.bin").write_bytes(b"")
    with pytest.raises(RewardWeightsError, match=r"holds none of them \(it has \['other.bin'\]\)"):
        rewards.get("aesthetic", model=str(clip_dir), head=str(tmp_path))


@pytest.mark.parametrize(
    ("name", "kwargs", "expected"),
    [
        ("clip_score", {"model": MISSING_REPO}, "hf download openai/clip-vit-large-patch14"),
        ("pickscore", {"model": MISSING_REPO}, "hf download yuvalkirstain/PickScore_v1"),
        ("aesthetic", {"model": MISSING_REPO, "head": "HEAD"}, "hf download openai/clip-vit-large-patch14"),
        ("imagereward", {"checkpoint": MISSING_REPO}, "hf download THUDM/ImageReward ImageReward.pt"),
    ],
)
def test_offline_hub_ids(name, kwargs, expected, head_file):
    kwargs = {k: str(head_file) if v == "HEAD" else v for k, v in kwargs.items()}
    with pytest.raises(RewardWeightsError) as err:
        rewards.get(name, **kwargs)
    message = str(err.value)
    assert f"reward {name!r}" in message and MISSING_REPO in message and expected in message
    assert "HF_HUB_OFFLINE=1" in message and "It needs:" in message


def test_pickscore_processor_offline(clip_dir):
    with pytest.raises(RewardWeightsError, match=r"'pickscore'.*tokenizer.*laion/CLIP-ViT-H-14-laion2B-s32B-b79K"):
        rewards.get("pickscore", model=str(clip_dir), processor=MISSING_REPO)


def test_empty_local_folder(tmp_path):
    with pytest.raises(RewardWeightsError, match="folder exists but the files are missing"):
        rewards.get("clip_score", model=str(tmp_path))
    with pytest.raises(RewardWeightsError, match="no such file or folder"):
        rewards.get("clip_score", model=str(tmp_path / "nope" / "deeper"))


def test_clip_tokenizer_smaller_than_the_model_vocabulary(tmp_path):
    folder = save_tiny_clip(tmp_path / "clip", vocab_size=5000)  # a ~500-token tokenizer for a 5000-token model
    with pytest.raises(RewardWeightsError, match=r"'clip_score'.*only \d+ tokens \(expected at least 4500\)"):
        rewards.get("clip_score", model=str(folder))


def test_imagereward_offline_tokenizer_is_caught(imagereward_file):
    # transformers 5 returns a 5-token BertTokenizer for an uncached hub id instead of raising
    with pytest.raises(RewardWeightsError, match=r"'imagereward'.*only 5 tokens.*hf download google-bert"):
        rewards.get("imagereward", checkpoint=str(imagereward_file), tokenizer="google-bert/bert-base-uncased")


def test_imagereward_tokenizer_must_match_the_embedding_table(imagereward_file, tmp_path):
    from tests.rewards.tiny_models import write_bert_vocab

    folder = write_bert_vocab(tmp_path / "big", size=30600)
    with pytest.raises(ValueError, match="30602 tokens .* embedding table has 30524"):
        rewards.get("imagereward", checkpoint=str(imagereward_file), tokenizer=str(folder))


def test_pickled_objects_are_refused(clip_dir, tmp_path):
    torch.save({"layers.0.weight": torch.zeros(1, 16), "fn": print}, tmp_path / "head.pth")
    with pytest.raises(ValueError, match="weights_only=True"):
        rewards.get("aesthetic", model=str(clip_dir), head=str(tmp_path / "head.pth"))


@pytest.mark.skipif(__import__("importlib").util.find_spec("open_clip") is not None, reason="open_clip is installed")
def test_open_clip_backend_names_the_extra_when_it_is_missing():
    with pytest.raises(ImportError, match=r"'clip_score' needs open_clip.*pip install flowrl-toolkit\[openclip\]"):
        rewards.get("clip_score", backend="open_clip")
