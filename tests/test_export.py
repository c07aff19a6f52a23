"""`flowrl export`: a trained run becomes what a diffusers user loads in one line, and samples the same images."""

import dataclasses
import json

import pytest
import torch

from flowrl.cli import main
from flowrl.models.families import MODEL_FAMILIES
from flowrl.policies import DiffusionPolicy
from flowrl.prompts.edit_shapes import draw

from .trainers.conftest import make_trainer, tiny_config


FAMILIES = [f if f in ("sd3", "flux", "unet") else pytest.param(f, marks=pytest.mark.models)
            for f in MODEL_FAMILIES.names()]  # fmt: skip
"""A flow transformer, a guidance-embedding one and a DDIM UNet in the default tier; every other family's export
runs with the `models` tier (`.ci/run`'s second step)."""


def _pipeline(family, folder):
    import diffusers

    cls = MODEL_FAMILIES.get(family)  # (Qwen-Image-Edit: its processor without torchvision, as flowrl loads it)
    return getattr(diffusers, cls.pipeline_class).from_pretrained(folder, **cls.pipeline_load_kwargs(str(folder)))


def _options(family):
    """Short T5 prompts and short videos for the families that have those options."""
    fields = {f.name for f in dataclasses.fields(MODEL_FAMILIES.get(family).Options)}
    return {k: v for k, v in {"max_sequence_length": 16, "num_frames": 5}.items() if k in fields}


def _brightness(images, prompts, **_):
    return images.float().flatten(1).mean(1)  # images [B, 3, H, W] or videos [B, 3, F, H, W]


def _train(family, lora, tmp_path, monkeypatch, ema=True):
    """One epoch of flow_grpo (DDIM for the UNet) on a tiny pipeline folder, EMA on; returns (run, base)."""
    base = tmp_path / "base"
    MODEL_FAMILIES.get(family).tiny(seed=1).save_pretrained(base)
    (tmp_path / "prompts.txt").write_text("a red cat\na blue dog\n")
    prompts = str(tmp_path / "prompts.txt")
    if MODEL_FAMILIES.get(family).conditioning == "start_frame":  # image-to-video: prompts with their start frames
        prompts = "motion_shapes/train"
    adapter = MODEL_FAMILIES.get(family)
    sampler = {"sampler": adapter.default_sampler, "noise_level": 1.0 if adapter.default_sampler == "ddim" else 0.7}
    run = tmp_path / "run"
    config = {
        "trainer": "flow_grpo",
        "model": {"name": str(base), "lora_rank": 4 if lora else 0, "options": _options(family)},
        "sampling": {
            "num_steps": 2,
            "guidance_scale": 1.0,
            "height": 64,
            "width": 64,
            **sampler,
        },  # fmt: skip
        "batch": {"mini_batch_size": 4, "micro_batch_size": 4},
        "prompts": {"train": prompts, "test": prompts, "prompts_per_epoch": 2, "group_size": 2},
        "rewards": [{"name": "tests.test_export:_brightness"}],
        "eval": {"every": 0, "samples_per_prompt": 1},
        "optim": {"lr": 1e-2},
        "objective": {"clip_eps_low": 0.1},
        "run": {"epochs": 1, "log_with": [], "samples_every": 0, "output_dir": str(run)},
        **({"ema_decay": 0.5, "ema_every": 1} if ema else {}),
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    assert main(["train", str(path)]) == 0
    return run, base


def _samples(policy, family):
    """ODE (DDIM eta 0) samples of two prompts from fixed noise (image-to-video: from a drawn start frame)."""
    start = MODEL_FAMILIES.get(family).conditioning == "start_frame"
    sources = {"source_images": [draw("square", "blue", (10, 12, 40, 42))] * 2} if start else {}
    kwargs = dict(num_steps=2, guidance_scale=1.0, sampler="ode", height=64, width=64, **sources)
    return policy.rollout(["a red cat", "a blue dog"], generator=torch.Generator().manual_seed(3), **kwargs).images


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_runs_export_to_load_lora_weights(family, tmp_path, monkeypatch, capsys):
    from flowrl.trainers import build_trainer, load_config

    run, base = _train(family, True, tmp_path, monkeypatch)
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    load = "load_lora_adapter" if MODEL_FAMILIES.get(family).lora_loader else "load_lora_weights"
    assert load in printed and (out / "pytorch_lora_weights.safetensors").is_file()
    record = json.loads((out / "flowrl_export.json").read_text())
    assert record["ema"] and record["kind"] == "lora" and record["epoch"] == 1
    # a plain diffusers pipeline with the exported LoRA samples what the run's EMA policy samples
    pipe = _pipeline(family, base)
    MODEL_FAMILIES.get(family).load_lora_into(pipe, out)  # `load_lora_weights`, or the family's `lora_loader`
    exported = _samples(DiffusionPolicy.from_pipeline(pipe, options=_options(family)), family)
    trainer = build_trainer(load_config(run / "config.yaml", ["run.log_with=[]"]), output_dir=run)
    trainer.load_checkpoint(run / "checkpoints" / "epoch_1")
    with trainer.ema.swapped():
        ours = _samples(trainer.policy, family)
    raw = _samples(trainer.policy, family)
    torch.testing.assert_close(exported, ours, rtol=0, atol=2e-5)
    assert (raw - ours).abs().max() > 1e-4  # the EMA differs from the raw weights: the test can tell them apart
    # --no-ema exports the raw weights
    main(["export", str(run), "--out", str(tmp_path / "raw"), "--no-ema"])
    pipe = _pipeline(family, base)
    MODEL_FAMILIES.get(family).load_lora_into(pipe, tmp_path / "raw")
    torch.testing.assert_close(_samples(DiffusionPolicy.from_pipeline(pipe, options=_options(family)), family), raw,
                               rtol=0, atol=2e-5)  # fmt: skip


def test_full_fine_tunes_export_the_pipeline_folder(tmp_path, monkeypatch, capsys):
    from diffusers import StableDiffusion3Pipeline

    from flowrl.trainers import build_trainer, load_config

    run, _ = _train("sd3", False, tmp_path, monkeypatch)
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert "StableDiffusion3Pipeline.from_pretrained" in capsys.readouterr().out
    exported = _samples(DiffusionPolicy.from_pipeline(StableDiffusion3Pipeline.from_pretrained(out),
                                                      options=_options("sd3")), "sd3")  # fmt: skip
    trainer = build_trainer(load_config(run / "config.yaml", ["run.log_with=[]"]), output_dir=run)
    trainer.load_checkpoint(run / "checkpoints" / "epoch_1")
    with trainer.ema.swapped():
        torch.testing.assert_close(exported, _samples(trainer.policy, "sd3"), rtol=0, atol=2e-5)


def _loaded(trainer, run_dir):
    """A trainer's policy as `flowrl.trainers.inference.load_run` hands it to `write` (its raw weights)."""
    from flowrl.trainers.inference import LoadedRun

    return LoadedRun(run_dir, run_dir / "checkpoints" / f"epoch_{trainer.epoch}", trainer.config, trainer.epoch,
                     trainer.modality, trainer.algorithm, ema=False)  # fmt: skip


def test_digits_full_fine_tunes_export_a_digits_model_folder(tiny_world, tmp_path):
    from diffusers import SD3Transformer2DModel

    from flowrl.digits import DigitsWorld
    from flowrl.export import write

    trainer = make_trainer(tiny_world, tiny_config("grpo_guard", tmp_path, overrides=["run.epochs=1"]))
    trainer.train()
    record = write(_loaded(trainer, tmp_path), tmp_path / "export")
    assert record["kind"] == "full" and not record["ema"] and "DigitsWorld(" in record["load"]
    loaded = SD3Transformer2DModel.from_pretrained(tmp_path / "export" / "transformer")
    for (name, a), b in zip(trainer.policy.model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    # the folder is a digits model: the world loads it as a policy that samples what the trained policy samples
    policy = DigitsWorld(tmp_path / "export", tiny_world.classifiers).policy()
    for a, b in zip(trainer.policy.model.parameters(), policy.model.parameters()):
        assert torch.equal(a, b)


def test_export_refuses_what_it_cannot_write(tiny_world, tmp_path, capsys):
    from flowrl.export import write

    from .trainers.test_find import find_config

    find = make_trainer(tiny_world, find_config(tmp_path))
    with pytest.raises(ValueError, match="find trains FINDNoisePolicy, not the diffusion model"):
        write(_loaded(find, tmp_path), tmp_path / "out")
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a run folder" in capsys.readouterr().err


def test_sample_writes_pngs_a_grid_and_the_diffusers_lines(tmp_path, monkeypatch, capsys):
    run, _ = _train("sd3", True, tmp_path, monkeypatch)
    out = tmp_path / "samples"

    def sample(folder, *extra, target=run):
        assert main(["sample", str(target), "--prompts", "a red cat", "--n", "2", "--num-steps", "2",
                     "--out", str(folder), *extra]) == 0  # fmt: skip
        return [(folder / name).read_bytes() for name in ("000-a-red-cat_0.png", "000-a-red-cat_1.png")]

    first = sample(out, "--seed", "5")
    printed = capsys.readouterr().out
    assert "grid.png" in printed and "pipe.load_lora_weights(" in printed and "from_pretrained(" in printed
    record = json.loads((out / "sample.json").read_text())
    assert record["ema"] and record["epoch"] == 1 and record["sampler"] == "ode"
    assert [f["file"] for f in record["files"]] == ["000-a-red-cat_0.png", "000-a-red-cat_1.png"] and (
        out / "grid.png"
    ).is_file()
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert first[0] != first[1]  # two samples of one prompt
    # the same seed gives the same images (also from the checkpoint folder itself); another seed or the raw
    # weights instead of the EMA give others
    assert sample(tmp_path / "again", "--seed", "5", target=run / "checkpoints" / "epoch_1") == first
    assert sample(tmp_path / "other", "--seed", "6") != first
    assert sample(tmp_path / "raw", "--seed", "5", "--no-ema") != first
    # a prompt file; a best checkpoint the run never kept
    assert main(["sample", str(run), "--prompts", str(tmp_path / "prompts.txt"), "--n", "1", "--num-steps", "1",
                 "--out", str(tmp_path / "file")]) == 0  # fmt: skip
    assert len(json.loads((tmp_path / "file" / "sample.json").read_text())["files"]) == 2
    capsys.readouterr()
    assert main(["sample", str(run), "--prompts", "a cat", "--checkpoint", "best"]) == 2
    assert "kept no best checkpoint" in capsys.readouterr().err


def test_export_of_ema_weights_a_run_never_kept_fails_in_one_line(tmp_path, monkeypatch, capsys):
    run, _ = _train("sd3", True, tmp_path, monkeypatch, ema=False)
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "out"), "--ema"]) == 2
    assert "kept no EMA weights" in capsys.readouterr().err
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0  # the raw weights, by default
