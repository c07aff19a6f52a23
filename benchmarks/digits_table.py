"""All image trainers on the digits world, several seeds: alignment, gold metrics, wall time, reward budget.

    python benchmarks/digits_table.py [--seeds 0,1,2] [--trainers flow_grpo,grpo_guard,...] [--eval-every 2] [--keep]
                                     [--merge] [--busy] [--beside-busy-loop]

Runs `configs/digits/<trainer>.yaml` for every trainer and seed (sequentially, one process, the shipped
settings; `--eval-every` overrides every config's evaluation period) through `flowrl.ablate`, and writes
`benchmarks/results/digits_table.{json,md}`. Sample efficiency: the reward evaluations and wall seconds until
the test alignment (`eval/digits_alignment`, the training reward on held-out prompts) first reaches
`--threshold` (0.9), read from the eval curve; its resolution is `eval.every` epochs of each trainer's batch
(the table's `resolution` column, in reward evaluations). `--merge` replaces the rows of the trainers run in
the existing JSON and keeps the others (each row records its own machine, threads and date).
`--beside-busy-loop` runs every training beside a CPU-bound Python loop (a busy machine: on 2 cores the run's
thread governor leaves it one), the same competitor as `benchmarks/contention_bench.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl import ablate  # noqa: E402


TRAINERS = [
    "flow_grpo",
    "grpo_guard",
    "loop",
    "dpok",
    "find",
    "acflow",
    "mix_grpo",
    "mix_grpo_flash",
    "flow_grpo_fast",
    "dance_grpo",
    "tempflow_grpo",
    "diffusion_nft",
    "awm",
    "image_fpo",
    "diffusion_dpo",
    "dgpo",
    "flow_dppo",
    "gardo",
]
METRICS = ["eval/digits_accuracy", "eval/digits_gold", "eval/digits_realism", "eval/diversity", "eval/reward"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--trainers", default=",".join(TRAINERS))
    parser.add_argument("--runs", default="/tmp/flowrl-digits-table", help="run folders (emptied first unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep finished runs in --runs and reuse them")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="epochs between evaluations, the resolution (default: each config's eval.every)",
    )
    parser.add_argument(
        "--threshold", type=float, default=0.9, help="test alignment for the sample-efficiency columns"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "digits_table"))
    parser.add_argument("--merge", action="store_true", help="keep the other trainers' rows of the existing --out")
    parser.add_argument(
        "--busy", action="store_true", help="record that other work shared the machine (wall columns not comparable)"
    )
    parser.add_argument(
        "--beside-busy-loop", action="store_true", help="run beside a CPU-bound Python loop (a busy machine)"
    )
    args = parser.parse_args()
    configs = [str(ROOT / "configs" / "digits" / f"{name}.yaml") for name in args.trainers.split(",")]
    missing = [c for c in configs if not Path(c).is_file()]
    if missing:
        raise SystemExit(f"no digits config for {missing}")
    if not args.keep:
        shutil.rmtree(args.runs, ignore_errors=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.beside_busy_loop else None
    try:
        rows = ablate.run(
            configs,
            seeds=seeds,
            output_dir=args.runs,
            skip_done=args.keep,
            overrides=[f"eval.every={args.eval_every}"] if args.eval_every else [],
            threshold=("eval/digits_alignment", args.threshold),
        )
    finally:
        if loop is not None:
            loop.kill()
    stamp = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "quiet_machine": not (args.busy or args.beside_busy_loop),
        "beside_busy_loop": args.beside_busy_loop,
    }
    rows = [{**row, **stamp} for row in rows]
    existing = Path(args.out + ".json")
    if args.merge and existing.is_file():
        ran = {row["variant"] for row in rows}
        kept = [row for row in json.loads(existing.read_text())["rows"] if row["variant"] not in ran]
        order = {name: i for i, name in enumerate(TRAINERS)}
        rows = sorted(kept + rows, key=lambda r: (order.get(r["variant"], len(order)), r["seed"]))
    markdown = ablate.table(rows, METRICS)
    result = {
        "benchmark": "digits_table",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "eval_every": args.eval_every,
        "threshold": args.threshold,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1, allow_nan=True))
    Path(args.out + ".md").write_text(
        "Digits world, shipped configs, mean ± std over seeds "
        "(accuracy: reward classifier; gold: independent classifier; realism: lower is better). "
        f"'reached': seeds whose test alignment reached {args.threshold}, "
        "with the reward evaluations and wall seconds (evaluations included) until it first did.\n\n"
        + markdown
        + "\n"
        + provenance(rows)
    )
    print(markdown)


def provenance(rows: list[dict]) -> str:
    """When each variant's rows ran and whether the machine was quiet (rows merged from several runs differ: the
    start values show which base model they trained from)."""
    runs = {}
    for row in rows:
        date = row.get("date") or "undated (before 2026-11-23)"
        if row.get("beside_busy_loop"):
            where = " (beside a CPU-bound Python loop: a busy machine, on purpose)"
        elif not row.get("quiet_machine", True):
            where = " (other work shared the machine: wall columns not comparable)"
        else:
            where = ""
        runs.setdefault((date, where), []).append(row["variant"])
    lines = [f"- {date}{where}: {', '.join(dict.fromkeys(names))}" for (date, where), names in sorted(runs.items())]
    return "Runs:\n" + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
