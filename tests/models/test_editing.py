"""Editing models (FLUX.1 Kontext) through flowrl: source images condition the rollout exactly as the diffusers
pipeline does, re-score exactly, reach the rewards that ask for them, train, and sample from the CLI."""

import json

import pytest
import torch
from safetensors.torch import load_file

from flowrl import prompts as prompt_sets
from flowrl import rewards
from flowrl.cli import main
from flowrl.models.families import MODEL_FAMILIES
from flowrl.policies import DiffusionPolicy, DiffusionRollout
from flowrl.prompts.edit_shapes import draw
from flowrl.rewards.scoring import Rewards
from flowrl.runtime import Processes
from flowrl.sample import sample


OPTIONS = {"max_sequence_length": 16, "auto_resize": False}
PROMPTS = ["make the square red", "make the circle blue", "make the square red", "a cat"]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def pipe():
    pipe = MODEL_FAMILIES.get("flux_kontext").tiny(seed=7)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def sources():
    """Two 64 x 64 source images (a blue square, a green circle)."""
    return [draw("square", "blue", (10, 12, 40, 42)), draw("circle", "green", (20, 8, 52, 40))]


def _policy(pipe, **kwargs):
    return DiffusionPolicy.from_pipeline(pipe, options=OPTIONS, **kwargs)


def test_ode_rollout_with_a_source_image_reproduces_the_kontext_pipeline(pipe, sources):
    policy = _policy(pipe)
    rollout = policy.rollout(
        PROMPTS[:2],
        num_steps=4,
        guidance_scale=2.5,
        sampler="ode",
        generator=_gen(),
        height=64,
        width=64,
        source_images=[sources[0]] * 2,
    )
    images = pipe(
        image=sources[0],
        prompt=PROMPTS[:2],
        height=64,
        width=64,
        num_inference_steps=4,
        guidance_scale=2.5,
        output_type="pt",
        generator=_gen(),
        max_sequence_length=16,
        max_area=64 * 64,
        _auto_resize=False,
    ).images
    torch.testing.assert_close(rollout.images, images, rtol=0, atol=1e-5)
    # the source image changed the result, and the rollout keeps it as the model saw it
    plain = policy.rollout(
        PROMPTS[:2], num_steps=4, guidance_scale=2.5, sampler="ode", generator=_gen(), height=64, width=64
    ).images
    assert (plain - rollout.images).abs().max() > 1e-3
    assert rollout.source_images.shape == (2, 1, 3, 64, 64)
    expected = torch.from_numpy(__import__("numpy").array(sources[0])).permute(2, 0, 1).float() / 255
    torch.testing.assert_close(rollout.source_images[0, 0], expected, rtol=0, atol=1e-6)


def test_the_sde_sampler_rescores_a_source_conditioned_rollout_exactly(pipe, sources):
    """Ratio exactly 1 at the old weights: in chunks, after `select` and after `cat` of two parts."""
    policy = _policy(pipe, forward_batch_size=2)
    entries = [sources[0], sources[1], sources[0], [sources[1]]]  # one image, or a list of one
    parts = [
        policy.rollout(
            PROMPTS[i : i + 2],
            num_steps=4,
            guidance_scale=2.5,
            sampler="flow_sde",
            noise_level=0.8,
            generator=_gen(i),
            height=64,
            width=64,
            source_images=entries[i : i + 2],
        )
        for i in (0, 2)
    ]
    rollout = DiffusionRollout.cat(parts)
    steps = rollout.sde_steps
    assert len(steps) >= 3
    assert torch.equal(policy.log_prob(rollout, steps.expand(4, -1)), rollout.log_probs[:, steps])
    picked = rollout.select([2, 0])
    assert torch.equal(policy.log_prob(picked, steps.expand(2, -1)), picked.log_probs[:, steps])
    # groups are (prompt, source image) pairs: rows 0 and 2 share both; row 3 shares row 1's image only
    assert rollout.group_ids.tolist() == [0, 1, 0, 2] and len(rollout.edit_keys) == 3
    assert torch.equal(rollout.source_images[0], rollout.source_images[2])


def test_the_trainer_s_loss_sees_the_source_images_ratio_exactly_one(tmp_path, monkeypatch):
    """An epoch of the tiny config: groups per (prompt, source image), and the loss's log-probs at the old weights
    equal the rollout's (the training forward gets the source latents too)."""
    from flowrl.trainers import build_trainer, load_config

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    overrides = [
        "prompts.prompts_per_epoch=2",
        "prompts.group_size=2",
        "batch.mini_batch_size=4",
        "batch.micro_batch_size=2",
        "sampling.num_steps=3",
        f"run.output_dir={tmp_path}",
    ]
    config = load_config("configs/flux_kontext/tiny.yaml", overrides)
    trainer = build_trainer(config)
    batch, collected, _ = trainer.prepare_epoch(0)
    rollout = collected.data
    assert rollout.source_images.shape == (4, 1, 3, 64, 64) and collected.group_ids.tolist() == [0, 0, 1, 1]
    assert rollout.group_ids.tolist() == [0, 0, 1, 1]
    mb = trainer.scheduler.micro_batch(batch)
    terms = trainer.algorithm.terms(mb, mb.index)
    assert torch.equal(terms.logp.detach(), terms.old_logp)


def test_a_pair_s_conditioning_does_not_depend_on_its_batch(pipe, sources):
    alone, batched = _policy(pipe), _policy(pipe)
    a = alone.encode_edits(["make the square red"], [sources[0]])
    b = batched.encode_edits(["a cat", "make the square red", "x"], [sources[1], sources[0], sources[0]])
    for key in a.cond:
        assert torch.equal(a.cond[key][0], b.cond[key][b.ids[1]])
    with pytest.raises(ValueError, match="one source image"):
        alone.encode_edits(["x"], [[sources[0], sources[1]]])


def test_the_edit_rewards_are_hand_checkable(sources):
    import numpy as np

    source = torch.from_numpy(np.array(sources[0])).permute(2, 0, 1).float()[None] / 255  # [1, 3, 64, 64]
    region, red = [10 / 64, 12 / 64, 40 / 64, 42 / 64], [220 / 255, 30 / 255, 30 / 255]
    consistency, color = rewards.get("edit_consistency"), rewards.get("edit_color")
    edited = torch.from_numpy(np.array(draw("square", "red", (10, 12, 40, 42)))).permute(2, 0, 1).float()[None] / 255
    changed = source.clone()
    changed[:, :, 48:60, 4:30] = 0  # a black bar outside the square
    images = torch.cat([source, edited, changed])
    kwargs = dict(source_images=source[:, None].expand(3, 1, 3, 64, 64), region=[region] * 3, color=[red] * 3)
    scores = consistency(images, ["make the square red"] * 3, **kwargs)
    assert scores[0] == 1 and scores[1] == 1 and scores[2] < 0.95  # an edit inside the region costs nothing
    assert consistency(source, ["x"], source_images=source[:, None])[0] == 1  # no region: the whole image
    c = color(images, ["make the square red"] * 3, **kwargs)
    assert c[1] == pytest.approx(1.0, abs=1e-6) and c[0] < 0.6  # the red square scores 1, the blue one less
    with pytest.raises(ValueError, match="source images"):
        consistency(source, ["x"])
    # only rewards that ask for source images get them
    seen = {}

    def plain(images, prompts, **metadata):
        seen.update(metadata)
        return torch.zeros(len(prompts))

    scored = Rewards({"plain": plain, "edit_consistency": consistency}, {"edit_consistency": 1.0}, Processes.single())
    out = scored.score(source, [prompt_sets.Prompt("x")], sources=source[:, None])
    assert "source_images" not in seen and out["edit_consistency"][0] == 1


def test_editing_prompt_sets_carry_their_source_images(tmp_path, sources):
    train = prompt_sets.load("edit_shapes/train")
    assert "edit_shapes/train" in prompt_sets.list_sets() and len(train) == 32
    assert all(len(p.images) == 1 and {"region", "color"} <= set(p.metadata) for p in train)
    assert [p.images[0].tobytes() for p in prompt_sets.load("edit_shapes/train")] == [
        p.images[0].tobytes() for p in train
    ]
    sources[0].save(tmp_path / "a.png")
    (tmp_path / "set.jsonl").write_text('{"prompt": "make it red", "image": "a.png"}\n{"prompt": "a cat"}\n')
    rows = prompt_sets.load(tmp_path / "set.jsonl")
    assert rows[0].images == (str(tmp_path / "a.png"),) and rows[1].images == () and rows[0].metadata == {}
    same_text = prompt_sets.Prompt("make it red", images=(sources[1],))
    keys = [prompt_sets.group_key(p) for p in (rows[0], same_text, rows[1])]
    assert len(set(keys)) == 3 and keys[2] == "a cat"


def test_grpo_guard_trains_on_source_images_and_flowrl_sample_edits_an_image(tmp_path, monkeypatch, sources):
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    overrides = [
        "run.epochs=1",
        "prompts.prompts_per_epoch=2",
        "prompts.group_size=2",
        "batch.mini_batch_size=4",
        "batch.micro_batch_size=2",
        "sampling.num_steps=3",
        "eval.every=100",
        "run.samples_every=0",
    ]
    args = ["train", "configs/flux_kontext/tiny.yaml", "--output-dir", str(run)]
    assert main(args + [x for o in overrides for x in ("--set", o)]) == 0
    row = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert 0 < row["reward/edit_consistency"] <= 1 and row["optimizer_steps"] >= 1
    assert main(["export", str(run), "--out", str(tmp_path / "lora")]) == 0
    lora = load_file(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in lora.items())  # zero at init: the update moved it
    sources[0].save(tmp_path / "source.png")
    out = tmp_path / "samples"
    assert (
        main(
            [
                "sample",
                str(run),
                "--prompts",
                "make the square red",
                "--image",
                str(tmp_path / "source.png"),
                "--n",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads((out / "sample.json").read_text())
    assert len(record["files"]) == 2 and all((out / f["file"]).is_file() for f in record["files"])
    assert record["images"] == [[str(tmp_path / "source.png")]] and "load_image" in record["diffusers"][2]
    with pytest.raises(ValueError, match="no such file"):  # before any model loads
        sample(run, "x", image=str(tmp_path / "missing.png"), out=out)


@pytest.mark.parametrize(
    ("trainer", "settings"),
    [
        ("find", ["model.lora_rank=0"]),
        ("tempflow_grpo", ["seeds_per_prompt=1", "branches=2", "prompts.group_size=6", "batch.mini_batch_size=24"]),
        ("dpok", []),
    ],
)
def test_trainers_without_an_editing_path_refuse_editing_prompts_in_one_line(trainer, settings, tmp_path, monkeypatch):
    from flowrl.trainers import build_trainer, load_config

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    overrides = [f"trainer={trainer}", f"run.output_dir={tmp_path}", *settings]
    config = load_config("configs/flux_kontext/tiny.yaml", overrides)
    with pytest.raises(ValueError, match=f"{trainer} does not train on editing prompts"):
        build_trainer(config)


def test_per_prompt_statistics_key_an_editing_prompt_by_its_source_too():
    from types import SimpleNamespace

    from flowrl.prompts import group_key
    from flowrl.run.algorithm import Algorithm

    rows = prompt_sets.load("edit_shapes/train")
    same_text = [p for p in rows if str(p) == str(rows[0])][:2]
    assert len(same_text) == 2 and group_key(same_text[0]) != group_key(same_text[1])
    seen = []

    def estimator(rewards, group_ids, keys):
        seen.extend(keys)
        return torch.zeros(len(keys)), {}

    collected = SimpleNamespace(
        prompts=same_text * 2, group_ids=torch.tensor([0, 1, 0, 1]), rewards={"r": torch.arange(4.0)}
    )
    Algorithm.advantages(SimpleNamespace(estimator=estimator), collected, torch.ones(4, dtype=torch.bool))
    assert seen == [group_key(p) for p in same_text * 2]  # the per-prompt trackers see (text, source) pairs
