"""The `flowrl` command line: runs the subcommand that `flowrl.cli_parser` parsed (`COMMANDS`), every failure as one
line on stderr. `list`, `train` and `plan` are here; the subcommands that use a run or a reward once it exists are in
`flowrl.commands`."""

from __future__ import annotations

import argparse
import sys

from flowrl.cli_parser import build_parser
from flowrl.commands import (
    cmd_ablate,
    cmd_demos,
    cmd_digits,
    cmd_eval,
    cmd_export,
    cmd_sample,
    cmd_score,
    cmd_serve_reward,
)


def _catalog() -> dict[str, dict[str, str]]:
    """Section title -> {name: one-line description} for every registry."""
    from flowrl import core, rewards
    from flowrl.models.families import MODEL_FAMILIES
    from flowrl.policies import SAMPLERS
    from flowrl.trainers import TRAINERS

    return {
        "objectives": core.OBJECTIVES.describe(),
        "advantage estimators": core.ADVANTAGES.describe(),
        "KL estimators": core.KL_ESTIMATORS.describe(),
        "step selections": core.STEP_SELECTIONS.describe(),
        "step weightings": core.STEP_WEIGHTINGS.describe(),
        "samplers": SAMPLERS.describe(),
        "model families": {name: _family_line(name) for name in MODEL_FAMILIES.names()},
        "rewards": rewards.REWARDS.describe(),
        "trainers": {name: _trainer_line(name, line) for name, line in TRAINERS.describe().items()},
    }


def _trainer_line(name: str, description: str) -> str:
    """A trainer: what it is, and what it trains (the modality base it builds on)."""
    from flowrl.trainers import TRAINERS
    from flowrl.trainers.shared.control import ControlAlgorithm
    from flowrl.trainers.shared.image import ImageAlgorithm
    from flowrl.trainers.text.text import TextAlgorithm

    kinds = {ImageAlgorithm: "image", ControlAlgorithm: "control", TextAlgorithm: "text"}
    kind = next((k for base, k in kinds.items() if issubclass(TRAINERS.get(name), base)), None)
    return f"{description}. Modality: {kind}." if kind else description


def _family_line(name: str) -> str:
    """A model family: what it is, the diffusers pipeline it wraps, its published models with their parameter
    counts, and the image trainers that train its time convention (by exception when most do: a new trainer that
    trains every family changes no family's line)."""
    from flowrl.models.families import MODEL_FAMILIES
    from flowrl.trainers import TRAINERS
    from flowrl.trainers.shared.image import ImageAlgorithm

    cls = MODEL_FAMILIES.get(name)
    fits = lambda t: cls.time_kind in t.time_kinds and (t.video or not cls.video)  # noqa: E731
    image = [n for n in TRAINERS.names() if issubclass(TRAINERS.get(n), ImageAlgorithm)]
    fit = [n for n in image if fits(TRAINERS.get(n))]
    left = [n for n in image if n not in fit]
    if not left:
        trainers = "every image trainer"
    elif len(left) < len(fit):
        trainers = f"every image trainer but {', '.join(left)}"
    else:
        trainers = ", ".join(fit)
    real = "; ".join(cls.real_models) or "none listed"
    return (
        f"{MODEL_FAMILIES.describe()[name]} Pipeline: {cls.pipeline_class}. Real models: {real}. Trainers: {trainers}."
    )


SECTION_ALIASES = {"models": "model_families", "families": "model_families"}


def cmd_list(args: argparse.Namespace) -> int:
    catalog = _catalog()
    sections = catalog
    if args.section:
        wanted = {k.lower().replace(" ", "_"): k for k in catalog}
        key = args.section.lower().replace(" ", "_")
        key = SECTION_ALIASES.get(key, key)
        if key not in wanted:
            print(f"unknown section {args.section!r}; choose from {', '.join(wanted)}", file=sys.stderr)
            return 2
        sections = {wanted[key]: catalog[wanted[key]]}
    if args.markdown:
        print(markdown_catalog(sections), end="")
        return 0
    for title, entries in sections.items():
        print(f"{title}:")
        if not entries:
            print("  (none registered yet)")
        width = max((len(n) for n in entries), default=0)
        for name, description in entries.items():
            print(f"  {name:<{width}}  {description}")
        print()
    return 0


def markdown_catalog(sections: dict[str, dict[str, str]] | None = None) -> str:
    """The registries as markdown tables (`docs/registries.md` is `flowrl list --markdown`)."""
    lines = [
        "# Registries",
        "",
        "Every name a config can use, from the registries themselves (`flowrl list",
        "--markdown` writes this page; `tests/test_docs.py` checks that it is current).",
        "",
    ]
    for title, entries in (sections or _catalog()).items():
        lines += [f"## {title}", "", "| name | description |", "| --- | --- |"]
        lines += [f"| `{name}` | {entries[name].replace('|', chr(92) + '|')} |" for name in sorted(entries)]
        lines.append("")
    return "\n".join(lines)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process stands so a run stops as on Ctrl-C (and says how to resume)."""


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out


def _train_config(args: argparse.Namespace):
    """The run's config: the YAML file with `--set` overrides; with `--resume`, the run folder's own saved config
    (the YAML given is not read again), an override on resume applied and printed."""
    from pathlib import Path

    from flowrl.config import to_dict
    from flowrl.trainers import load_config

    source = Path(args.config)
    if not args.resume:
        if source.is_dir():
            raise ValueError(f"{source} is a folder: pass a YAML config (a run folder only with --resume)")
        config = load_config(source, args.set or [])
        if args.output_dir:
            config.run.output_dir = args.output_dir
        return config
    checkpoint_dir = Path(args.resume) if args.resume != "latest" else None
    if source.is_dir():
        run_dir = source
    elif checkpoint_dir is not None and checkpoint_dir.parent.name == "checkpoints":
        run_dir = checkpoint_dir.parent.parent
    elif args.output_dir:
        run_dir = Path(args.output_dir)
    else:  # the YAML's run folder, as its `--set` overrides (run.output_dir=X among them) make it
        run_dir = Path(load_config(source, args.set or []).run.output_dir)
        if "{" in str(run_dir):
            raise ValueError(
                f"run.output_dir {run_dir} names a new folder each run: resume with "
                "`flowrl train RUN_FOLDER --resume` (or --output-dir RUN_FOLDER)"
            )
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise FileNotFoundError(f"{run_dir} holds no run to resume (no config.yaml): start it without --resume")
    base = load_config(saved)
    config = load_config(saved, args.set or [])
    before, after = _flat(to_dict(base)), _flat(to_dict(config))
    changed = {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
    if changed:
        print(
            "flowrl train: resuming with overrides: "
            + ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items()),
            flush=True,
        )
    config.run.output_dir = str(run_dir)
    return config


def cmd_train(args: argparse.Namespace) -> int:
    import signal

    from flowrl import checkpoint
    from flowrl.plan import check_fits
    from flowrl.run.artifacts import check_artifacts
    from flowrl.trainers import build_trainer

    config = _train_config(args)
    check_artifacts(config)  # every missing model and reward file in one message, before anything loads
    check_fits(config)  # on a GPU: the run's memory plan, before anything loads
    trainer = build_trainer(config)
    resume = True if args.resume == "latest" else args.resume

    stopping = False  # once set, a SIGTERM no longer interrupts: the run is already stopping
    terminated = False  # a SIGTERM stopped it (Ray hands the exception raised in a call of its own as a plain Ctrl-C)

    def say_stopped(how: str) -> None:
        """The one line of a stopped run: where it stood and the command that goes on."""
        nonlocal stopping
        stopping = True
        latest = _resumable(trainer.output_dir)
        where = f"its latest checkpoint is {latest}" if latest else "no checkpoint was written yet"
        hint = _next_command(args, trainer.output_dir)
        hint = f" ({hint})" if hint else ""
        line = f"flowrl train: {how} at epoch {trainer.epoch} of {config.run.epochs}; {where}{hint}"
        print(line, file=sys.stderr, flush=True)

    def terminate(signum, frame):
        nonlocal terminated
        if stopping:  # a second SIGTERM, or one while an error is reported: the clean-up goes on
            return
        terminated = True
        # said now, before the rollout workers and the Ray cluster stop: a launcher's SIGKILL follows its SIGTERM
        # (torchrun's 30 s later, Slurm's KillWait), and stopping them waits for a rollout in flight
        say_stopped("terminated")
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        trainer.train(resume=resume, overwrite=args.overwrite)
    except KeyboardInterrupt:
        if not stopping:  # Ctrl-C: said once the workers stopped
            say_stopped("interrupted")
        return 143 if terminated else 130
    except Exception as err:
        stopping = True
        from flowrl.run.run_folder import RunFolderError

        started = trainer.log is not None and not isinstance(err, (RunFolderError, checkpoint.CheckpointError))
        nothing_to_resume = isinstance(err, RunFolderError) and _resumable(trainer.output_dir) is None
        if started or nothing_to_resume:  # the command that goes on
            err.flowrl_hint = _next_command(args, trainer.output_dir)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _resumable(run_dir):
    """The run's latest checkpoint if it verifies, else None."""
    from flowrl import checkpoint

    try:
        return checkpoint.latest(run_dir)
    except checkpoint.CheckpointError:
        return None


def _next_command(args: argparse.Namespace, run_dir) -> str | None:
    """The one command that continues a run that stopped (`--resume` from its latest verified checkpoint) or, with no
    checkpoint to resume from but a run in its folder, starts it again (`--overwrite`); None when the folder holds no
    run (the same command starts it)."""
    import shlex

    from flowrl.run.run_folder import holds_run

    if _resumable(run_dir) is not None:
        return f"continue with: flowrl train {shlex.quote(str(run_dir))} --resume"
    if not holds_run(run_dir) and not (run_dir / "checkpoints" / "best").is_dir():
        return None
    if args.resume:  # the run's own saved config
        command = ["flowrl", "train", str(run_dir / "config.yaml"), "--output-dir", str(run_dir), "--overwrite"]
    else:
        command = [
            "flowrl",
            "train",
            args.config,
            *[f"--set={item}" for item in args.set or []],
            "--output-dir",
            str(run_dir),
            "--overwrite",
        ]
    return f"nothing to resume from: start it again with: {shlex.join(command)}"


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flowrl.plan import plan
    from flowrl.trainers import load_config

    config = load_config(args.config, args.set or [])
    gpus = args.gpus if args.gpus is not None else 1
    result = plan(config, gpus=gpus, gpu_memory=args.gpu_memory, name=Path(args.config).as_posix())
    print(result.table())
    return 0 if result.fits() else 1


COMMANDS = {
    "list": cmd_list,
    "train": cmd_train,
    "plan": cmd_plan,
    "export": cmd_export,
    "demos": cmd_demos,
    "sample": cmd_sample,
    "eval": cmd_eval,
    "ablate": cmd_ablate,
    "serve-reward": cmd_serve_reward,
    "score": cmd_score,
    "digits": cmd_digits,
}
"""Subcommand (as `build_parser` names it) -> the function that runs it: parsed arguments in, exit code out."""


USER_ERRORS = (ValueError, FileNotFoundError, OSError, RuntimeError, KeyError)
"""Errors that come from the user's input or environment: one line, no traceback (`--debug` shows it)."""


def main(argv: list[str] | None = None) -> int:
    """Run a `flowrl` command; every failure is one line on stderr and a non-zero exit code, unless `--debug`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while the libraries load (torch takes seconds), before a command runs
        if "--debug" in argv:
            raise
        print("flowrl: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    from flowrl.threads import quiet_libraries

    args = build_parser().parse_args(argv)
    if not args.debug:
        quiet_libraries()
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"flowrl {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001  (every error becomes one line; --debug shows the traceback)
        if args.debug:
            raise
        message = str(err).strip() or type(err).__name__
        if isinstance(err, KeyError) and err.args:
            message = str(err.args[0])
        if getattr(err, "flowrl_hint", None):  # a run that stopped: the command that goes on
            message = f"{message} ({err.flowrl_hint})"
        known = isinstance(err, USER_ERRORS)
        kind = "" if known else f"{type(err).__name__}: "
        hint = "" if known else " (an internal error: please report it with the output of --debug)"
        print(f"flowrl {args.command}: {kind}{message.replace(chr(10), ' ')}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
