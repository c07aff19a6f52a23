"""Run a grid of configs x overrides x seeds and tabulate their summaries (`flowrl ablate`).

    flowrl ablate configs/digits/grpo_guard.yaml --grid steps.weighting=uniform,inv_dt,min_snr --seeds 0,1,2
    flowrl ablate configs/digits/*.yaml --seeds 0,1,2 --output-dir runs/digits-table

Every run gets its own folder `<output_dir>/<variant>/seed_<s>/` and its normal run artifacts; the results
(`results.json`, `results.md`) report each variant's start/end evaluation metrics as mean +- std over seeds,
its wall time, and the reward evaluations it used (samples scored by the training reward; evaluations excluded).
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


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """`["a.b=1,2", "c=x"]` -> `{"a.b": ["1", "2"], "c": ["x"]}`."""
    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"grid entry {item!r} must look like section.key=value1,value2")
        grid[key.strip()] = [v.strip() for v in values.split(",")]
    return grid


def variants(configs: list[str], grid: dict[str, list[str]]) -> list[tuple[str, str, list[str]]]:
    """`(name, config_path, overrides)` for every config x grid combination."""
    out = []
    keys = list(grid)
    for path in configs:
        stem = Path(path).stem
        for values in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
            overrides = [f"{k}={v}" for k, v in zip(keys, values)]
            name = stem + "".join(f"__{k.split('.')[-1]}={v}" for k, v in zip(keys, values))
            out.append((name, path, overrides))
    return out


def run(configs: list[str], *, grid: dict[str, list[str]] | None = None, seeds: list[int] = (0,),
        output_dir: str | Path = "runs/ablation", overrides: list[str] = (), log=print,
        skip_done: bool = False, threshold: tuple[str, float] | None = None) -> list[dict]:  # fmt: skip
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
            rows.append({
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
            })  # fmt: skip
            (output_dir / "results.json").write_text(json.dumps(rows, indent=1, allow_nan=True))
            gc.collect()
    (output_dir / "results.md").write_text(table(rows))
    return rows


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
