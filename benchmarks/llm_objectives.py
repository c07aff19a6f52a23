"""LLM objectives side by side on the toy arithmetic task, and flowrl's loss time against trl's.

Part 1, accuracy (`--parts accuracy`): every objective of `--objectives` trains the `arith` LM with the settings of
`configs/llm/arith_grpo.yaml` and an EQUAL budget (`--epochs` epochs of 32 prompts x 8 completions, lr 1e-4,
`--inner-epochs` passes over each epoch's 256 completions in minibatches of 64, so that ratios move off 1 and
the trust regions act), only `objective.name` differing. Each objective keeps its published hyper-parameters
(`flowrl.core.get_objective(name).hparams`; GSPO's sequence clip 3e-4 / 4e-4 included). Recorded: greedy test
accuracy on the 256 held-out problems before and after training (`summary["eval_start"]`, `summary["eval_end"]`
`eval/reward`), wall time of the whole run (build, both evaluations, training) and of training alone, and the
mean clip fraction and ratio spread over the epochs. Runs go in `--jobs` subprocesses, one torch thread each.

Part 2, loss time (`--parts timing`): forward + backward of the policy loss alone at B = 64 rows, K = 1024
completion tokens (fp32, CPU, `--threads` torch threads), for each loss type trl 1.16 and flowrl both have.
Both sides run trl's real code path, `GRPOTrainer._compute_loss` (trl) and `flowrl.llm.trl.FlowrlGRPOTrainer.
_compute_loss` (flowrl's objective core inside trl's trainer, metrics included), with the trainer's
`_get_per_token_logps_and_entropies` replaced by a stub returning precomputed per-token log-probs (a leaf with
`requires_grad`) and entropies: no model runs, and the backward pass ends at the log-probs. The flowrl
configuration of each trl loss type is `trl_loss_as_objective`'s; loss values and gradients are checked equal
before timing. The bare `flowrl.core.compute_policy_loss` (its own aggregation, no trainer) is timed alongside
for reference. Median of `--repeats` calls after `--warmup`, the two trainers interleaved (alternating order).

    python benchmarks/llm_objectives.py                      # both parts, the full tables
    python benchmarks/llm_objectives.py --parts timing       # the loss times only (keeps the stored accuracy)
    python benchmarks/llm_objectives.py --quick              # a smoke test (1 seed, 2 objectives, 8 epochs)
    python benchmarks/llm_objectives.py --reuse              # rerun only the runs missing from --runs

Writes `benchmarks/results/llm_objectives.json` (every run, every timing) and `llm_objectives.md` (the tables);
`--quick` writes `llm_objectives_quick.{json,md}` unless `--out` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "configs" / "llm" / "arith_grpo.yaml"

SHARED = ["grpo", "dapo", "dr_grpo", "gspo", "sapo", "cispo"]
"""Objectives other libraries (trl, verl) have too."""
SEED_PAPERS = [
    "bapo",
    "dcpo",
    "dcpo_sas",
    "ce_gppo",
    "pspo",
    "aspo",
    "minpro",
    "high_entropy",
    "dispo",
    "troll",
    "humanline",
    "vcpo",
    "trpa",
    "reg_grpo",
    "gtpo",
    "st_ppo",
]
"""Objectives of papers no other library implements."""
VARIANTS = {
    "dcpo_sas": ["objective.name=dcpo", "advantage.estimator=sas"],
    "humanline": ["objective.name=humanline", "sync_reference=true"],  # its anchor synced every optimizer step
    "vcpo": ["objective.name=grpo", "ess_scaling.rule=sqrt"],  # GRPO's loss, the step's lr scaled by its ESS
}
"""Rows that change more than the objective: DCPO with its own advantage estimator (SAS), Humanline with its
per-step anchor sync, VCPO's ESS learning-rate scaling on GRPO."""
PAPERS = {"vcpo": "arXiv:2602.17616"}
"""Rows whose paper is not their objective's (VCPO's scaling runs on GRPO's loss)."""
OBJECTIVES = SHARED + SEED_PAPERS
EPOCHS = 50
INNER_EPOCHS = 2

B, K, PROMPT_LEN = 64, 1024, 8
TRL_CASES = {
    # id: (trl trainer attributes, trl args attributes); flowrl's side is trl_loss_as_objective(...)
    "grpo": ({"loss_type": "grpo"}, {}),
    "dapo": ({"loss_type": "dapo", "epsilon_high": 0.28}, {}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {}),
    "bnpo": ({"loss_type": "bnpo"}, {}),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 5.0}, {}),
    "sapo": ({"loss_type": "sapo"}, {}),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
        {},
    ),
    "luspo": (
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon_low": 2e-3, "epsilon_high": 2.5e-3},
        {},
    ),
    "vespo": ({"loss_type": "vespo"}, {}),
}
TRL_LABELS = {"gspo": "gspo (grpo, sequence level)", "luspo": "luspo (sequence level)"}


# ----------------------------------------------------------------------------------------------
# part 1: accuracy on the arithmetic task
# ----------------------------------------------------------------------------------------------


def overrides(objective: str, seed: int, epochs: int, inner_epochs: int) -> list[str]:
    name = VARIANTS.get(objective, [f"objective.name={objective}"])
    return [
        *name,
        f"run.seed={seed}",
        f"run.epochs={epochs}",
        f"batch.inner_epochs={inner_epochs}",
        "eval.every=0",
        "run.log_with=[]",
        "run.threads=1",
        "run.save_every=0",
        "run.samples_every=0",
    ]


def run_accuracy(objective: str, seed: int, epochs: int, inner_epochs: int, out: Path) -> dict:
    start = time.time()
    import torch

    from flowrl.trainers import build_trainer, load_config

    torch.set_num_threads(1)
    config = load_config(CONFIG, overrides(objective, seed, epochs, inner_epochs))
    trainer = build_trainer(config, output_dir=out)
    summary = trainer.train(overwrite=True)
    history = [r for r in trainer.log.history if r.get("epoch", 0) > 0]

    def mean_of(key):
        values = [r[key] for r in history if isinstance(r.get(key), (int, float))]
        return float(np.mean(values)) if values else None

    return {
        "start_acc": summary["eval_start"]["eval/reward"],
        "final_acc": summary["eval_end"]["eval/reward"],
        "final_tokens": summary["eval_end"].get("eval/completion_tokens"),
        "train_reward_end": summary.get("train_reward_end"),
        "clipfrac_mean": mean_of("clipfrac"),
        "ratio_std_mean": mean_of("ratio_std"),
        "train_s": sum(r.get("time_s", 0.0) for r in history),
        "wall_s": time.time() - start,
    }


def paper(objective: str) -> str:
    from flowrl.core import get_objective

    if objective in PAPERS:
        return PAPERS[objective]
    base = next((o.split("=")[1] for o in VARIANTS.get(objective, []) if o.startswith("objective.name=")), objective)
    found = re.findall(r"arXiv:\s*(\d{4}\.\d{4,5})", get_objective(base).description)
    return f"arXiv:{found[0]}" if found else "-"


def accuracy_table(rows: list[dict], objectives: list[str]) -> str:
    lines = [
        "| objective | paper | in other libraries | start acc | final acc (mean ± std) | per seed | "
        "clip frac | train s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in objectives:
        group = [r for r in rows if r["objective"] == name]
        if not group:
            continue
        final = np.array([r["final_acc"] for r in group])
        clip = [r["clipfrac_mean"] for r in group if r["clipfrac_mean"] is not None]
        start = np.mean([r["start_acc"] for r in group])
        clip_cell = f"{np.mean(clip):.3f}" if clip else "-"
        train_s, wall_s = np.mean([r["train_s"] for r in group]), np.mean([r["wall_s"] for r in group])
        lines.append(
            f"| {name} | {paper(name)} | {'yes' if name in SHARED else 'no'} | {start:.3f} | "
            f"{final.mean():.3f} ± {final.std():.3f} | {', '.join(f'{a:.3f}' for a in final)} | "
            f"{clip_cell} | {train_s:.0f} | {wall_s:.0f} |"
        )
    return "\n".join(lines)


def accuracy_part(args, runs: Path) -> tuple[list[dict], list[str]]:
    objectives = args.objectives.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    pending = [(o, s) for s in seeds for o in objectives]
    running, rows, failed = [], [], []
    if args.reuse:  # runs of the same settings already in --runs
        for job in list(pending):
            result = runs / f"{job[0]}_seed{job[1]}" / "result.json"
            row = json.loads(result.read_text()) if result.is_file() else {}
            if row.get("epochs") == args.epochs and row.get("inner_epochs") == args.inner_epochs:
                rows.append(row)
                pending.remove(job)
        print(f"reusing {len(rows)} finished runs from {runs}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "FLOWRL_THREADING": "torch"}
    runs.mkdir(parents=True, exist_ok=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            job = pending.pop(0)
            cmd = [
                sys.executable,
                __file__,
                "--runs",
                str(runs),
                "--single",
                job[0],
                str(job[1]),
                str(args.epochs),
                str(args.inner_epochs),
            ]
            log = open(runs / f"{job[0]}_seed{job[1]}.log", "w")
            running.append((job, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        time.sleep(0.5)
        for item in list(running):
            job, proc, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            result = runs / f"{job[0]}_seed{job[1]}" / "result.json"
            if proc.returncode != 0 or not result.is_file():
                print(f"FAILED {job} (see {log.name})", flush=True)
                failed.append(f"{job[0]} seed {job[1]}")
                continue
            row = json.loads(result.read_text())
            rows.append(row)
            print(
                f"{job[0]:13s} seed {job[1]}: acc {row['start_acc']:.3f} -> {row['final_acc']:.3f}  "
                f"{row['wall_s']:5.0f} s",
                flush=True,
            )
    rows.sort(key=lambda r: (objectives.index(r["objective"]), r["seed"]))
    return rows, failed


def single(objective: str, seed: int, epochs: int, inner_epochs: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    row = run_accuracy(objective, seed, epochs, inner_epochs, out)
    row.update(objective=objective, seed=seed, epochs=epochs, inner_epochs=inner_epochs)
    (out / "result.json").write_text(json.dumps(row))


# ----------------------------------------------------------------------------------------------
# part 2: loss time, flowrl vs trl
# ----------------------------------------------------------------------------------------------


def _tiny_trainers(folder: Path):
    """trl's `GRPOTrainer` and a `FlowrlGRPOTrainer` around a tiny Llama that never runs (the loss is stubbed)."""
    import copy

    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    from flowrl.llm.trl import FlowrlGRPOConfig, FlowrlGRPOTrainer

    chars = "abcdefghijklmnopqrstuvwxyz "
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2 * K,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    twin = copy.deepcopy(model)
    data = Dataset.from_dict({"prompt": ["abc", "xyz"]})
    common = dict(
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=K,
        gradient_accumulation_steps=1,
        save_strategy="no",
    )
    ref = GRPOTrainer(
        model,
        reward_funcs=_reward,
        args=GRPOConfig(output_dir=str(folder / "trl"), **common),
        train_dataset=data,
        processing_class=tokenizer,
    )
    ours = FlowrlGRPOTrainer(
        twin,
        reward_funcs=_reward,
        processing_class=tokenizer,
        train_dataset=data,
        args=FlowrlGRPOConfig(output_dir=str(folder / "flowrl"), **common),
    )
    for trainer in (ref, ours):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        trainer.args.steps_per_generation = 1
    return ref, ours


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def _timing_inputs(sequence_level: bool, seed: int = 0):
    """trl-format micro-batch with behaviour log-probs off the current ones (ratios leave the trust regions)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(K // 8, K + 1, (B,), generator=g)
    completion_mask = (torch.arange(K) < lengths[:, None]).long()
    logp = -3.0 * torch.rand(B, K, generator=g)
    entropy = 2.0 * torch.rand(B, K, generator=g)
    eps = 0.2 * torch.randn(B, K, generator=g)
    if sequence_level:  # zero-mean token noise per row, then a sequence log-ratio per row around the clip range
        m = completion_mask.float()
        eps = eps - (eps * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
        eps = eps + 2e-3 * torch.randn(B, 1, generator=g)
    inputs = {
        "prompt_ids": torch.randint(2, 29, (B, PROMPT_LEN), generator=g),
        "prompt_mask": torch.ones(B, PROMPT_LEN, dtype=torch.long),
        "completion_ids": torch.randint(2, 29, (B, K), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "old_per_token_logps": logp + eps,
        "num_items_in_batch": completion_mask.sum(),
    }
    return logp, entropy, inputs


def _flowrl_settings(case: str, ref) -> dict:
    from types import SimpleNamespace

    from flowrl.llm.trl import trl_loss_as_objective

    a = ref.args
    config = SimpleNamespace(
        loss_type=ref.loss_type,
        epsilon=ref.epsilon_low,
        epsilon_high=ref.epsilon_high,
        delta=a.delta,
        importance_sampling_level=ref.importance_sampling_level,
        max_completion_length=K,
        sapo_temperature_pos=a.sapo_temperature_pos,
        sapo_temperature_neg=a.sapo_temperature_neg,
        vespo_k_pos=a.vespo_k_pos,
        vespo_lambda_pos=a.vespo_lambda_pos,
        vespo_k_neg=a.vespo_k_neg,
        vespo_lambda_neg=a.vespo_lambda_neg,
    )
    return trl_loss_as_objective(config)


def _configure(ref, ours, case: str) -> dict:
    trl_attrs, args_attrs = TRL_CASES[case]
    defaults = {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.2, "importance_sampling_level": "token"}
    for key, value in {**defaults, **trl_attrs}.items():
        setattr(ref, key, value)
    for key, value in args_attrs.items():
        setattr(ref.args, key, value)
    settings = _flowrl_settings(case, ref)
    ours.args.objective = settings["objective"]
    ours.args.objective_kwargs = dict(settings["objective_kwargs"])
    ours.args.token_mean_normalizer = settings["token_mean_normalizer"]
    ours.objective_state = None
    return settings


def timing_part(args) -> dict:
    from collections import defaultdict

    import torch
    from trl import GRPOTrainer

    from flowrl.core import compute_policy_loss
    from flowrl.llm.trl import FlowrlGRPOTrainer

    torch.set_num_threads(args.threads)
    cases = args.loss_types.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        ref, ours = _tiny_trainers(Path(folder))
        holder = {}

        def stub(model, *a, **kw):
            return holder["logp"], holder["entropy"], None

        for trainer in (ref, ours):
            trainer._get_per_token_logps_and_entropies = stub

        def call(trainer, fn, inputs, base, entropy):
            logp = base.clone().requires_grad_(True)
            holder["logp"], holder["entropy"] = logp, entropy
            trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
            start = time.perf_counter()
            loss = fn(trainer, trainer.model, inputs)
            loss.backward()
            elapsed = time.perf_counter() - start
            return elapsed, loss.detach(), logp.grad

        def core(inputs, base, settings):
            logp = base.clone().requires_grad_(True)
            mask = inputs["completion_mask"].bool()
            kwargs = {**settings["objective_kwargs"]}
            start = time.perf_counter()
            loss, _ = compute_policy_loss(
                settings["objective"], logp, inputs["old_per_token_logps"], inputs["advantages"], mask, **kwargs
            )
            loss.backward()
            return time.perf_counter() - start

        for case in cases:
            settings = _configure(ref, ours, case)
            sequence = ref.importance_sampling_level == "sequence" or ref.loss_type == "vespo"
            base, entropy, inputs = _timing_inputs(sequence)
            _, loss_ref, grad_ref = call(ref, GRPOTrainer._compute_loss, inputs, base, entropy)
            _, loss, grad = call(ours, FlowrlGRPOTrainer._compute_loss, inputs, base, entropy)
            loss_err = abs(float(loss - loss_ref)) / max(abs(float(loss_ref)), 1e-12)
            grad_err = float((grad - grad_ref).abs().max() / grad_ref.abs().max().clamp(min=1e-30))
            ok = loss_err < 1e-4 and grad_err < 1e-4
            times = {"flowrl": [], "flowrl_full": [], "trl": [], "core": []}
            clip_kwargs = dict(ours.args.objective_kwargs)
            full_kwargs = {**clip_kwargs, "diagnostics": "full"}
            for i in range(args.warmup + args.repeats):
                order = [
                    ("flowrl", ours, FlowrlGRPOTrainer._compute_loss),
                    ("trl", ref, GRPOTrainer._compute_loss),
                    ("flowrl_full", ours, FlowrlGRPOTrainer._compute_loss),
                ]
                for side, trainer, fn in order if i % 2 == 0 else order[::-1]:
                    ours.args.objective_kwargs = full_kwargs if side == "flowrl_full" else clip_kwargs
                    elapsed = call(trainer, fn, inputs, base, entropy)[0]
                    if i >= args.warmup:
                        times[side].append(elapsed)
                elapsed = core(inputs, base, settings)
                if i >= args.warmup:
                    times["core"].append(elapsed)
            ours.args.objective_kwargs = clip_kwargs
            med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            row = {
                "loss_type": case,
                "flowrl_objective": settings["objective"],
                "flowrl_kwargs": settings["objective_kwargs"],
                "flowrl_ms": med["flowrl"],
                "trl_ms": med["trl"],
                "flowrl_full_ms": med["flowrl_full"],
                "core_ms": med["core"],
                "ratio": med["flowrl"] / med["trl"],
                "ratio_full": med["flowrl_full"] / med["trl"],
                "loss_rel_err": loss_err,
                "grad_rel_err": grad_err,
                "match": ok,
                "loss": float(loss_ref),
            }
            rows.append(row)
            print(
                f"{case:8s} flowrl {med['flowrl']:7.2f} ms  trl {med['trl']:7.2f} ms  ratio {row['ratio']:.2f}  "
                f"full diagnostics {med['flowrl_full']:7.2f} ms ({row['ratio_full']:.2f})  "
                f"core {med['core']:6.2f} ms  {'match' if ok else 'MISMATCH'} (loss {loss_err:.1e}, grad "
                f"{grad_err:.1e})",
                flush=True,
            )
    meta = {
        "B": B,
        "K": K,
        "dtype": "fp32",
        "device": "cpu",
        "threads": args.threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "trl": __import__("trl").__version__,
    }
    return {"meta": meta, "rows": rows}


def timing_table(timing: dict) -> str:
    lines = [
        "| loss type | flowrl objective | flowrl ms | trl ms | ratio flowrl/trl | flowrl, full diagnostics ms "
        "(ratio) | bare core ms | values match |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in timing["rows"]:
        lines.append(
            f"| {TRL_LABELS.get(r['loss_type'], r['loss_type'])} | {r['flowrl_objective']} | "
            f"{r['flowrl_ms']:.2f} | {r['trl_ms']:.2f} | {r['ratio']:.2f} | {r['flowrl_full_ms']:.2f} "
            f"({r['ratio_full']:.2f}) | {r['core_ms']:.2f} | {'yes' if r['match'] else 'NO'} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def markdown(data: dict) -> str:
    parts = []
    acc = data.get("accuracy")
    if acc:
        m = acc["meta"]
        parts += [
            f"## Greedy test accuracy on `arith/test` (256 problems), {len(m['seeds'])} seed(s)",
            "",
            accuracy_table(acc["runs"], m["objectives"]),
            "",
            f"Equal budgets: `configs/llm/arith_grpo.yaml` with `run.epochs={m['epochs']}`, "
            f"`inner_epochs={m['inner_epochs']}`, 32 prompts x 8 completions per epoch, lr 1e-4, minibatch 64, "
            f"seeds {', '.join(map(str, m['seeds']))}; only `objective.name` differs (dcpo_sas: also "
            "`advantage.estimator=sas`, DCPO's own advantages). Every objective keeps its "
            "published hyper-parameters (`get_objective(name).hparams`), the trust regions included (GSPO's "
            "sequence clip 3e-4 / 4e-4). clip frac: the trainer's `clipfrac` averaged over the epochs. train s: "
            "the epochs alone; wall s: one run (imports, build, both evaluations, training), "
            f"{m['jobs']} runs in parallel, one torch thread each ({m['cpu']}).",
        ]
        dates = m.get("dates", {})
        if len(set(dates.values())) > 1:  # rows merged from runs of different days (and code)
            by_day = {}
            for name, day in dates.items():
                by_day.setdefault(day, []).append(name)
            parts += [
                "",
                "Run on: " + "; ".join(f"{day}: {', '.join(names)}" for day, names in sorted(by_day.items())) + ".",
            ]
        if acc.get("failed"):
            parts += ["", f"Failed runs: {', '.join(acc['failed'])}."]
    timing = data.get("timing")
    if timing:
        m = timing["meta"]
        if parts:
            parts.append("")
        parts += [
            f"## Loss time, flowrl vs trl {m['trl']} (B={m['B']}, K={m['K']}, {m['dtype']}, {m['device']}, "
            f"{m['threads']} torch thread(s))",
            "",
            timing_table(timing),
            "",
            "Forward + backward of the loss alone (the model stubbed: per-token log-probs are a leaf with "
            "`requires_grad`), median of "
            f"{m['repeats']} calls after {m['warmup']} warm-up, flowrl and trl interleaved. flowrl: "
            "`FlowrlGRPOTrainer._compute_loss` (trl's code path with `flowrl.core.compute_policy_loss`), logging "
            'the clip fractions as trl does (the bridge\'s default `diagnostics="clip"`); full diagnostics: also '
            "the ratio mean/std/min/max and k3 KL; trl: `GRPOTrainer._compute_loss`; each includes its metrics. "
            "bare core: `compute_policy_loss` with its own aggregation and full diagnostics, no trainer. values "
            "match: loss and gradient equal to trl's (relative 1e-4).",
        ]
    return "\n".join(parts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="accuracy,timing", help="accuracy, timing or both")
    parser.add_argument("--objectives", help=f"default {','.join(OBJECTIVES)}")
    parser.add_argument("--seeds", help="default 0,1,2")
    parser.add_argument("--epochs", type=int, help=f"default {EPOCHS}")
    parser.add_argument("--inner-epochs", type=int, default=INNER_EPOCHS)
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs (one torch thread each)")
    parser.add_argument("--loss-types", default=",".join(TRL_CASES))
    parser.add_argument("--repeats", type=int, help="timed calls per loss type and side (default 50)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the timing part")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 1 seed, 2 objectives, 8 epochs, 5 repeats (unless given)"
    )
    parser.add_argument("--runs", default="/tmp/flowrl_llm_objectives", help="run folders")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs of the same epochs in --runs")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/llm_objectives[_quick].json)")
    parser.add_argument("--single", nargs=4, metavar=("OBJECTIVE", "SEED", "EPOCHS", "INNER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    runs = Path(args.runs)
    if args.single:
        objective, seed, epochs, inner = args.single
        single(objective, int(seed), int(epochs), int(inner), runs / f"{objective}_seed{seed}")
        return 0
    defaults = {"objectives": ",".join(OBJECTIVES), "seeds": "0,1,2", "epochs": EPOCHS, "repeats": 50, "warmup": 5}
    if args.quick:  # what the command line does not set
        defaults.update(objectives="grpo,bapo", seeds="0", epochs=8, repeats=5, warmup=2)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    out = Path(args.out or RESULTS / f"llm_objectives{'_quick' if args.quick else ''}.json")
    parts = args.parts.split(",")
    data = json.loads(out.read_text()) if out.is_file() else {}  # a part not run keeps its stored results
    ok = True
    if "accuracy" in parts:
        rows, failed = accuracy_part(args, runs)
        meta = {
            "objectives": args.objectives.split(","),
            "seeds": [int(s) for s in args.seeds.split(",")],
            "epochs": args.epochs,
            "inner_epochs": args.inner_epochs,
            "jobs": args.jobs,
            "threads_per_job": 1,
            "overrides": overrides("<objective>", "<seed>", args.epochs, args.inner_epochs),
            "cpu": _cpu(),
            "date": time.strftime("%Y-%m-%d"),
        }
        stored = data.get("accuracy")
        if stored and all(stored["meta"].get(k) == meta[k] for k in ("seeds", "epochs", "inner_epochs")):
            rows, meta = _merge(stored, rows, meta)  # a subset of objectives replaces their rows only
        data["accuracy"] = {"meta": meta, "runs": rows, "failed": failed}
        ok &= not failed and not any(math.isnan(r["final_acc"]) for r in rows)
    if "timing" in parts:
        data["timing"] = timing_part(args)
        data["timing"]["meta"].update(cpu=_cpu(), date=time.strftime("%Y-%m-%d"))
        ok &= all(r["match"] for r in data["timing"]["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    text = markdown(data)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0 if ok else 1


def _merge(stored: dict, rows: list[dict], meta: dict) -> tuple[list[dict], dict]:
    """Stored accuracy rows with the objectives just run replaced; each objective keeps the date it was run."""
    new = meta["objectives"]
    old = stored["meta"]["objectives"]
    dates = stored["meta"].get("dates") or {o: stored["meta"]["date"] for o in old}
    meta = {
        **meta,
        "objectives": [*old, *(o for o in new if o not in old)],
        "dates": {**dates, **{o: meta["date"] for o in new}},
    }
    return [r for r in stored["runs"] if r["objective"] not in new] + rows, meta


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
