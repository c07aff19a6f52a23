"""Run a grid of configs x overrides x seeds and tabulate their summaries (`flowrl ablate`).

    flowrl ablate configs/digits/grpo_guard.yaml --grid steps.weighting=uniform,inv_dt,min_snr --seeds 0,1,2
    flowrl ablate configs/digits/*.yaml --seeds 0,1,2 --output-dir runs/digits-table

Every run gets its own folder `<output_dir>/<variant>/seed_<s>/` and its normal run artifacts; the results
(`results.json`, `results.md`, `results.csv`, and the plots in `plots/`, see `plot`) report each variant's
start/end evaluation metrics as mean +- std over seeds, its wall time, and the reward evaluations it used
(samples scored by the training reward; evaluations excluded).
With `skip_done` (`--skip-done`), a run whose folder already holds a `summary.json` and the same resolved
`config.yaml` is read back instead of trained again, so an interrupted sweep picks up where it stopped.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import statistics
from pathlib import Path

from flowrl.config import ConfigError, read_yaml, to_dict
from flowrl.trainers import load_config


STUDY_KEYS = {
    "configs": "run configs (paths relative to the working directory) or named cells {name, config, set}",
    "grid": "{key: [values]} swept in every combination",
    "seeds": "seeds of every cell",
    "set": "overrides of every run (KEY=VALUE)",
    "output_dir": "where the runs, results and plots go",
    "threshold": "METRIC=VALUE: reward evaluations and seconds until METRIC first reaches VALUE",
}
"""The keys of a study file's `ablate:` section."""


def is_study(path: str | Path) -> bool:
    """Whether a YAML file is a study file (its one top-level key is `ablate`) rather than a run config."""
    data = read_yaml(path)
    return isinstance(data, dict) and "ablate" in data


def load_study(path: str | Path) -> dict:
    """A study file (`ablate:` with `STUDY_KEYS`) as `run` arguments; unknown keys fail naming the valid ones."""
    from flowrl.registry import unknown_name_error

    data = read_yaml(path)
    if not isinstance(data, dict) or set(data) != {"ablate"} or not isinstance(data["ablate"], dict):
        raise ConfigError(f"{path}: a study file holds one `ablate:` section with {', '.join(STUDY_KEYS)}")
    study = data["ablate"]
    for key in study:
        if key not in STUDY_KEYS:
            raise unknown_name_error("study key", key, list(STUDY_KEYS), where=f"in {path}")
    if not study.get("configs"):
        raise ConfigError(f"{path}: ablate.configs names no run config")
    for cell in study["configs"]:
        if isinstance(cell, dict):
            for key in cell:
                if key not in CELL_KEYS:
                    raise unknown_name_error("cell key", key, list(CELL_KEYS), where=f"in {path}")
            if not cell.get("name") or not cell.get("config"):
                raise ConfigError(f"{path}: a named cell needs `name` and `config`, got {cell}")
    grid = {
        k: [str(v) for v in (values if isinstance(values, list) else [values])]
        for k, values in (study.get("grid") or {}).items()
    }
    cells = [_cell(c) if isinstance(c, dict) else str(c) for c in study["configs"]]
    out = {
        "configs": cells,
        "grid": grid,
        "seeds": [int(s) for s in study.get("seeds", [0])],
        "overrides": [str(o) for o in study.get("set", [])],
        "output_dir": str(study.get("output_dir", "runs/ablation")),
    }
    if study.get("threshold"):
        out["threshold"] = parse_threshold(str(study["threshold"]))
    return out


CELL_KEYS = {"name": "the cell's name (its folder)", "config": "the run config", "set": "its overrides (KEY=VALUE)"}
"""The keys of a named cell in a study's `configs`: one difference from a base config, e.g. for an ablation."""


def _cell(cell: dict) -> dict:
    return {"name": str(cell["name"]), "config": str(cell["config"]), "set": [str(o) for o in cell.get("set", [])]}


def parse_threshold(text: str) -> tuple[str, float]:
    """`"eval/digits_alignment=0.9"` -> `("eval/digits_alignment", 0.9)` (`eval/` added when missing)."""
    metric, sep, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = None
    if not sep or not metric.strip() or number is None:
        raise ConfigError(f"threshold {text!r} must look like METRIC=VALUE, e.g. eval/digits_alignment=0.9")
    metric = metric.strip()
    return (metric if metric.startswith("eval/") else f"eval/{metric}"), number


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """`["a.b=1,2", "c=x"]` -> `{"a.b": ["1", "2"], "c": ["x"]}`."""
    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"grid entry {item!r} must look like section.key=value1,value2")
        grid[key.strip()] = [v.strip() for v in values.split(",")]
    return grid


def variants(configs: list[str | dict], grid: dict[str, list[str]]) -> list[tuple[str, str, list[str]]]:
    """`(name, config_path, overrides)` for every config (a path, or a named cell `{name, config, set}`) x grid
    combination."""
    out = []
    keys = list(grid)
    for entry in configs:
        stem, path, base = (
            (entry["name"], entry["config"], entry["set"])
            if isinstance(entry, dict)
            else (Path(entry).stem, entry, [])
        )
        for values in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
            overrides = [*base, *(f"{k}={v}" for k, v in zip(keys, values))]
            name = stem + "".join(f"__{k.split('.')[-1]}={v}" for k, v in zip(keys, values))
            out.append((name, path, overrides))
    return out


def run(
    configs: list[str],
    *,
    grid: dict[str, list[str]] | None = None,
    seeds: list[int] = (0,),
    output_dir: str | Path = "runs/ablation",
    overrides: list[str] = (),
    log=print,
    skip_done: bool = False,
    threshold: tuple[str, float] | None = None,
) -> list[dict]:
    """Train every variant for every seed (sequentially, in this process) and return one row per run.

    `skip_done`: reuse a finished run (its folder has `summary.json` and an identical resolved config).
    `threshold` (`(metric, value)`, e.g. `("eval/digits_alignment", 0.9)`): each row also gets `to_threshold`,
    the first evaluation at or above it (`first_reaching`).
    """
    from flowrl.trainers import build_trainer

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    plan = variants(list(configs), grid or {})
    for _, path, extra in plan:  # fail on a bad key before spending hours on the first runs
        load_config(read_yaml(path), [*overrides, *extra])
    rows = []
    for name, path, extra in plan:
        for seed in seeds:
            folder = output_dir / name / f"seed_{seed}"
            settings = [*overrides, *extra, f"run.seed={seed}", f"run.output_dir={folder}", "run.log_with=[]"]
            config = load_config(path, settings)
            summary = _finished(folder, config) if skip_done else None
            if log:
                log(f"[ablate] {name} seed {seed} -> {folder}" + (" (finished before: reused)" if summary else ""))
            if summary is None:
                summary = build_trainer(config).train(overwrite=True)  # the sweep owns its run folders
            rows.append(
                {
                    "variant": name,
                    "config": str(path),
                    "overrides": extra,
                    "seed": seed,
                    "trainer": config.trainer,
                    "wall_s": summary["wall_s"],
                    "reward_evaluations": summary["samples_scored"],
                    "eval_start": summary["eval_start"],
                    "eval_end": summary["eval_end"],
                    "gold_metric": summary["gold_metric"],
                    "folder": str(folder),
                    **({"to_threshold": first_reaching(folder, *threshold)} if threshold else {}),
                }
            )
            (output_dir / "results.json").write_text(json.dumps(rows, indent=1, allow_nan=True))
            gc.collect()
    (output_dir / "results.md").write_text(table(rows))
    write_csv(rows, output_dir / "results.csv")
    plot(rows, output_dir / "plots")
    return rows


def write_csv(rows: list[dict], path: str | Path) -> Path:
    """One line per run: variant, seed, trainer, overrides, wall seconds, reward evaluations, every start/end
    evaluation metric (`start:eval/...`, `end:eval/...`) and, with a threshold, when it was first reached."""
    import csv

    metrics = []
    for row in rows:
        metrics.extend(k for k in {**row["eval_start"], **row["eval_end"]} if k not in metrics)
    threshold = any("to_threshold" in r for r in rows)
    reach = ["reached_epoch", "reached_reward_evals", "reached_wall_s"] if threshold else []
    header = [
        "variant",
        "seed",
        "trainer",
        "overrides",
        "wall_s",
        "reward_evaluations",
        *(f"start:{m}" for m in metrics),
        *(f"end:{m}" for m in metrics),
        *reach,
    ]
    with Path(path).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for row in rows:
            hit = row.get("to_threshold") or {}
            writer.writerow(
                [
                    row["variant"],
                    row["seed"],
                    row["trainer"],
                    " ".join(row["overrides"]),
                    row["wall_s"],
                    row["reward_evaluations"],
                    *(row["eval_start"].get(m, "") for m in metrics),
                    *(row["eval_end"].get(m, "") for m in metrics),
                    *([hit.get("epoch", ""), hit.get("reward_evals", ""), hit.get("wall_s", "")] if reach else []),
                ]
            )
    return Path(path)


STEP_DIAGNOSTICS = ("ratio_mean", "ratio_std", "clipfrac", "grad_norm")
"""The per-denoising-step rows each cell's diagnostic plot shows (`<name>/step_<t>` in `metrics.jsonl`)."""


def plot(rows: list[dict], out_dir: str | Path, metrics: list[str] | None = None) -> list[Path]:
    """PNG plots of a sweep, one line per grid cell with a band from the lowest to the highest seed:

    - `curves_by_epoch.png`, `curves_by_reward_evals.png`: the proxy (`eval/reward`) and every gold metric
      against epochs and against the training reward's evaluations;
    - `steps_<variant>.png`: ratio mean and std, clip fraction and gradient norm per denoising step, averaged
      over the run's epochs (the band: over seeds).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[list[dict]]] = {}
    for row in rows:
        lines = (Path(row["folder"]) / "metrics.jsonl").read_text().splitlines()
        runs.setdefault(row["variant"], []).append([json.loads(line) for line in lines if line.strip()])
    if metrics is None:
        metrics = ["eval/reward"] + [
            m
            for m in rows[0]["eval_end"]
            if m not in ("eval/reward",) and m.removeprefix("eval/") in _gold_names(rows)
        ]
    paths = []
    for axis, label in (("epoch", "epoch"), ("reward_evals", "reward evaluations")):
        fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), squeeze=False)
        for ax, metric in zip(axes[0], metrics):
            for variant, seeds in runs.items():
                x, mean, low, high = _band(seeds, metric, axis)
                if x:
                    (line,) = ax.plot(x, mean, label=variant)
                    ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
            ax.set_title(metric.removeprefix("eval/"), fontsize=9)
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"curves_by_{'epoch' if axis == 'epoch' else 'reward_evals'}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    for variant, seeds in runs.items():
        fig, axes = plt.subplots(1, len(STEP_DIAGNOSTICS), figsize=(3.6 * len(STEP_DIAGNOSTICS), 3.2), squeeze=False)
        drawn = False
        for ax, name in zip(axes[0], STEP_DIAGNOSTICS):
            per_seed = [_per_step_mean(history, name) for history in seeds]
            steps = sorted(set().union(*per_seed))
            if steps:
                values = [[s[t] for s in per_seed if t in s] for t in steps]
                ax.plot(steps, [statistics.mean(v) for v in values], marker="o")
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2, linewidth=0)
                drawn = True
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("denoising step")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{variant}: per-step diagnostics (mean over epochs; band: seeds)", fontsize=9)
        fig.tight_layout()
        if drawn:
            path = out_dir / f"steps_{variant}.png"
            fig.savefig(path, dpi=100)
            paths.append(path)
        plt.close(fig)
    return paths


def _gold_names(rows: list[dict]) -> set[str]:
    """Every evaluation metric of the sweep's runs that is not a training reward: their `eval.metrics`."""
    names = set()
    for row in rows:
        saved = Path(row["folder"]) / "config.yaml"
        if saved.is_file():
            names.update(load_config(saved).eval.metrics)
    return names


def _band(seeds: list[list[dict]], metric: str, axis: str):
    """`(x, mean, low, high)` of `metric` over the seeds' evaluations, at the x values every seed has."""
    curves = []
    for history in seeds:
        curve = {}
        for row in history:
            if isinstance(row.get(metric), (int, float)) and math.isfinite(row[metric]):
                curve[row["epoch"] if axis == "epoch" else (row.get("reward_evals", 0) if row["epoch"] else 0)] = row[
                    metric
                ]
        curves.append(curve)
    x = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    values = [[c[v] for c in curves] for v in x]
    return x, [statistics.mean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def _per_step_mean(history: list[dict], name: str) -> dict[int, float]:
    """`{step: mean over the epochs}` of the `<name>/step_<t>` rows of one run."""
    sums: dict[int, list[float]] = {}
    prefix = f"{name}/step_"
    for row in history:
        for key, value in row.items():
            if key.startswith(prefix) and isinstance(value, (int, float)) and math.isfinite(value):
                sums.setdefault(int(key[len(prefix) :]), []).append(value)
    return {t: statistics.mean(v) for t, v in sums.items()}


def first_reaching(folder: str | Path, metric: str, value: float) -> dict | None:
    """The first evaluation of the run in `folder` with `metric >= value`: `{"epoch", "reward_evals", "wall_s",
    "resolution"}` (the training reward's evaluations and the run's seconds up to that epoch, evaluations
    included; the reward evaluations since the evaluation before, which did not reach it), or None if it never
    does."""
    before = 0
    for line in (Path(folder) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        score = row.get(metric)
        if not isinstance(score, (int, float)):
            continue
        evals = row.get("reward_evals", 0) if row["epoch"] else 0
        if score >= value:
            wall = row.get("wall_s", 0.0) if row["epoch"] else 0.0
            return {"epoch": row["epoch"], "reward_evals": evals, "wall_s": wall, "resolution": evals - before}
        before = evals
    return None


def _finished(folder: Path, config) -> dict | None:
    """The summary of a run that already finished in `folder` with exactly this config, else None."""
    summary, saved = folder / "summary.json", folder / "config.yaml"
    if not (summary.is_file() and saved.is_file()):
        return None
    try:
        same = to_dict(load_config(saved)) == to_dict(config)  # keys added since then take their defaults
        return json.loads(summary.read_text()) if same else None
    except (OSError, ValueError, ConfigError):  # a half-written or outdated folder: train it again
        return None


def _stat(values: list[float]) -> str:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def table(rows: list[dict], metrics: list[str] | None = None) -> str:
    """A Markdown table: one line per variant, metrics as mean +- std over seeds."""
    by_variant: dict[str, list[dict]] = {}
    for row in rows:
        by_variant.setdefault(row["variant"], []).append(row)
    if metrics is None:
        metrics = []
        for row in rows:
            metrics.extend(k for k in row["eval_end"] if k not in metrics)
    header = ["variant", "seeds"] + [f"{m.removeprefix('eval/')} start -> end" for m in metrics]
    threshold = any("to_threshold" in r for r in rows)
    header += ["wall s", "reward evals"]
    if threshold:
        header += ["reached", "reward evals to it", "wall s to it", "resolution (evals)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, group in by_variant.items():
        cells = [name, str(len(group))]
        for m in metrics:
            start = _stat([r["eval_start"].get(m) for r in group])
            end = _stat([r["eval_end"].get(m) for r in group])
            cells.append(f"{start} -> {end}")
        cells.append(_stat([r["wall_s"] for r in group]))
        cells.append(str(group[0]["reward_evaluations"]))
        if threshold:
            hits = [r["to_threshold"] for r in group if r.get("to_threshold")]
            cells.append(f"{len(hits)}/{len(group)}")
            cells.append(_stat([h["reward_evals"] for h in hits]))
            cells.append(_stat([h["wall_s"] for h in hits]))
            cells.append(_stat([h["resolution"] for h in hits]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
