"""What a new user meets first: every `flowrl` failure is one line and a non-zero exit code; run folders keep
their checkpoints; the run folder shows the baseline, readable grids and integer epochs."""

import json
import shutil

import pytest
import yaml

from flowrl.cli import main

from .conftest import TINY_DIGITS_RUN


TINY = {**TINY_DIGITS_RUN, "run": {"epochs": 2, "save_every": 1, "samples_every": 1, "log_with": []}}


def _yaml(tmp_path, **changes):
    data = json.loads(json.dumps(TINY))
    for key, value in changes.items():
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path = tmp_path / f"tiny-{len(list(tmp_path.glob('tiny-*.yaml')))}.yaml"  # one file per call
    path.write_text(yaml.safe_dump(data))
    return path


def _fails(capsys, argv, match):
    """The command exits with 2 and one line on stderr that contains `match`; no traceback."""
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err and "Traceback" not in "\n".join(err) and match in err[-1], err
    return err[-1]


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"rewards": [{"name": "nope"}]}, "unknown reward 'nope'"),
        ({"eval.metrics": ["digits_gol"]}, "unknown reward 'digits_gol'"),
        ({"prompts.train": "/nonexistent/prompts.txt"}, "unknown prompt set '/nonexistent/prompts.txt'"),
        ({"optim.lr": -1.0}, "optim.lr must be > 0"),
        ({"prompts.group_size": 1}, "group-relative advantages need prompts.group_size >= 2"),
        ({"run.log_with": ["wandb"]}, "run.log_with lists wandb, which is not installed"),
    ],
)
def test_config_and_data_mistakes_are_one_line(tmp_path, capsys, changes, match):
    _fails(capsys, ["train", str(_yaml(tmp_path, **changes)), "--output-dir", str(tmp_path / "run")], match)


def test_prompt_file_mistakes_name_the_file_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import flowrl.image.modality
    import flowrl.models.build

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the prompts were checked")

    monkeypatch.setattr(flowrl.models.build, "load_policy", no_model)
    monkeypatch.setattr(flowrl.image.modality, "build_image_policy", no_model)
    empty, latin, cats = tmp_path / "empty.txt", tmp_path / "latin1.txt", tmp_path / "cats.txt"
    empty.write_text("# nothing here\n")
    latin.write_bytes("a handwritten caf\xe9 seven\n".encode("latin-1"))
    cats.write_text("a handwritten seven\na cat\n")
    run = ["--output-dir", str(tmp_path / "run")]
    _fails(capsys, ["train", str(_yaml(tmp_path, **{"prompts.train": str(empty)})), *run], "holds no prompts")
    _fails(capsys, ["train", str(_yaml(tmp_path, **{"prompts.train": str(latin)})), *run],
           f"prompt file {latin} is not UTF-8 text")  # fmt: skip
    _fails(capsys, ["train", str(_yaml(tmp_path, **{"prompts.train": str(cats)})), *run],
           "prompts.train does not suit reward 'digits_alignment': digits prompt 'a cat' names no digit")  # fmt: skip


def test_run_folders_keep_their_checkpoints(tmp_path, capsys):
    config, run = str(_yaml(tmp_path)), tmp_path / "run"
    _fails(capsys, ["train", config, "--output-dir", str(run), "--resume"], "holds no run to resume")
    assert main(["train", config, "--output-dir", str(run)]) == 0
    first = (run / "checkpoints" / "epoch_2" / "manifest.json").read_text()
    # a second run into the same folder is refused: nothing of the first is lost
    _fails(capsys, ["train", config, "--output-dir", str(run)], "already holds a run")
    assert (run / "checkpoints" / "epoch_2" / "manifest.json").read_text() == first
    # resuming from an earlier checkpoint would fork the run: refused unless --overwrite (a resume takes the run's
    # own saved config; --set changes it, said on the console)
    resume = ["train", config, "--output-dir", str(run), "--set", "run.epochs=3"]
    _fails(capsys, [*resume, "--resume", str(run / "checkpoints" / "epoch_1")], "would fork it")
    # a corrupt latest checkpoint: the message offers the previous verified one, and following it works (the
    # corrupt checkpoint is no later state of the run to fork from)
    weights = next((run / "checkpoints" / "epoch_2").rglob("model.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    line = _fails(capsys, [*resume, "--resume"], "model.safetensors is corrupt")
    assert f"(--resume {run / 'checkpoints' / 'epoch_1'})" in line
    assert main([*resume, "--resume", str(run / "checkpoints" / "epoch_1")]) == 0
    assert "resuming with overrides: run.epochs: 2 -> 3" in capsys.readouterr().out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch_2", "epoch_3"]
    # --overwrite starts afresh: the old run's later checkpoints cannot outlive it
    assert main(["train", config, "--output-dir", str(run), "--overwrite"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch_1", "epoch_2"]


def test_interrupted_training_says_where_it_stopped(tmp_path, capsys, monkeypatch):
    from flowrl.trainers import Trainer

    real = Trainer.train_epoch

    def interrupted(self, epoch):
        if epoch == 1:
            raise KeyboardInterrupt
        return real(self, epoch)

    monkeypatch.setattr(Trainer, "train_epoch", interrupted)
    run = tmp_path / "run"
    assert main(["train", str(_yaml(tmp_path)), "--output-dir", str(run)]) == 130
    err = capsys.readouterr().err
    assert "interrupted at epoch 1 of 2" in err and "epoch_1" in err and "--resume" in err and "Traceback" not in err


def test_a_full_disk_keeps_earlier_checkpoints(tmp_path, capsys, monkeypatch):
    from accelerate import Accelerator

    real = Accelerator.save_state

    def full(self, output_dir=None, **kwargs):
        if "epoch_2" in str(output_dir):  # torch's zip writer on a full disk
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 8512 vs 8404")
        return real(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", full)
    run = tmp_path / "run"
    _fails(
        capsys, ["train", str(_yaml(tmp_path)), "--output-dir", str(run)], f"no space left on {run / 'checkpoints'}"
    )
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["epoch_1"]  # no .tmp-epoch_2 left behind


def test_an_unreachable_hub_model_is_one_line(capsys, monkeypatch, tmp_path):
    import logging

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the libraries' own warnings go to handlers that earlier tests' captured streams closed: silence them here
    for name in ("diffusers", "transformers", "huggingface_hub"):
        monkeypatch.setattr(logging.getLogger(name), "disabled", True)
    config = _yaml(tmp_path, **{"model.name": "someorg/some-model", "model.family": "sd3"})
    line = _fails(capsys, ["train", str(config), "--output-dir", str(tmp_path / "run")],
                  "could not load 'someorg/some-model'")  # fmt: skip
    assert "hf download someorg/some-model --local-dir DIR" in line and "{name}" not in line


def test_version_and_debug(capsys, tmp_path):
    from flowrl import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"flowrl {__version__}"
    with pytest.raises(FileNotFoundError):  # --debug: the real exception, with its traceback
        main(["--debug", "eval", str(tmp_path / "nope.yaml")])


def test_the_run_folder_shows_the_baseline_and_integer_epochs(tmp_path):
    run = tmp_path / "run"
    assert main(["train", str(_yaml(tmp_path, **{"run.log_with": ["tensorboard"]})), "--output-dir", str(run)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2] and all(isinstance(r["epoch"], int) for r in rows)
    assert "eval/digits_gold" in rows[0] and "reward/mean" not in rows[0]  # the epoch-0 baseline
    events = list(run.rglob("events.out.tfevents.*"))
    assert len(events) == 1, events  # one run in TensorBoard, the config as text inside it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent), size_guidance={"images": 0})
    acc.Reload()
    assert 0 in [e.step for e in acc.Scalars("eval/digits_gold")]
    image = acc.Images("samples")[0]
    assert min(image.width, image.height) >= 128  # 8x8 digits upscaled, not 8 px strips
    assert "config/text_summary" in acc.Tags()["tensors"]
    shutil.rmtree(run)
