"""The `flowrl` command line."""

from __future__ import annotations

import argparse
import sys


def _catalog() -> dict[str, dict[str, str]]:
    """Section title -> {name: one-line description} for every registry."""
    import rewards
    from flowrl import core
    from flowrl.policies import SAMPLERS
    from flowrl.trainers import TRAINERS

    return {
        "objectives": core.OBJECTIVES.describe(),
        "advantage estimators": core.ADVANTAGES.describe(),
        "KL estimators": core.KL_ESTIMATORS.describe(),
        "step selections": core.STEP_SELECTIONS.describe(),
        "step weightings": core.STEP_WEIGHTINGS.describe(),
        "samplers": SAMPLERS.describe(),
        "rewards": rewards.REWARDS.describe(),
        "trainers": TRAINERS.describe(),
    }


def cmd_list(args: argparse.Namespace) -> int:
    catalog = _catalog()
    sections = catalog
    if args.section:
        wanted = {k.lower().replace(" ", "_"): k for k in catalog}
        key = args.section.lower().replace(" ", "_")
        if key not in wanted:
            print(f"unknown section {args.section!r}; choose from {', '.join(wanted)}", file=sys.stderr)
            return 2
        sections = {wanted[key]: catalog[wanted[key]]}
    for title, entries in sections.items():
        print(f"{title}:")
        if not entries:
            print("  (none registered yet)")
        width = max((len(n) for n in entries), default=0)
        for name, description in entries.items():
            print(f"  {name:<{width}}  {description}")
        print()
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from flowrl.config import ConfigError, load_config
    from flowrl.trainers import build_trainer

    try:
        config = load_config(args.config, args.set or [])
    except (ConfigError, FileNotFoundError) as err:
        print(f"flowrl train: {err}", file=sys.stderr)
        return 2
    if args.output_dir:
        config.run.output_dir = args.output_dir
    trainer = build_trainer(config)
    resume = True if args.resume == "latest" else args.resume
    trainer.train(resume=resume)
    return 0


def cmd_digits(args: argparse.Namespace) -> int:
    from flowrl.digits.build import main as build_main

    return build_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="list registered objectives, estimators, weightings, rewards, ...")
    p_list.add_argument("section", nargs="?", help="only this section (e.g. objectives, rewards)")
    p_list.set_defaults(func=cmd_list)
    p_train = sub.add_parser("train", help="train from a YAML config")
    p_train.add_argument("config", help="YAML run config (see configs/)")
    p_train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    p_train.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                         help="resume the run in run.output_dir from its latest checkpoint, or from PATH")  # fmt: skip
    p_train.add_argument("--output-dir", help="run folder (overrides run.output_dir)")
    p_train.set_defaults(func=cmd_train)
    p_digits = sub.add_parser("digits", help="the digits world: `flowrl digits build [--force]`")
    p_digits.add_argument("action", choices=["build"])
    p_digits.add_argument("rest", nargs=argparse.REMAINDER)
    p_digits.set_defaults(func=cmd_digits)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
