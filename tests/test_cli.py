"""What a new user meets first: every `flowrl` failure is one line and a non-zero exit code; run folders keep
their checkpoints; the run folder shows the baseline, readable grids and integer epochs."""

import json
import os
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
    import flowrl.policies.build

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the prompts were checked")

    monkeypatch.setattr(flowrl.policies.build, "load_policy", no_model)
    monkeypatch.setattr(flowrl.image.modality, "build_image_policy", no_model)
    empty, latin, cats = tmp_path / "empty.txt", tmp_path / "latin1.txt", tmp_path / "cats.txt"
    empty.write_text("# nothing here\n")
    latin.write_bytes("a handwritten caf\xe9 seven\n".encode("latin-1"))
    cats.write_text("a handwritten seven\na cat\n")
    run = ["--output-dir", str(tmp_path / "run")]
    _fails(capsys, ["train", str(_yaml(tmp_path, **{"prompts.train": str(empty)})), *run], "holds no prompts")
    _fails(
        capsys,
        ["train", str(_yaml(tmp_path, **{"prompts.train": str(latin)})), *run],
        f"prompt file {latin} is not UTF-8 text",
    )
    _fails(
        capsys,
        ["train", str(_yaml(tmp_path, **{"prompts.train": str(cats)})), *run],
        "prompts.train does not suit reward 'digits_alignment': digits prompt 'a cat' names no digit",
    )


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
    # so do `flowrl eval` and `flowrl export` of the run (its latest checkpoint), naming their own option
    for command in (["eval", str(run)], ["export", str(run), "--out", str(tmp_path / "export")]):
        line = _fails(capsys, command, "model.safetensors is corrupt")
        assert f"(--checkpoint {run / 'checkpoints' / 'epoch_1'})" in line, line
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


def test_a_terminated_run_says_where_it_stopped_before_its_clean_up(tmp_path, capsys, monkeypatch):
    """SIGTERM (a launcher stopping the run) is answered at once: the stop line is out before the collector closes
    (stopping rollout workers waits for a rollout in flight, and the launcher's SIGKILL may come first), and a second
    SIGTERM lets the clean-up finish."""
    import signal

    from flowrl.trainers import Trainer

    real, seen = Trainer.train_epoch, {}

    def close():
        seen["before"] = capsys.readouterr().err
        os.kill(os.getpid(), signal.SIGTERM)  # handled on the next bytecode: it must not interrupt the clean-up
        seen["closed"] = True

    def terminated(self, epoch):
        if epoch == 1:
            self.collector.close = close
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, epoch)

    monkeypatch.setattr(Trainer, "train_epoch", terminated)
    run = tmp_path / "run"
    assert main(["train", str(_yaml(tmp_path)), "--output-dir", str(run)]) == 143
    after = capsys.readouterr().err
    assert seen["closed"] and "terminated at epoch 1 of 2" in seen["before"], seen
    assert f"flowrl train {run} --resume" in seen["before"] and "flowrl" not in after and "Traceback" not in after
    monkeypatch.undo()
    line = next(line for line in seen["before"].splitlines() if "terminated at" in line)
    assert main(_command(line)) == 0  # the command it printed goes on
    assert json.loads((run / "summary.json").read_text())["epochs"] == 2


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

    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    # the libraries' own warnings go to handlers that earlier tests' captured streams closed: silence them here
    for name in ("diffusers", "transformers", "huggingface_hub"):
        monkeypatch.setattr(logging.getLogger(name), "disabled", True)
    config = _yaml(tmp_path, **{"model.name": "someorg/some-model", "model.family": "sd3"})
    hint = "the model someorg/some-model: `hf download someorg/some-model --local-dir DIR`, then model.name: DIR"
    line = _fails(capsys, ["train", str(config), "--output-dir", str(tmp_path / "run")], hint)
    assert "HF_HUB_OFFLINE=1" in line and "{name}" not in line


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
    assert "eval/diversity" not in rows[0]  # within a prompt's samples: none with one sample per prompt (not NaN)
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


def test_resume_finds_the_run_where_set_puts_it(tmp_path, capsys):
    """`--set run.output_dir=X --resume` continues the run in X, not the one in the YAML's own run folder."""
    yaml_run, other = tmp_path / "yaml_run", tmp_path / "other"
    config = str(_yaml(tmp_path, **{"run.output_dir": str(yaml_run), "run.samples_every": 0}))
    assert main(["train", config, "--set", f"run.output_dir={other}"]) == 0
    assert main(["train", config, "--set", f"run.output_dir={other}", "--set", "run.epochs=3", "--resume"]) == 0
    assert (other / "checkpoints" / "epoch_3").is_dir() and not yaml_run.exists()


def _command(line: str) -> list[str]:
    """The argv of the `flowrl ...` command a message ends with (`... with: flowrl train ...)`)."""
    import shlex

    return shlex.split(line.rsplit("with: flowrl ", 1)[1].rstrip(")"))


def test_a_run_stopped_without_a_resumable_checkpoint_says_the_command_that_goes_on(tmp_path, capsys, monkeypatch):
    """Ctrl-C before the first checkpoint (the best one kept): the message, the refusals of a plain rerun and of
    --resume name the command that starts it again, which works; a run stopped by a dead reward server after a
    checkpoint names the resume command, which works."""
    from flowrl.rewards.serving.http import RewardServerUnavailable
    from flowrl.trainers import Trainer

    real, stop = Trainer.train_epoch, {}

    def stopping(self, epoch):
        if epoch in stop:
            raise stop[epoch]
        return real(self, epoch)

    monkeypatch.setattr(Trainer, "train_epoch", stopping)
    run = tmp_path / "run"
    changes = {"run.epochs": 3, "run.save_every": 2, "run.samples_every": 0, "eval.best_metric": "reward"}
    argv = ["train", str(_yaml(tmp_path, **changes)), "--output-dir", str(run)]
    stop[1] = KeyboardInterrupt()
    assert main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert "interrupted at epoch 1 of 3; no checkpoint was written yet" in err and "Traceback" not in err, err
    assert (run / "checkpoints" / "best").is_dir() and "--overwrite" in err
    restart = _command(err)
    assert restart[-1] == "--overwrite" and str(run) in restart
    assert "--overwrite" in _fails(capsys, argv, "stopped before its first checkpoint")
    line = _fails(capsys, [*argv, "--resume"], "holds no checkpoint to resume from")
    assert _command(line)[-1] == "--overwrite"
    stop.clear()
    stop[2] = RewardServerUnavailable("reward server at http://127.0.0.1:9/score is unreachable")
    line = _fails(capsys, restart, "is unreachable")
    assert line.endswith(f"(continue with: flowrl train {run} --resume)"), line
    stop.clear()
    assert main(_command(line)) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best", "epoch_2", "epoch_3"]


def test_start_up_sweeps_what_a_killed_checkpoint_write_or_prune_left(tmp_path, capsys, monkeypatch):
    """A `.tmp-epoch_N` of a killed write and an old checkpoint whose pruning was cut short (its manifest still
    there, files gone) are removed when the run starts again, before any checkpoint is written."""
    from flowrl.trainers import Trainer

    run = tmp_path / "run"
    config = str(_yaml(tmp_path, **{"run.samples_every": 0}))
    assert main(["train", config, "--output-dir", str(run)]) == 0
    checkpoints = run / "checkpoints"
    shutil.copytree(checkpoints / "epoch_2", checkpoints / ".tmp-epoch_3")
    shutil.copytree(checkpoints / "epoch_1", checkpoints / "epoch_0")  # beyond keep_checkpoints=2, half pruned
    next((checkpoints / "epoch_0").rglob("model.safetensors")).unlink()

    def interrupted(self, epoch):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "train_epoch", interrupted)
    assert main(["train", str(run), "--resume", "--set", "run.epochs=3"]) == 130
    assert "removed what an interrupted checkpoint write left" in capsys.readouterr().out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch_1", "epoch_2"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--set", "run.epochs=[1,"], "override 'run.epochs=[1,': the value '[1,' is not valid YAML"),
        ("latin1", "is not UTF-8 text"),
    ],
)
def test_bad_overrides_and_files_name_what_is_wrong(tmp_path, capsys, argv, match):
    if argv == "latin1":
        path = tmp_path / "latin1.yaml"
        path.write_bytes(_yaml(tmp_path).read_bytes() + "# caf\xe9\n".encode("latin-1"))
        line = _fails(capsys, ["train", str(path)], match)
        assert str(path) in line
    else:
        _fails(capsys, ["train", str(_yaml(tmp_path)), *argv], match)


def test_ctrl_c_while_the_libraries_load_is_one_line(monkeypatch, capsys):
    import flowrl.threads

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(flowrl.threads, "quiet_libraries", interrupted)
    assert main(["list", "objectives"]) == 130
    assert capsys.readouterr().err == "flowrl: interrupted\n"


def test_deepspeed_s_cpu_notice_is_not_printed():
    """Importing DeepSpeed on a machine without a GPU warns "Setting accelerator to CPU" (accelerate imports it to
    unwrap models); a `flowrl` command drops it."""
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    code = "from flowrl.threads import quiet_libraries; quiet_libraries(); import deepspeed; print('imported')"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]
    assert "Setting accelerator" not in done.stdout + done.stderr
