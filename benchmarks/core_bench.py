"""Time `compute_policy_loss` (forward + backward, metrics included) against a naive reference.

The reference is the direct autograd form of each published formula (`tests/core/reference_objectives.py`)
followed by the same diagnostics computed the obvious way. Both run side by side, interleaved, in one
process; the ratio reported is median(library) / median(reference), lower is better.

    python benchmarks/core_bench.py [--repeats 50] [--out benchmarks/results/core_bench.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl.core import compute_policy_loss, get_objective  # noqa: E402
from tests.core.reference_objectives import REFERENCES, ref_aggregate  # noqa: E402


CASES = {"text": (64, 1024), "images": (256, 10)}
OBJECTIVES = ["ppo", "grpo", "gspo", "sapo", "cispo", "grpo_guard"]


def naive_metrics(logp, old_logp, adv, mask, eps_low, eps_high):
    """The diagnostics `compute_policy_loss` returns, computed directly."""
    with torch.no_grad():
        m = mask.float()
        ratio = torch.exp(logp - old_logp)
        high = ((adv > 0) & (ratio > 1 + eps_high)).float()
        low = ((adv < 0) & (ratio < 1 - eps_low)).float()
        n = m.sum()
        mean = (ratio * m).sum() / n
        out = {
            "clipfrac": (torch.maximum(high, low) * m).sum() / n,
            "clipfrac_high": (high * m).sum() / n,
            "clipfrac_low": (low * m).sum() / n,
            "ratio_mean": mean,
            "ratio_std": ((((ratio - mean) ** 2) * m).sum() / n).sqrt(),
            "ratio_min": ratio[mask].min(),
            "ratio_max": ratio[mask].max(),
            "approx_kl_k3": (((ratio - 1) - (logp - old_logp)) * m).sum() / n,
        }
        if ratio.shape[1] <= 64:
            out["ratio_mean_per_step"] = (ratio * m).sum(0) / m.sum(0)
            out["clipfrac_per_step"] = (torch.maximum(high, low) * m).sum(0) / m.sum(0)
        return out


def make_inputs(b, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-3 * torch.rand(b, k, generator=g)).requires_grad_(True)
    old = logp.detach() + 0.05 * torch.randn(b, k, generator=g)
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, k, generator=g) > 0.1
    mask[:, 0] = True
    guard = {"std": 0.1 + torch.rand(b, k, generator=g), "mean_diff_sq": 1e-3 * torch.rand(b, k, generator=g)}
    return logp, old, adv, mask, guard


def bench_pair(name, b, k, repeats):
    logp, old, adv, mask, guard = make_inputs(b, k)
    extra = guard if name == "grpo_guard" else {}
    objective = get_objective(name)
    hp = {**objective.hparams}
    ref_fn, preset = REFERENCES[name]
    eps_low = hp.get("clip_eps_low") or 0.0
    eps_high = hp.get("clip_eps_high") or eps_low
    adv_bk = adv.unsqueeze(-1).expand(b, k)

    def library():
        loss, metrics = compute_policy_loss(name, logp, old, adv, mask, **extra)
        loss.backward()
        logp.grad = None
        return metrics

    def reference():
        ref_hp = {key: hp[key] for key in ("clip_eps_low", "clip_eps_high", "tau_pos", "tau_neg") if key in hp}
        per_element = ref_fn(logp, old, adv_bk, mask, **{**ref_hp, **preset}, **extra)
        loss = ref_aggregate_fast(per_element, mask, objective.agg)
        loss.backward()
        logp.grad = None
        return naive_metrics(logp.detach(), old, adv_bk, mask, eps_low, eps_high)

    for _ in range(5):  # warm-up
        library()
        reference()
    times = {"library": [], "reference": []}
    for _ in range(repeats):  # interleaved so both see the same machine state
        for label, fn in (("library", library), ("reference", reference)):
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    lib, ref = statistics.median(times["library"]), statistics.median(times["reference"])
    return {"objective": name, "B": b, "K": k, "library_ms": 1e3 * lib, "reference_ms": 1e3 * ref, "ratio": lib / ref}


def ref_aggregate_fast(loss, mask, agg):
    """`ref_aggregate` loops over rows in Python (clear, slow); time a vectorised equivalent instead."""
    m = mask.to(loss.dtype)
    n = m.sum(-1)
    if agg == "token_mean":
        return (loss * m).sum() / m.sum()
    if agg == "seq_mean_token_mean":
        return ((loss * m).sum(-1) / n).mean()
    return ref_aggregate(loss, mask, agg)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "core_bench.json"))
    args = parser.parse_args()
    rows = [bench_pair(name, b, k, args.repeats) for b, k in CASES.values() for name in OBJECTIVES]
    result = {
        "benchmark": "core_bench",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "repeats": args.repeats,
        "rows": rows,
        "worst_ratio": max(r["ratio"] for r in rows),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'objective':<12}{'B':>5}{'K':>6}{'flowrl ms':>11}{'naive ms':>10}{'ratio':>8}")
    for r in rows:
        print(
            f"{r['objective']:<12}{r['B']:>5}{r['K']:>6}{r['library_ms']:>11.3f}{r['reference_ms']:>10.3f}{r['ratio']:>8.2f}"
        )
    print(f"worst ratio {result['worst_ratio']:.2f} (target <= 1.0); written to {args.out}")


if __name__ == "__main__":
    main()
