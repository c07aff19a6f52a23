"""The `flowrl` command line."""

from __future__ import annotations

import argparse
import sys


def _catalog() -> dict[str, dict[str, str]]:
    """Section title -> {name: one-line description} for every registry."""
    import rewards
    from flowrl import core
    from flowrl.policies import SAMPLERS

    return {
        "objectives": core.OBJECTIVES.describe(),
        "advantage estimators": core.ADVANTAGES.describe(),
        "KL estimators": core.KL_ESTIMATORS.describe(),
        "step selections": core.STEP_SELECTIONS.describe(),
        "step weightings": core.STEP_WEIGHTINGS.describe(),
        "samplers": SAMPLERS.describe(),
        "rewards": rewards.REWARDS.describe(),
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="list registered objectives, estimators, weightings, rewards, ...")
    p_list.add_argument("section", nargs="?", help="only this section (e.g. objectives, rewards)")
    p_list.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
