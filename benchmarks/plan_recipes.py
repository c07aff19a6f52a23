"""`flowrl plan` of every shipped real-model recipe on 1 and 8 GPUs: the memory table of docs/models.md.

Each recipe (`configs/<family>/*.yaml` but `tiny.yaml`) is planned as `flowrl plan CONFIG --gpus N` plans it (one
trace, both process counts), on GPUs of `--gpu-memory` GiB (80: an H100). A recipe the run refuses at a process
count (sharding, groups over processes) shows the refusal. Runs on a CPU in a few minutes; writes JSON as it goes.

    python benchmarks/plan_recipes.py [--gpus 1,8] [--gpu-memory 80] [--only sd35m,qwen_image] [--merge]

Writes `benchmarks/results/plan_recipes.json` (or `--out`) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl.plan.phases import check_launch  # noqa: E402
from flowrl.plan.planner import plans  # noqa: E402
from flowrl.plan.trace import GiB  # noqa: E402
from flowrl.trainers import load_config  # noqa: E402


SKIP = ("digits", "control", "llm", "accelerate")


def recipes(only: list[str] | None = None) -> list[Path]:
    paths = sorted(
        p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name not in SKIP and p.name != "tiny.yaml"
    )
    return [
        p for p in paths if not only or p.parent.name in only or p.relative_to(ROOT / "configs").as_posix() in only
    ]


def row(path: Path, gpus: list[int], gpu_memory: float) -> dict:
    name = path.relative_to(ROOT / "configs").as_posix()
    config = load_config(path)
    start = time.perf_counter()
    out = {"recipe": name, "model": config.model.name, "micro_batch_size": config.batch.micro_batch_size, "plans": {}}
    allowed = []
    for n in gpus:
        try:
            check_launch(config, n)
            allowed.append(n)
        except ValueError as err:
            out["plans"][str(n)] = {"refused": " ".join(str(err).split())}
    for n, result in zip(allowed, plans(config, gpus=allowed, gpu_memory=gpu_memory, name=name) if allowed else []):
        out["plans"][str(n)] = {
            "phases": {p.name: round(p.bytes / GiB, 2) for p in result.phases},
            "peak_phase": result.peak.name,
            "fits": result.fits(),
            "max_micro_batch": result.max_micro_batch,
            "shard": config.run.shard if n > 1 else "none",
        }
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def markdown(rows: list[dict], gpus: list[int], gpu_memory: float) -> str:
    heads = [f"{n} GPU{'s' if n > 1 else ''}: peak GiB (phase), largest micro-batch" for n in gpus]
    lines = [f"| recipe | micro-batch | {' | '.join(heads)} |", "| --- | --- |" + " --- |" * len(gpus)]
    for r in rows:
        if "error" in r:
            reason = r["error"].split(": ", 1)[-1].split(": its update is not planned")[0][:160]
            lines.append(f"| `{r['recipe']}` | | not planned: {reason} |" + " |" * (len(gpus) - 1))
            continue
        cells = []
        for n in gpus:
            p = r["plans"].get(str(n), {})
            if "refused" in p:
                cells.append(f"refused: {p['refused'][:80]}")
                continue
            peak = p["phases"][p["peak_phase"]]
            mark = "" if p["fits"] else " **does not fit**"
            shard = f", {p['shard']}" if p["shard"] != "none" else ""
            cells.append(f"{peak:.1f} ({p['peak_phase']}{shard}){mark}, {p['max_micro_batch'] or 'none'}")
        lines.append(f"| `{r['recipe']}` | {r['micro_batch_size']} | {' | '.join(cells)} |")
    return "\n".join(lines) + f"\n\nGPUs of {gpu_memory:g} GiB; a plan fits in 92% of it."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="1,8", help="process counts, comma-separated")
    parser.add_argument("--gpu-memory", type=float, default=80.0)
    parser.add_argument(
        "--only",
        default="",
        help="config folders or recipes (sd35m/awm_pickscore.yaml), comma-separated (default: all)",
    )
    parser.add_argument("--merge", action="store_true", help="replace these recipes' rows in --out, keep the others")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_recipes.json"))
    args = parser.parse_args(argv)
    gpus = [int(n) for n in args.gpus.split(",")]
    kept = json.loads(Path(args.out).read_text())["rows"] if args.merge and Path(args.out).is_file() else []
    rows, merged = [], kept
    for path in recipes([s for s in args.only.split(",") if s]):
        try:
            rows.append(row(path, gpus, args.gpu_memory))
        except Exception as err:  # noqa: BLE001  (one recipe's failure is reported in its row; the others go on)
            name = path.relative_to(ROOT / "configs").as_posix()
            rows.append(
                {
                    "recipe": name,
                    "error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}",
                    "seconds": 0.0,
                    "plans": {},
                    "micro_batch_size": None,
                }
            )
        print(f"{rows[-1]['recipe']}: {rows[-1]['seconds']} s", file=sys.stderr, flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        done = {r["recipe"] for r in rows}
        merged = sorted([*(r for r in kept if r["recipe"] not in done), *rows], key=lambda r: r["recipe"])
        Path(args.out).write_text(json.dumps({"gpu_memory": args.gpu_memory, "rows": merged}, indent=1))
    print(markdown(merged, gpus, args.gpu_memory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
