"""The `flowrl` command line."""

from __future__ import annotations

import argparse
import sys

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
        "trainers": TRAINERS.describe(),
    }


def _family_line(name: str) -> str:
    """A model family: what it is, the diffusers pipeline it wraps, its published models with their parameter
    counts, and the image trainers that train its time convention."""
    from flowrl.models.families import MODEL_FAMILIES
    from flowrl.trainers import TRAINERS
    from flowrl.trainers.shared.image import ImageAlgorithm

    cls = MODEL_FAMILIES.get(name)
    fits = lambda t: cls.time_kind in t.time_kinds and (t.video or not cls.video)  # noqa: E731
    trainers = [n for n in TRAINERS.names() if issubclass(TRAINERS.get(n), ImageAlgorithm) and fits(TRAINERS.get(n))]
    real = "; ".join(cls.real_models) or "none listed"
    return (
        f"{MODEL_FAMILIES.describe()[name]} Pipeline: {cls.pipeline_class}. Real models: {real}. "
        f"Trainers: {', '.join(trainers)}."
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

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        trainer.train(resume=resume, overwrite=args.overwrite)
    except KeyboardInterrupt as err:
        latest = _resumable(trainer.output_dir)
        where = f"its latest checkpoint is {latest}" if latest else "no checkpoint was written yet"
        how = "terminated" if isinstance(err, Terminated) else "interrupted"
        hint = _next_command(args, trainer.output_dir)
        hint = f" ({hint})" if hint else ""
        print(f"flowrl train: {how} at epoch {trainer.epoch} of {config.run.epochs}; {where}{hint}", file=sys.stderr)
        return 143 if isinstance(err, Terminated) else 130
    except Exception as err:
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


def build_parser() -> argparse.ArgumentParser:
    from flowrl import __version__

    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"flowrl {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="list registered objectives, estimators, weightings, rewards, ...")
    p_list.add_argument("section", nargs="?", help="only this section (e.g. objectives, rewards)")
    p_list.add_argument("--markdown", action="store_true", help="markdown tables (what docs/registries.md holds)")
    p_list.set_defaults(func=cmd_list)
    p_train = sub.add_parser("train", help="train from a YAML config")
    p_train.add_argument("config", help="YAML run config (see configs/); with --resume, the run folder may be given")
    p_train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    p_train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="resume the run (its own saved config; --set overrides are printed) from its latest "
        "checkpoint, or from the checkpoint PATH",
    )
    p_train.add_argument("--output-dir", help="run folder (overrides run.output_dir)")
    p_train.add_argument(
        "--overwrite", action="store_true", help="start afresh in a run folder that holds another run (deletes it)"
    )
    p_train.set_defaults(func=cmd_train)
    p_plan = sub.add_parser("plan", help="a run's GPU memory per phase, traced without weights, and what fits")
    p_plan.add_argument("config", help="YAML run config (an image or video run)")
    p_plan.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    p_plan.add_argument("--gpus", type=int, default=None, help="processes (GPUs) the run is launched on (default 1)")
    p_plan.add_argument(
        "--gpu-memory", type=float, default=80.0, metavar="GB", help="memory of each GPU in GiB (default 80: an H100)"
    )
    p_plan.set_defaults(func=cmd_plan)
    p_export = sub.add_parser("export", help="write a run's weights in diffusers' formats (LoRA or model folder)")
    p_export.add_argument("run", help="a run folder (with config.yaml and checkpoints/)")
    p_export.add_argument("--out", required=True, help="the folder to write")
    p_export.add_argument("--checkpoint", help="a checkpoint folder (default: the run's latest)")
    p_export.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="export the EMA weights (default: when the run kept them)",
    )
    p_export.set_defaults(func=cmd_export)
    p_demos = sub.add_parser("demos", help="record a control run's policy as demonstrations (.npz) for `trainer: bc`")
    p_demos.add_argument("run", help="a control run folder (or one of its checkpoint folders)")
    p_demos.add_argument("--out", required=True, help="the .npz file to write")
    p_demos.add_argument("--episodes", type=int, default=20, help="whole episodes to record (default 20)")
    p_demos.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="std of Gaussian noise added to each action, in action units (default 0)",
    )
    p_demos.add_argument("--seed", type=int, default=0, help="first episode's seed (then seed + 1, ...)")
    p_demos.add_argument("--checkpoint", help="a checkpoint folder (default: the run's latest)")
    p_demos.set_defaults(func=cmd_demos)
    p_sample = sub.add_parser("sample", help="images (PNGs and a captioned grid) from a run's checkpoint")
    p_sample.add_argument("target", help="a run folder or one of its checkpoint folders")
    p_sample.add_argument(
        "--prompts", required=True, help="a prompt, a .txt/.jsonl file or a shipped prompt set (digits/test)"
    )
    p_sample.add_argument("--n", type=int, default=4, help="images per prompt (default 4)")
    p_sample.add_argument("--seed", type=int, default=0, help="noise seed: the same seed, the same images")
    p_sample.add_argument("--sampler", help="ode (default; ddim for UNets), flow_sde, dance_sde, cps, ...")
    p_sample.add_argument("--noise-level", type=float, help="the sampler's noise (default: the run's)")
    p_sample.add_argument("--num-steps", type=int, help="denoising steps (default: the run's evaluation steps)")
    p_sample.add_argument("--guidance-scale", type=float, help="default: the run's evaluation guidance")
    p_sample.add_argument("--checkpoint", default="latest", help="latest (default), best, or a checkpoint folder")
    p_sample.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="use the EMA weights (default: when the run kept them)",
    )
    p_sample.add_argument("--out", help="output folder (default: RUN/samples/<checkpoint>)")
    p_sample.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="editing models: a source image every prompt edits (repeat for several; default: an "
        "editing prompt set's own, e.g. edit_shapes/test); image-to-video models: the start "
        "frame of every prompt, or repeated, one per prompt",
    )
    p_sample.set_defaults(func=cmd_sample)
    p_eval = sub.add_parser("eval", help="evaluate a run folder's checkpoint, or a config's base model")
    p_eval.add_argument("target", help="a run folder (with config.yaml and checkpoints/) or a YAML config")
    p_eval.add_argument("--checkpoint", help="a checkpoint folder (default: the run's latest)")
    p_eval.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (e.g. eval.*)")
    p_eval.add_argument("--out", help="also write the result to this JSON file")
    p_eval.set_defaults(func=cmd_eval)
    p_ablate = sub.add_parser("ablate", help="train configs x a grid of overrides x seeds and tabulate the results")
    p_ablate.add_argument("configs", nargs="+", help="YAML run configs, or one study file (an `ablate:` section)")
    p_ablate.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="values to sweep (repeatable)")
    p_ablate.add_argument("--seeds", help="comma-separated seeds (default: the study's, else 0)")
    p_ablate.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every run")
    p_ablate.add_argument("--output-dir", help="where runs and results go (default: the study's, runs/ablation)")
    p_ablate.add_argument(
        "--threshold",
        metavar="METRIC=VALUE",
        help="report reward evaluations and seconds until METRIC first reaches VALUE",
    )
    p_ablate.add_argument(
        "--skip-done",
        action="store_true",
        help="reuse runs that already finished in --output-dir with the same config",
    )
    p_ablate.set_defaults(func=cmd_ablate)
    p_serve = sub.add_parser(
        "serve-reward",
        help="serve a reward over HTTP: one model copy for many runs (FastAPI "
        "on uvicorn: pip install 'flowrl-toolkit[serve]')",
    )
    p_serve.add_argument("name", help="a registered reward (see `flowrl list rewards`) or package.module:attribute")
    p_serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface (default 127.0.0.1: this machine only; another needs a token or --insecure)",
    )
    p_serve.add_argument(
        "--insecure",
        action="store_true",
        help="serve on a --host other than this machine's without a token (anyone who reaches the "
        "port can use the reward)",
    )
    p_serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p_serve.add_argument(
        "--token",
        help="require Authorization: Bearer TOKEN (default: $FLOWRL_REWARD_TOKEN if "
        "set, which keeps the token out of the process list)",
    )
    p_serve.add_argument("--max-batch", type=int, default=64, help="merge requests up to this many images (64)")
    p_serve.add_argument("--max-body-mb", type=float, default=256.0, help="refuse larger requests with 413 (256)")
    p_serve.add_argument(
        "--max-image-pixels",
        type=int,
        default=4096 * 4096,
        help="refuse an image of more pixels (H x W) with 413, before decoding it (4096 x 4096)",
    )
    p_serve.add_argument(
        "--max-inflight-mb",
        type=float,
        default=2048.0,
        help="memory budget of the requests in flight together: bodies and decoded pixels; beyond "
        "it a request gets 503 and is sent again (2048)",
    )
    p_serve.add_argument(
        "--batch-wait",
        type=float,
        default=0.01,
        metavar="SECONDS",
        help="how long to wait for more requests to merge (0.01)",
    )
    p_serve.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="a reward constructor argument, e.g. --set device=cuda (repeatable)",
    )
    p_serve.set_defaults(func=cmd_serve_reward)
    p_score = sub.add_parser("score", help="a reward's scores for image (or video) files: check it before training")
    p_score.add_argument("reward", help="a registered reward (see `flowrl list rewards`) or package.module:attribute")
    p_score.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...) or videos (.mp4)")
    p_score_prompts = p_score.add_mutually_exclusive_group()
    p_score_prompts.add_argument("--prompt", help="the prompt of every image (default: the empty prompt)")
    p_score_prompts.add_argument(
        "--prompts",
        metavar="FILE",
        help="a .txt/.jsonl prompt file with one row per image, in order (jsonl keys go to the reward as metadata)",
    )
    p_score.add_argument(
        "--server", metavar="URL", help="score through `flowrl serve-reward REWARD` at URL (the http reward)"
    )
    p_score.add_argument(
        "--kwargs",
        metavar="JSON",
        help='the reward\'s constructor arguments, e.g. \'{"device": "cuda"}\' (with --server: the '
        "http client's, e.g. timeout_s, deadline_s (10 s here), token)",
    )
    p_score.add_argument(
        "--image",
        metavar="IMAGE",
        help="the conditioning image of every file (an image-to-video "
        "start frame, an edit's source) for the rewards that read it",
    )
    p_score.add_argument("--json", action="store_true", help="print the scores as JSON (NaN as null)")
    p_score.set_defaults(func=cmd_score)
    p_digits = sub.add_parser("digits", help="the digits world: `flowrl digits build [--force]`")
    p_digits.add_argument("action", choices=["build"])
    p_digits.add_argument("rest", nargs=argparse.REMAINDER)
    p_digits.set_defaults(func=cmd_digits)
    return parser


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
        return args.func(args)
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
