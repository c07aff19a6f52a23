"""`flowrl export`: a trained run becomes what a diffusers user loads in one line, and samples the same images."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from flowrl.cli import main
from flowrl.export import LINE_LENGTH, indented, ruff_layout
from flowrl.models.families import MODEL_FAMILIES
from flowrl.policies import DiffusionPolicy
from flowrl.prompts.edit_shapes import draw

from .trainers.conftest import make_trainer, tiny_config


DEFAULT_TIER = ("sd3", "flux", "unet")
FAMILIES = [f if f in DEFAULT_TIER else pytest.param(f, marks=pytest.mark.models) for f in MODEL_FAMILIES.names()]
"""A flow transformer, a guidance-embedding one and a DDIM UNet in the default tier; every other family's export
runs with the `models` tier (`.ci/run`'s second step), without the checks that do not depend on the family (`--no-ema`
exports the raw weights; another seed's image is told apart from the snippet's)."""


def _pipeline(family, folder):
    import diffusers

    cls = MODEL_FAMILIES.get(family)  # (Qwen-Image-Edit: its processor without torchvision, as flowrl loads it)
    return getattr(diffusers, cls.pipeline_class).from_pretrained(folder, **cls.pipeline_load_kwargs(str(folder)))


def _options(family):
    """Short T5 prompts, short Qwen text (HunyuanVideo 1.5 pads to 1000 tokens, Qwen-Image 2.1 to 512 otherwise) and
    short videos for the families that have those options (48 tokens where a source image adds its own to the prompt:
    Qwen-Image-Edit-Plus's "Picture 1: " before `edit_shapes/test`'s instructions), and FLUX.1 Kontext's sources at
    their own 64 px (not resized to a megapixel)."""
    cls = MODEL_FAMILIES.get(family)
    fields = {f.name for f in dataclasses.fields(cls.Options)}
    length = 48 if cls.pipeline_needs_sources else 16
    options = {"max_sequence_length": length, "text_tokens": 32, "num_frames": 5, "auto_resize": False}
    return {k: v for k, v in options.items() if k in fields}


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
        },
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
def test_lora_runs_export_to_load_lora_weights(family, tmp_path, monkeypatch, capsys, small_edit_sources):
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
    if family in DEFAULT_TIER:  # --no-ema exports the raw weights
        main(["export", str(run), "--out", str(tmp_path / "raw"), "--no-ema"])
        pipe = _pipeline(family, base)
        MODEL_FAMILIES.get(family).load_lora_into(pipe, tmp_path / "raw")
        torch.testing.assert_close(
            _samples(DiffusionPolicy.from_pipeline(pipe, options=_options(family)), family), raw, rtol=0, atol=2e-5
        )
    _the_printed_snippets_run_and_sample_what_flowrl_sampled(family, run, out, tmp_path, capsys)


def _the_printed_snippets_run_and_sample_what_flowrl_sampled(family, run, exported, tmp_path, capsys):
    """The diffusers lines `flowrl sample` and `flowrl export` print (and write to sample.json and
    flowrl_export.json), executed as printed: they run, and sample (at the run's size, steps, guidance, negative
    prompt, seed and noise; an editing or image-to-video model from its prompt set's own in-memory image, written
    beside the samples) what flowrl samples (`flowrl sample`'s first image; export's lines: as flowrl's evaluation,
    without noise)."""
    import numpy as np
    from PIL import Image

    cls = MODEL_FAMILIES.get(family)
    prompts = {None: "a red cat", "edit": "edit_shapes/test", "start_frame": "motion_shapes/test"}[cls.conditioning]

    def flowrl_sample(folder, *extra, seed=0, prompts=prompts):
        argv = ["sample", str(run), "--prompts", prompts, "--n", "1", "--seed", str(seed), "--out", str(folder)]
        assert main([*argv, *extra]) == 0
        first = json.loads((folder / "sample.json").read_text())["files"][0]["file"]
        if cls.video:  # written as an .mp4 (lossy): only its size is compared
            return None
        return np.asarray(Image.open(folder / first), dtype=np.float32) / 255

    ours = flowrl_sample(tmp_path / "s")
    printed = capsys.readouterr().out
    record = json.loads((tmp_path / "s" / "sample.json").read_text())
    count = len(record["files"])
    assert f"{count} {'video' if cls.video else 'image'}{'s' if count > 1 else ''} of " in printed
    assert indented(record["diffusers"]) in printed  # printed as written
    if cls.conditioning:  # the prompt set's source image, written beside the samples, as the pipeline's image
        call = "\n".join(record["diffusers"]).split(" = pipe(")[-1]  # the pipeline's call, as laid out
        assert "image=load_image(" in call and str(tmp_path / "s" / "sources") in printed
        if "auto_resize" in _options(family):  # the source prepared as the run's options say (FLUX.1 Kontext)
            assert "_auto_resize=False," in call
    snippets = [(record["diffusers"], ours)]
    if not cls.pipeline_needs_sources:  # the run's first test prompt, "a red cat", without a source
        lines = json.loads((exported / "flowrl_export.json").read_text())["diffusers"]
        evaluated = ours  # flowrl's own sample of it (without noise: DDIM at eta 0)
        if cls.time_kind != "flow" or cls.conditioning:
            evaluated = flowrl_sample(tmp_path / "eval", "--noise-level", "0", prompts="a red cat")
        snippets.append((lines, evaluated))
    for lines, expected in snippets:
        _assert_ruff_formatted(lines)
        namespace = {}
        exec("\n".join(lines), namespace)  # noqa: S102 - the printed snippet, run as a user would
        if cls.video:
            frames = np.asarray(namespace["video"])
            assert frames.shape[:3] == (_options(family)["num_frames"], 64, 64), frames.shape
            continue
        theirs = np.asarray(namespace["image"].convert("RGB"), dtype=np.float32) / 255
        assert theirs.shape == expected.shape == (64, 64, 3)
        # the same image up to 8-bit rounding (measured: equal, or one pixel one level off; another seed: several
        # levels on average)
        difference = np.abs(theirs - expected)
        assert difference.max() <= 2 / 255 and difference.mean() <= 0.1 / 255, (lines, difference.max())
    if not cls.video and family in DEFAULT_TIER:  # the comparison tells images apart: another seed's image is far
        other = flowrl_sample(tmp_path / "seed1", seed=1)
        assert np.abs(other - ours).mean() > 4 / 255, np.abs(other - ours).mean()


def _assert_ruff_formatted(lines):
    """The lines as `ruff format` (the project's line length) would write them: pasted into a file it formats, they
    stay as printed."""
    source = "\n".join(lines) + "\n"
    command = [sys.executable, "-m", "ruff", "format", "--diff", "--line-length", str(LINE_LENGTH), "-"]
    done = subprocess.run(command, input=source, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_snippets_are_laid_out_as_ruff_formats_them():
    """`ruff_layout`: statements split at `;`, strings in double quotes (unless they hold one), a blank line after
    the imports, calls longer than a line split one argument a line (and an argument still too long the same
    way); comments and short lines as they are."""
    long = "/cache/" + "x" * 120
    lines = [
        "import torch",
        "from diffusers import WanPipeline",
        f"pipe = WanPipeline.from_pretrained('base', **FAMILY.pipeline_load_kwargs({long!r}))",
        "pipe.load_lora_weights('a'); pipe.load_lora_weights('a/low', load_into_transformer_2=True)",
        "video = pipe(prompt='it\\'s a \"cat\"', negative_prompt=\"it's\", num_frames=5, height=64, width=64, "
        "num_inference_steps=2, guidance_scale=1.0, generator=torch.Generator().manual_seed(0)).frames[0]",
        "# a comment: 'as it is'",
    ]
    laid_out = ruff_layout(lines)
    assert laid_out == [
        "import torch",
        "from diffusers import WanPipeline",
        "",
        "pipe = WanPipeline.from_pretrained(",
        '    "base",',
        "    **FAMILY.pipeline_load_kwargs(",
        f'        "{long}",',
        "    ),",
        ")",
        'pipe.load_lora_weights("a")',
        'pipe.load_lora_weights("a/low", load_into_transformer_2=True)',
        "video = pipe(",
        "    prompt='it\\'s a \"cat\"',",
        '    negative_prompt="it\'s",',
        "    num_frames=5,",
        "    height=64,",
        "    width=64,",
        "    num_inference_steps=2,",
        "    guidance_scale=1.0,",
        "    generator=torch.Generator().manual_seed(0),",
        ").frames[0]",
        "# a comment: 'as it is'",
    ]
    _assert_ruff_formatted(laid_out)
    printed = [
        "    import torch",
        "    from diffusers import WanPipeline",
        "",
        "    pipe = WanPipeline.from_pretrained(",
    ]
    assert indented(laid_out[:4]).splitlines() == printed


def test_full_fine_tunes_export_the_pipeline_folder(tmp_path, monkeypatch, capsys):
    from diffusers import StableDiffusion3Pipeline

    from flowrl.trainers import build_trainer, load_config

    run, _ = _train("sd3", False, tmp_path, monkeypatch)
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert "StableDiffusion3Pipeline.from_pretrained" in capsys.readouterr().out
    exported = _samples(
        DiffusionPolicy.from_pipeline(StableDiffusion3Pipeline.from_pretrained(out), options=_options("sd3")), "sd3"
    )
    trainer = build_trainer(load_config(run / "config.yaml", ["run.log_with=[]"]), output_dir=run)
    trainer.load_checkpoint(run / "checkpoints" / "epoch_1")
    with trainer.ema.swapped():
        torch.testing.assert_close(exported, _samples(trainer.policy, "sd3"), rtol=0, atol=2e-5)


def _loaded(trainer, run_dir):
    """A trainer's policy as `flowrl.run.inference.load_run` hands it to `write` (its raw weights)."""
    from flowrl.run.inference import LoadedRun

    return LoadedRun(
        run_dir,
        run_dir / "checkpoints" / f"epoch_{trainer.epoch}",
        trainer.config,
        trainer.epoch,
        trainer.modality,
        trainer.algorithm,
        ema=False,
    )


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
        assert (
            main(
                [
                    "sample",
                    str(target),
                    "--prompts",
                    "a red cat",
                    "--n",
                    "2",
                    "--num-steps",
                    "2",
                    "--out",
                    str(folder),
                    *extra,
                ]
            )
            == 0
        )
        return [(folder / name).read_bytes() for name in ("000-a-red-cat_0.png", "000-a-red-cat_1.png")]

    first = sample(out, "--seed", "5")
    printed = capsys.readouterr().out
    # a second call into the same folder writes beside the first, not over it
    assert (
        main(["sample", str(run), "--prompts", "a blue dog", "--n", "1", "--num-steps", "2", "--out", str(out)]) == 0
    )
    assert f"in {out}-2; grid: {out}-2/grid.png" in capsys.readouterr().out
    assert [f["prompt"] for f in json.loads((out.parent / "samples-2" / "sample.json").read_text())["files"]] == [
        "a blue dog"
    ]
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
    assert (
        main(
            [
                "sample",
                str(run),
                "--prompts",
                str(tmp_path / "prompts.txt"),
                "--n",
                "1",
                "--num-steps",
                "1",
                "--out",
                str(tmp_path / "file"),
            ]
        )
        == 0
    )
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
