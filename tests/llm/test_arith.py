import json

import pytest
import torch

from flowrl.llm import build as llm_build
from flowrl.llm.arith import (
    EOS,
    MAX_OPERAND,
    Problem,
    all_problems,
    make_problems,
    solve,
    split_of,
)
from flowrl.llm.build import BuildConfig, build, encode, load, make_tokenizer
from flowrl.rewards.text import END_MARKERS, arith_reward, parse_answer


TINY = BuildConfig(train_steps=3, hidden_size=16, num_layers=1, num_heads=2, eval_samples=1)
"""A 1-layer model trained for 3 steps: builds in about a second."""


def test_problems_are_deterministic_and_right():
    first = make_problems(300, seed=0)
    assert first == make_problems(300, seed=0)
    assert first[:100] == make_problems(100, seed=0)  # a longer list starts with the shorter one
    assert first != make_problems(300, seed=1)
    assert {p.prompt[-1] for p in first} == {"="} and {"+", "-"} <= {
        p.prompt[-3:-1].strip("0123456789") for p in first
    }
    for p in first + make_problems(100, seed=0, split="test"):
        a, op, b = p.prompt[:-1].partition("+") if "+" in p.prompt else p.prompt[:-1].partition("-")
        assert 0 <= int(a) <= MAX_OPERAND and 0 <= int(b) <= MAX_OPERAND and str(int(a)) == a and str(int(b)) == b
        assert p.answer == str(int(a) + int(b) if op == "+" else int(a) - int(b)) and int(p.answer) >= 0
    assert solve(23, "+", 5) == Problem("23+5=", "28")


def test_splits_are_disjoint_and_cover_the_grammar():
    train, test = all_problems("train"), all_problems("test")
    assert len(train) + len(test) == 900 + 465 and not {p.prompt for p in train} & {p.prompt for p in test}
    assert 0.15 < len(test) / (len(train) + len(test)) < 0.25
    assert {p.prompt for p in make_problems(500, seed=3, split="test")} <= {p.prompt for p in test}
    assert all(split_of(p.prompt) == "train" for p in make_problems(500, seed=3))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="split 'val'"):
        make_problems(3, seed=0, split="val")
    with pytest.raises(ValueError, match="outside the grammar"):
        solve(3, "-", 5)
    with pytest.raises(ValueError, match="outside the grammar"):
        solve(MAX_OPERAND + 1, "+", 0)
    with pytest.raises(ValueError, match="operator"):
        solve(3, "/", 1)
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        arith_reward(["1", "2"], ["1"])
    with pytest.raises(TypeError, match="lists"):
        arith_reward("1", "1")


@pytest.mark.parametrize(
    ("completion", "parsed", "reward"),
    [
        ("68", "68", 1.0),  # decoded with skip_special_tokens=True
        ("68<eos><pad><pad>", "68", 1.0),  # decoded with the special tokens
        ("68\n12+3=15", "68", 1.0),  # anything after the first marker is ignored
        (" 68 \n", "68", 1.0),
        ("67", "67", 0.0),
        ("068", "068", 0.0),  # exact match: no leading zeros
        ("68 12", "68 12", 0.0),  # trailing garbage before any marker
        ("6", "6", 0.0),
        ("", "", 0.0),
        ("<eos>68", "", 0.0),
    ],
)
def test_reward_parses_completions(completion, parsed, reward):
    assert parse_answer(completion) == parsed
    out = arith_reward([completion, "68"], ["68", "5"])
    assert out.dtype == torch.float32 and out.tolist() == [reward, 0.0]


def test_tokenizer_round_trips_and_left_pads():
    tokenizer = make_tokenizer()
    text = "23+5=28\n0-0=0 "
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + len(text)  # <bos>, then one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id]) == "<bos>" + text + EOS
    assert tokenizer("1" + EOS, add_special_tokens=False)["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(tokenizer("7x")["input_ids"]) == "<bos>7<unk>"
    batch = tokenizer(["1+1=", "23+15="], padding=True)
    assert tokenizer.padding_side == "left" and batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1, 1]
    ids, mask, answer_mask = encode(tokenizer, ["1+1=", "23+15="], ["2", "38"])
    assert tokenizer.decode(ids[0][answer_mask[0].bool()]) == "2" + EOS
    assert tokenizer.decode(ids[1][answer_mask[1].bool()]) == "38" + EOS and mask[0].sum() == 7


def test_tiny_build_loads_generates_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    threads = torch.get_num_threads()
    path = build(TINY, log=None)
    assert path.parent == tmp_path / "llm" and torch.get_num_threads() == threads
    meta = json.loads((path / "build.json").read_text())
    assert meta["config"]["train_steps"] == 3 and 0 <= meta["test_accuracy_sampled"] <= 1
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()

    model, tokenizer = load(path)
    assert tokenizer.padding_side == "left" and model.config.tie_word_embeddings and not model.training
    prompts = ["1+1=", "23+15=", "29-0="]
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    out = model.generate(**batch, do_sample=False, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[:, batch["input_ids"].shape[1] :]  # [3, <= MAX_NEW_TOKENS]
    assert len(tokenizer.batch_decode(new, skip_special_tokens=True)) == 3
    for row, prompt in enumerate(prompts):  # left padding changes nothing: each row as if alone
        alone = model.generate(
            **tokenizer([prompt], return_tensors="pt"),
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        torch.testing.assert_close(out.logits[0][row], alone.logits[0][0], atol=1e-5, rtol=1e-5)

    monkeypatch.setattr(llm_build, "_build", lambda *args: pytest.fail("rebuilt a cached model"))
    assert build(TINY, log=None) == path


def test_load_refuses_a_folder_that_is_not_a_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="no build.json"):
        load(tmp_path)


@pytest.mark.slow
def test_default_build_is_under_trained(tmp_path, monkeypatch):
    """The default base model solves some test problems but leaves RL headroom (seeds 0-2 give 0.22-0.30 sampled)."""
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    meta = json.loads((build(log=None) / "build.json").read_text())
    assert 0.15 <= meta["test_accuracy_sampled"] <= 0.45
    assert 0.15 <= meta["test_accuracy_greedy"] <= 0.6


def test_the_reward_s_end_markers_are_the_tokenizer_s_end_token_and_a_newline():
    assert END_MARKERS == ("\n", EOS)  # rewards/text.py writes the tokenizer's end token as text
