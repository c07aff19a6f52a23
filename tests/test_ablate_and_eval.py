"""`flowrl ablate` and `flowrl eval` end to end on a 2-step digits base model (built once, in the session's cache)."""

import csv
import json
from pathlib import Path

import pytest
import yaml

from flowrl import ablate
from flowrl.cli import main

from .conftest import TINY_DIGITS_RUN


TINY = {
    **TINY_DIGITS_RUN,
    "run": {"epochs": 1, "save_every": 1, "samples_every": 0, "log_with": []},
    "objective": {"clip_eps_low": 1e-3},
}


@pytest.fixture
def tiny_yaml(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def test_grid_parsing_and_variants():
    grid = ablate.parse_grid(["steps.weighting=uniform,inv_dt", "optim.lr=1e-4"])
    assert grid == {"steps.weighting": ["uniform", "inv_dt"], "optim.lr": ["1e-4"]}
    names = [name for name, _, _ in ablate.variants(["a/x.yaml"], grid)]
    assert names == ["x__weighting=uniform__lr=1e-4", "x__weighting=inv_dt__lr=1e-4"]
    with pytest.raises(ValueError, match="must look like"):
        ablate.parse_grid(["novalues="])


@pytest.mark.long
def test_ablate_runs_every_variant_and_seed_and_tabulates(tiny_yaml, tmp_path, monkeypatch):
    out = tmp_path / "ablation"
    rows = ablate.run(
        [str(tiny_yaml)], grid={"steps.weighting": ["uniform", "inv_dt"]}, seeds=[0, 1], output_dir=out, log=None
    )
    assert [(r["variant"], r["seed"]) for r in rows] == [
        ("tiny__weighting=uniform", 0),
        ("tiny__weighting=uniform", 1),
        ("tiny__weighting=inv_dt", 0),
        ("tiny__weighting=inv_dt", 1),
    ]
    assert all(r["reward_evaluations"] == 8 for r in rows)
    results = json.loads((out / "results.json").read_text())
    summary = json.loads((out / "tiny__weighting=uniform" / "seed_0" / "summary.json").read_text())
    # each row holds its run's own summary (json: the tiny run's diversity is NaN)
    assert (
        json.dumps(results[0]["eval_end"]) == json.dumps(summary["eval_end"])
        and "eval/digits_gold" in summary["eval_end"]
    )
    table = (out / "results.md").read_text()
    assert "| tiny__weighting=inv_dt | 2 |" in table and "±" in table
    assert (out / "tiny__weighting=uniform" / "seed_1" / "summary.json").is_file()
    # one CSV line per run with its start and end metrics; the plots: curves by epoch and reward evaluations
    with (out / "results.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert [(r["variant"], r["seed"]) for r in lines] == [(r["variant"], str(r["seed"])) for r in rows]
    assert float(lines[3]["end:eval/digits_gold"]) == pytest.approx(rows[3]["eval_end"]["eval/digits_gold"])
    assert lines[0]["reward_evaluations"] == "8" and lines[2]["overrides"] == "steps.weighting=inv_dt"
    plots = {p.name for p in (out / "plots").iterdir()}
    assert {"curves_by_epoch.png", "curves_by_reward_evals.png"} <= plots
    assert all((out / "plots" / name).stat().st_size > 1000 for name in plots)

    # an interrupted sweep picks up where it stopped: finished runs with the same config are read back,
    # a run whose config changed (here: one more epoch) trains again
    def boom(config):
        raise AssertionError(f"retrained {config.run.output_dir}")

    monkeypatch.setattr("flowrl.trainers.build_trainer", boom)
    again = ablate.run(
        [str(tiny_yaml)],
        grid={"steps.weighting": ["uniform", "inv_dt"]},
        seeds=[0, 1],
        output_dir=out,
        log=None,
        skip_done=True,
    )
    assert json.dumps(again) == json.dumps(rows)  # (json: the tiny run's diversity is NaN)
    with pytest.raises(AssertionError, match="retrained"):
        ablate.run(
            [str(tiny_yaml)],
            grid={"steps.weighting": ["uniform"]},
            seeds=[0],
            output_dir=out,
            log=None,
            skip_done=True,
            overrides=["run.epochs=2"],
        )


def test_ablate_fails_early_on_bad_keys(tiny_yaml, tmp_path, capsys):
    assert main(["ablate", str(tiny_yaml), "--grid", "steps.weighing=uniform", "--output-dir", str(tmp_path)]) == 2
    assert "unknown config key 'steps.weighing'" in capsys.readouterr().err


def test_eval_of_a_run_and_of_a_base_model(tiny_yaml, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", str(tiny_yaml), "--output-dir", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--out", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["epoch"] == 1 and "checkpoints/epoch_1" in result["evaluated"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert result["eval/digits_gold"] == pytest.approx(summary["eval_end"]["eval/digits_gold"])  # same noise
    capsys.readouterr()
    assert main(["eval", str(tiny_yaml)]) == 0  # the untrained base model: the run's starting point
    out = capsys.readouterr().out
    base = json.loads(out[out.index("{") :])
    assert base["evaluated"] == "base model" and base["epoch"] == 0
    assert base["eval/digits_gold"] == pytest.approx(summary["eval_start"]["eval/digits_gold"])
    assert main(["eval", str(tmp_path / "nope")]) == 2


def test_first_reaching_reads_the_eval_curve_and_its_resolution(tmp_path):
    rows = [
        {"epoch": 0, "eval/a": 0.5},
        {"epoch": 1, "reward_evals": 64, "wall_s": 3.0, "reward/mean": 0.7},
        {"epoch": 2, "reward_evals": 128, "wall_s": 6.0, "eval/a": 0.85},
        {"epoch": 3, "reward_evals": 192, "wall_s": 9.0},
        {"epoch": 4, "reward_evals": 256, "wall_s": 12.5, "eval/a": 0.93},
        {"epoch": 5, "reward_evals": 320, "wall_s": 15.0, "eval/a": 0.97},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    hit = ablate.first_reaching(tmp_path, "eval/a", 0.9)
    assert hit == {"epoch": 4, "reward_evals": 256, "wall_s": 12.5, "resolution": 128}
    assert ablate.first_reaching(tmp_path, "eval/a", 0.99) is None
    assert ablate.first_reaching(tmp_path, "eval/a", 0.5) == {
        "epoch": 0,
        "reward_evals": 0,
        "wall_s": 0.0,
        "resolution": 0,
    }
    table = ablate.table(
        [
            {
                "variant": "v",
                "seed": 0,
                "eval_start": {"eval/a": 0.5},
                "eval_end": {"eval/a": 0.97},
                "wall_s": 15.0,
                "reward_evaluations": 320,
                "to_threshold": hit,
            },
            {
                "variant": "v",
                "seed": 1,
                "eval_start": {"eval/a": 0.5},
                "eval_end": {"eval/a": 0.8},
                "wall_s": 15.0,
                "reward_evaluations": 320,
                "to_threshold": None,
            },
        ]
    )
    assert "| 1/2 | 256.000 | 12.500 | 128.000 |" in table


def test_a_study_file_runs_its_grid_and_draws_per_step_diagnostics(tiny_yaml, tmp_path, capsys):
    study = tmp_path / "study.yaml"
    study.write_text(
        yaml.safe_dump(
            {
                "ablate": {
                    "configs": [str(tiny_yaml)],
                    "grid": {"steps.weighting": ["early", "late"]},
                    "seeds": [0],
                    "set": ["optim.step_grad_norms_every=1", "steps.normalize_weights=true"],
                    "output_dir": str(tmp_path / "s"),
                    "threshold": "digits_gold=0.0",
                }
            }
        )
    )
    assert main(["ablate", str(study)]) == 0
    out = tmp_path / "s"
    rows = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in rows] == ["tiny__weighting=early", "tiny__weighting=late"]
    assert all(r["to_threshold"]["epoch"] == 0 for r in rows)  # gold >= 0 from the start
    lines = (Path(rows[0]["folder"]) / "metrics.jsonl").read_text().splitlines()
    history = [json.loads(line) for line in lines]
    assert any(k.startswith("grad_norm/step_") for k in history[-1])
    assert (out / "plots" / "steps_tiny__weighting=early.png").is_file()
    assert "reached" in (out / "results.md").read_text()
    study.write_text(yaml.safe_dump({"ablate": {"configs": [str(tiny_yaml)], "seed": [0]}}))
    assert main(["ablate", str(study)]) == 2
    err = capsys.readouterr().err
    assert "unknown study key 'seed'" in err and "Did you mean 'seeds'" in err
    with pytest.raises(ValueError, match="METRIC=VALUE"):
        ablate.parse_threshold("digits_gold")


def test_named_cells_each_carry_their_own_difference(tmp_path):
    study = tmp_path / "study.yaml"
    study.write_text(
        yaml.safe_dump(
            {
                "ablate": {
                    "configs": [
                        "configs/digits/flow_grpo.yaml",
                        {
                            "name": "guard_global_std",
                            "config": "configs/digits/grpo_guard.yaml",
                            "set": ["advantage.std=global"],
                        },
                    ],
                    "grid": {"optim.lr": ["1e-4"]},
                }
            }
        )
    )
    loaded = ablate.load_study(study)
    plan = ablate.variants(loaded["configs"], loaded["grid"])
    assert plan == [
        ("flow_grpo__lr=1e-4", "configs/digits/flow_grpo.yaml", ["optim.lr=1e-4"]),
        ("guard_global_std__lr=1e-4", "configs/digits/grpo_guard.yaml", ["advantage.std=global", "optim.lr=1e-4"]),
    ]
    study.write_text(yaml.safe_dump({"ablate": {"configs": [{"name": "x", "config": "c.yaml", "sets": []}]}}))
    with pytest.raises(Exception, match="unknown cell key 'sets'"):
        ablate.load_study(study)
    study.write_text(yaml.safe_dump({"ablate": {"configs": [{"name": "x"}]}}))
    with pytest.raises(Exception, match="a named cell needs `name` and `config`"):
        ablate.load_study(study)
