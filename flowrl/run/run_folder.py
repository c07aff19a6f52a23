"""A run's folder and what the run driver watches across epochs: the folder's checks, the best evaluation, the
over-optimisation brake and the summary.

A folder that holds another run is refused unless resuming or overwriting it; a resume from an older checkpoint of
the run (which would fork it) needs `--overwrite`. `Watch` keeps `checkpoints/best` by `eval.best_metric`, measures
the proxy-gold divergence (`overopt/*`) and stops the run when the watched metric falls `eval.stop_on_drop` below its
best.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flowrl import checkpoint
from flowrl.tracking import scalar


RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "summary.json", "images", "samples", "plots", "flowrl", "config.yaml")
"""What a run writes into its folder (`--overwrite` deletes exactly these)."""


class RunFolderError(ValueError):
    """A run folder that holds another run (or a later part of this one); the message says what to pass."""


def epoch_of(path: Path) -> int:
    """N of a `checkpoints/epoch_N` folder (-1 for any other name)."""
    digits = Path(path).name.removeprefix("epoch_")
    return int(digits) if digits.isdigit() else -1


def holds_run(out: Path) -> bool:
    """Whether `out` holds a run's checkpoints or metrics."""
    return bool(checkpoint.list_checkpoints(out)) or (out / "metrics.jsonl").exists()


def check_folder(out: Path, resume, overwrite: bool) -> None:
    """Refuse, before anything is written or loaded, a folder that holds another run (unless `resume` or `overwrite`)
    and a resume from an older checkpoint of it that later ones follow (unless `overwrite`); check it is writable."""
    if holds_run(out) and not resume and not overwrite:
        if not checkpoint.list_checkpoints(out):  # stopped before its first checkpoint: nothing to resume from
            raise RunFolderError(
                f"run folder {out} already holds a run that stopped before its first checkpoint "
                "(nothing to resume from): pass --overwrite to start it again, or another "
                "--output-dir"
            )
        raise RunFolderError(
            f"run folder {out} already holds a run (checkpoints or metrics.jsonl): pass --resume "
            "to continue it, --overwrite to replace it, or another --output-dir"
        )
    if resume is True and holds_run(out) and not checkpoint.list_checkpoints(out):
        raise RunFolderError(
            f"run folder {out} holds no checkpoint to resume from (the run stopped before its first "
            "one; run.save_every sets how often they are written): start it again with --overwrite "
            "instead of --resume"
        )
    if resume and resume is not True and Path(resume).resolve().parent == (out / "checkpoints").resolve():
        # only sound later checkpoints are a later state of the run (a corrupt one is garbage to replace)
        newer = [
            p.name for p in checkpoint.list_checkpoints(out) if epoch_of(p) > epoch_of(Path(resume)) and _sound(p)
        ]
        if newer and not overwrite:
            raise RunFolderError(
                f"the run went on past {Path(resume).name} ({', '.join(newer)}): resuming there "
                "would fork it; pass --overwrite to delete the later checkpoints"
            )
    writable(out)


def _sound(path: Path) -> bool:
    try:
        checkpoint.verify(path)
    except checkpoint.CheckpointError:
        return False
    return True


def writable(out: Path) -> None:
    """Fail with one line when `out` cannot be created or written (a read-only disk, a file in the way)."""
    import os

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderError(f"cannot create the run folder {out}: {err.strerror or err}") from None
    if not os.access(out, os.W_OK):
        raise RunFolderError(f"the run folder {out} is not writable (read-only?): pass another --output-dir")


def prepare_folder(out: Path, resume, overwrite: bool) -> None:
    """Clear what a resume from an older checkpoint abandons (later checkpoints, their best) or what `overwrite`
    replaces (main process only)."""
    if resume and resume is not True and Path(resume).resolve().parent == (out / "checkpoints").resolve():
        newer = [p for p in checkpoint.list_checkpoints(out) if epoch_of(p) > epoch_of(Path(resume))]
        for path in newer:
            shutil.rmtree(path)
        best = out / "checkpoints" / "best" / "trainer_state.json"
        if newer and best.is_file():
            kept = (json.loads(best.read_text()).get("best") or {}).get("epoch", 0)
            if kept > epoch_of(Path(resume)):
                shutil.rmtree(best.parent)  # the best of the abandoned continuation
    if overwrite and not resume:
        for name in RUN_ARTIFACTS:
            path = out / name
            if path.exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()


def sweep(out: Path, keep: int | None) -> list[str]:
    """Remove what a process killed while saving or pruning checkpoints left in `out/checkpoints` (main process,
    at start-up); returns the names removed or restored.

    - `.tmp-NAME`: a checkpoint being written (complete or not, it never became the run's);
    - `.old-NAME`: the previous `best` set aside while the new one was renamed in: put back if no `best` is there,
      else removed;
    - an `epoch_N` beyond the `keep` newest that is incomplete (a file of its manifest missing or of another size,
      or no manifest): one whose pruning was cut short (a complete one is left to the next save's pruning).
    """
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    swept = []
    for path in sorted(root.iterdir()):
        if path.name.startswith(".tmp-") and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path.name)
        elif path.name.startswith(".old-") and path.is_dir():
            target = root / path.name.removeprefix(".old-")
            if target.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.rename(target)
            swept.append(path.name)
    found = checkpoint.list_checkpoints(out)
    for path in found[:-keep] if keep else []:
        if not _complete(path):
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path.name)
    return swept


def _complete(path: Path) -> bool:
    """Whether every file the checkpoint's manifest lists is there at its size (no hashing: that is `verify`)."""
    try:
        entries = json.loads((path / checkpoint.MANIFEST).read_text())["files"]
        return all((path / name).stat().st_size == info["bytes"] for name, info in entries.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def abandon(out: Path) -> None:
    """Remove what a run that failed before its first epoch wrote (it leaves no run behind)."""
    for name in RUN_ARTIFACTS:
        path = out / name
        if path.exists():
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    try:
        out.rmdir()  # only when nothing else is in it
    except OSError:
        pass


class Watch:
    """The evaluations of a run: the best one by `eval.best_metric`, the proxy-gold divergence and the early stop.

    Args:
        eval_config: the `eval` section.
        state (`RunState`): where the history, the best and the stop are kept (checkpointed with the run).
    """

    def __init__(self, eval_config, state):
        self.config, self.state = eval_config, state

    def record(self, epoch: int, evaluation: dict) -> None:
        self.state.eval_history.append({"epoch": epoch, **{k: scalar(v) for k, v in evaluation.items()}})

    def selection_key(self, evaluation: dict) -> tuple[str, float] | None:
        """`(key, sign)` of `eval.best_metric` in `evaluation`: on the validation prompts (`val/...`) when the run
        has them (`prompts.val`), else on the test prompts (`eval/...`); None without a best metric."""
        key = self.config.best_key()
        if key is None:
            return None
        name, sign = key
        validation = "val/" + name.removeprefix("eval/")
        return (validation if validation in evaluation else name), sign

    def improved(self, evaluation: dict) -> bool:
        """Whether this evaluation beats the best one by `eval.best_metric` (then recorded as the best)."""
        key = self.selection_key(evaluation)
        if key is None:
            return False
        name, sign = key
        if name not in evaluation:
            names = [k.removeprefix("eval/") for k in evaluation if k.startswith("eval/")]
            raise ValueError(
                f"eval.best_metric {self.config.best_metric!r} is not an evaluation metric; "
                f"choose from {', '.join(names)}"
            )
        value = scalar(evaluation[name])
        best = self.state.best
        if best is None or sign * value > sign * best["value"]:
            self.state.best = {"epoch": self.state.epoch, "metric": name, "value": value}
            return True
        return False

    def overoptimisation(self) -> dict:
        """The proxy-gold divergence since the gold metric's best evaluation: `overopt/gold_drop` (how far the gold
        metric, `eval.best_metric` or else the first `eval.metrics`, lies below its best so far) and
        `overopt/proxy_gain` (how much the proxy, `eval/reward`, rose since that evaluation). Both positive: the
        proxy rises while the gold falls."""
        history, golds = self.state.eval_history, self.config.gold_metrics()
        gold, sign = self.config.best_key() or (f"eval/{golds[0]}" if golds else "", 1.0)
        if gold not in history[-1] or "eval/reward" not in history[-1]:
            return {}
        best = max(history, key=lambda e: sign * e[gold])  # the first of equal values: the earliest peak
        return {
            "overopt/gold_drop": sign * (best[gold] - history[-1][gold]),
            "overopt/proxy_gain": history[-1]["eval/reward"] - best["eval/reward"],
        }

    def dropped(self) -> str | None:
        """`eval.stop_on_drop`: why the run stops (the watched metric fell that far below its best), or None."""
        amount, key = self.config.stop_on_drop, self.selection_key(self.state.eval_history[-1])
        if amount is None or self.state.best is None:
            return None
        name, sign = key
        value = self.state.eval_history[-1][name]
        if sign * (self.state.best["value"] - value) < amount:
            return None
        best = self.state.best
        self.state.stopped = {"epoch": self.state.epoch, "metric": name, "best": best["value"], "value": value}
        return (
            f"stopping at epoch {self.state.epoch}: {name} fell to {value:.4f}, {amount} below its best "
            f"{best['value']:.4f} (epoch {best['epoch']}; eval.stop_on_drop)"
        )


def summary(config, state, *, processes: int, shard: str, wall_s: float, train_reward_end) -> dict:
    """The `summary.json` of a run: its first and last evaluations (the best one's when restored), counters."""
    first, last = state.eval_history[0], state.eval_history[-1]
    best = state.best
    if best is not None and best.get("restored"):  # the final weights are the best evaluation's
        last = next(e for e in state.eval_history if e["epoch"] == best["epoch"])
    golds = config.eval.gold_metrics()
    gold = golds[0] if golds else None
    metrics = [k for k in last if k != "epoch"]
    return {
        "trainer": config.trainer,
        "epochs": state.epoch,
        "processes": processes,
        "shard": shard,
        "wall_s": round(wall_s, 1),
        "reward_start": first.get("eval/reward"),
        "reward_end": last.get("eval/reward"),
        "gold_metric": gold,
        "gold_start": first.get(f"eval/{gold}") if gold else None,
        "gold_end": last.get(f"eval/{gold}") if gold else None,
        "eval_start": {k: first.get(k) for k in metrics},
        "eval_end": {k: last.get(k) for k in metrics},
        "eval_history": state.eval_history,
        "samples_scored": state.samples_scored,
        "best": best,
        "stopped": state.stopped,
        "train_reward_end": train_reward_end,
    }
