"""Prompt conditioning on disk (`model.cache_text`) and text encoders kept in CPU memory
(`model.offload_text_encoders`): the same bits as encoding, and the encoders are not needed again."""

import pytest
import torch

from flowrl.models import ModelConfig
from flowrl.policies.build import load_policy, text_store_folder
from flowrl.policies.text_store import TextStore, text_encoders


PROMPTS = ["a cat", "a dog", "a red car"]


def _config(**kwargs):
    return ModelConfig(name="tiny:sd3@4", options={"max_sequence_length": 16}, **kwargs)


def test_stored_conditioning_is_the_encoder_s_bits_and_the_encoders_are_not_called(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    first = load_policy(_config(cache_text=True), forward_batch_size=2)
    encoded = first.encode(PROMPTS)
    folder = text_store_folder(_config(cache_text=True), first)
    assert len(list(folder.glob("*.safetensors"))) == len(PROMPTS)
    # another process: a fresh policy reads the conditioning without running a text encoder
    second = load_policy(_config(cache_text=True), forward_batch_size=2)
    for module in text_encoders(second.adapter.pipeline).values():
        monkeypatch.setattr(module, "forward", lambda *a, **k: pytest.fail("a text encoder ran"))
    read = second.encode(PROMPTS)
    assert read.keys() == encoded.keys()
    for key in encoded:
        assert torch.equal(read[key], encoded[key]), key
    # other options are another model: another folder
    other = ModelConfig(name="tiny:sd3@4", options={"max_sequence_length": 8}, cache_text=True)
    assert text_store_folder(other, load_policy(other, forward_batch_size=2)) != folder


def test_a_torn_file_is_re_encoded(tmp_path):
    store = TextStore(tmp_path)
    store.put("a cat", {"x": torch.arange(3.0)})
    assert torch.equal(store.get("a cat")["x"], torch.arange(3.0))
    store._path("a cat").write_bytes(b"not safetensors")
    assert store.get("a cat") is None and store.get("never stored") is None


def test_offloaded_encoders_stay_in_cpu_memory_and_still_encode_new_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    policy = load_policy(_config(), forward_batch_size=2)
    expected = policy.encode(["a new prompt"])["prompt_embeds"].clone()
    policy.clear_text_cache()
    moves = []
    for module in text_encoders(policy.adapter.pipeline).values():
        original = module.to
        monkeypatch.setattr(module, "to", lambda *a, _o=original, **k: (moves.append(a), _o(*a, **k))[1])
    policy.offload_text_encoders()
    assert all(next(m.parameters()).device.type == "cpu" for m in text_encoders(policy.adapter.pipeline).values())
    moves.clear()
    assert torch.equal(policy.encode(["a new prompt"])["prompt_embeds"], expected)  # moved there and back
    assert moves and moves[-1] == ("cpu",)
    moves.clear()
    policy.encode(["a new prompt"])  # cached: the encoders do not move
    assert not moves
