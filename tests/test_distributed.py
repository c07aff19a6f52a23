"""Many processes equal one: `torchrun --nproc_per_node 2` on CPUs forms one gloo group of two, and the same
config trains on two processes as on one, the same optimizer steps, per-step statistics, weights and evaluation
(the batch contract, docs/distributed.md). The `distributed` tier: `python -m pytest -m distributed`."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from . import launch
from .conftest import DIGITS_BASE, TINY_DIGITS_RUN


pytestmark = pytest.mark.distributed

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

RUN = {"epochs": 2, "save_every": 1, "samples_every": 0, "log_with": [], "threads": 1, "plots": False}
"""Two epochs, a checkpoint after each, one thread per process (two processes on two cores), no PNG curves."""

TRAINERS = {
    "flow_grpo": {"trainer": "flow_grpo"},
    "grpo_guard": {"trainer": "grpo_guard"},
    "find": {"trainer": "find", "sampling": {"sampler": "ode"}},
    "dpok": {
        "trainer": "dpok",
        "buffer_size": 48,
        "policy_steps": 2,
        "prompts": {"group_size": 1},
        "batch": {"mini_batch_size": 16, "micro_batch_size": 8},
        "critic": {"steps": 2, "mini_batch_size": 16},
    },
    "loop": {"trainer": "loop"},
    "diffusion_nft": {"trainer": "diffusion_nft", "num_draws": 2},
    "awm": {"trainer": "awm", "num_draws": 1},
    "image_fpo": {"trainer": "image_fpo", "num_draws": 2},
    "acflow": {"trainer": "acflow", "num_draws": 2},
}
"""Each trainer's changes to the tiny digits run (the same config for one process and two)."""


@pytest.fixture(scope="module")
def cache(session_cache):
    """The session's cache: the first run needing the digits model builds it (under its lock), the others read it."""
    return Path(session_cache)


def _config(tmp_path, trainer: str, processes: int, shard: str = "none", ema: bool = False):
    data = json.loads(json.dumps(TINY_DIGITS_RUN))
    if ema:  # an EMA of the trained weights, updated every step (FSDP2 keeps it sharded like the weights)
        data.update(ema_decay=0.9, ema_every=1)
    data["prompts"] = {"prompts_per_epoch": 4, "group_size": 4}  # 16 samples per epoch
    for key, value in TRAINERS[trainer].items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    data["run"] = {**RUN, "shard": shard}
    data["eval"] = {**data["eval"], "max_prompts": 4, "samples_per_prompt": 2}
    path = tmp_path / f"{trainer}-{processes}-{shard}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _launch(config, out, cache, processes: int, resume: bool = False, overrides=()):
    """Start `flowrl train` on `processes` processes, forked from the session's forkserver (tests/launch.py); its
    output goes to a log beside `out`."""
    env = {**os.environ, "FLOWRL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    sets = [arg for item in overrides for arg in ("--set", item)]
    argv = ["train", str(config), "--output-dir", str(out), *sets, *(["--resume"] if resume else [])]
    log = out.parent / f"{out.name}.log"
    return launch.start(argv, env, log, processes), out, log


def _finish(launched, out, log) -> dict:
    code = launched.wait(timeout=600)
    assert code == 0, log.read_text()[-3000:]
    return json.loads((out / "summary.json").read_text())


def _train(config, out, cache, processes: int, resume: bool = False, overrides=()) -> dict:
    return _finish(*_launch(config, out, cache, processes, resume, overrides))


def _train_together(*runs: dict) -> list[dict]:
    """`_train` of each run (its keyword arguments), all started at once: the one-process reference beside the
    two-process run puts three processes on the CI's two cores, which the pair alone leaves half idle while it
    waits on its collectives (the runs share nothing but the digits cache, which is built once under a lock)."""
    started = [_launch(**run) for run in runs]
    return [_finish(*one) for one in started]


def _weights(run, epoch: int) -> dict[str, torch.Tensor]:
    folder = run / "checkpoints" / f"epoch_{epoch}" / "accelerate"
    tensors = {}
    for file in sorted(folder.glob("model*.safetensors")):
        tensors.update({f"{file.name}:{k}": v for k, v in load_file(file).items()})
    assert tensors, f"no model weights in {folder}"
    return tensors


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _two_equals_one(tmp_path, cache, trainer: str) -> None:
    one, two = _train_together(
        dict(config=_config(tmp_path, trainer, 1), out=tmp_path / "one", cache=cache, processes=1),
        dict(config=_config(tmp_path, trainer, 2), out=tmp_path / "two", cache=cache, processes=2),
    )
    assert (one["processes"], two["processes"]) == (1, 2)  # a real group of two, not two lone runs

    # the same samples, rewards and advantages: noise is seeded per sample, rewards are gathered
    rows_one, rows_two = _same_rows(tmp_path / "one", tmp_path / "two", "reward_evals")
    for key in ("eval/digits_gold", "eval/reward"):
        assert rows_one[-1][key] == pytest.approx(rows_two[-1][key], rel=1e-3, abs=1e-4), key

    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(1, 2))


def _same_weights(one, two, epochs: tuple[int, ...], sharded: bool = False) -> None:
    """Both runs' weights, the same names within 1e-4 after each of `epochs` (`sharded`: `two`'s full model
    gathered from the shards), and the later epoch changed some weight (else the test would be vacuous; of one
    epoch the caller checks that it stepped)."""
    for epoch in epochs:
        w1 = _weights(one, epoch)
        if sharded:
            # the trained module (an algorithm's auxiliary networks, in model_1.safetensors ..., are not sharded)
            w1 = {k.split(":", 1)[1]: v for k, v in w1.items() if k.startswith("model.safetensors:")}
            w2 = _sharded_weights(two, epoch)
        else:
            w2 = _weights(two, epoch)
        assert w1.keys() == w2.keys()
        for name in w1:
            torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-5, msg=f"epoch {epoch}: {name}")
    if len(epochs) > 1:
        before, after = _weights(one, epochs[0]), _weights(one, epochs[1])
        assert any(not torch.equal(before[k], after[k]) for k in after), f"epoch {epochs[1]} changed no weight"


def _same_rows(one, two, *keys: str, epochs: int = 2) -> tuple[list[dict], list[dict]]:
    """Both runs' metrics rows, checked: one row for the baseline evaluation and one per epoch (one writer), the
    same rewards, advantage statistics (and `keys`) and pooled training diagnostics every epoch."""
    rows_one, rows_two = _rows(one), _rows(two)
    assert [r["epoch"] for r in rows_two] == [r["epoch"] for r in rows_one] == list(range(epochs + 1))
    for a, b in zip(rows_one[1:], rows_two[1:]):
        advantages = [k for k in a if k.startswith("adv/")]
        for key in ["reward/mean", "reward/std", "trained_samples", "optimizer_steps", *keys, *advantages]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (key, a[key], b[key])
        # the training diagnostics are the whole epoch's, pooled over the processes (not rank 0's share)
        _same_diagnostics(a, b)
    return rows_one, rows_two


DIAGNOSTICS = ("loss", "pg_loss", "clipfrac", "approx_kl", "ratio_mean", "grad_norm", "value_loss")


def _same_diagnostics(a: dict, b: dict) -> None:
    keys = [k for k in a if k in DIAGNOSTICS or k.startswith(("ratio_mean/step_", "clipfrac/step_"))]
    assert "loss" in keys and "grad_norm" in keys, sorted(a)
    for key in keys:
        assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (key, a[key], b[key])


def test_two_processes_equal_one_flow_grpo(tmp_path, cache):
    # forked, as every run here (tests/launch.py); `torchrun` itself starts the runs of tests/test_learner_group.py
    # (docs/distributed.md's several-machines command and docs/async.md's learner group)
    _two_equals_one(tmp_path, cache, "flow_grpo")


@pytest.mark.parametrize(
    "trainer",
    [
        # LOOP and DiffusionNFT at tiny size in this tier (DiffusionNFT's sampling policy is its own state, synced
        # after each epoch: the second epoch samples with it); their shipped sizes (20-45 s each) in the slow tier
        "loop",
        "diffusion_nft",
        *(pytest.param(name, marks=pytest.mark.slow) for name in ("grpo_guard", "find", "dpok")),
    ],
)
def test_two_processes_equal_one(tmp_path, cache, trainer):
    _two_equals_one(tmp_path, cache, trainer)


SHIPPED_RUN = [
    "run.epochs=2",
    "run.save_every=1",
    "run.samples_every=0",
    "run.threads=1",
    "run.plots=false",
    "eval.every=2",
    "eval.max_prompts=8",
    "total_env_steps=null",
]
"""What the shipped-config runs change: two epochs (one thread per process), checkpoints after each, one held-out
evaluation at the end; the algorithm (prompts, groups, steps, mini-batches, inner epochs, objective) and the digits
model's architecture as shipped, its base pretrained for 2 steps instead of 220 (`DIGITS_BASE`: the equality of one
and two processes does not depend on the base, and the full build would cost this tier about a minute)."""

ONE_EPOCH = ("llm/arith_grpo",)
"""Shipped configs trained one epoch: what text GRPO carries into a second epoch (the weights, AdamW's moments, the
seeds' streams) is the engine's, which grpo_guard's two epochs check; the pendulum's running statistics (and, in the
slow tier, DiffusionNFT's sampling policy) are their own and keep two epochs."""
ONE_EPOCH_RUN = ["run.epochs=1", "eval.every=1"]


@pytest.mark.parametrize(
    "name",
    [
        "digits/grpo_guard",
        "control/pendulum_ppo",
        "llm/arith_grpo",
        # DPOK, LOOP and DiffusionNFT on two processes run at tiny size in this tier (test_two_processes_equal_one,
        # test_two_sharded_processes_equal_one[dpok-fsdp2]); their shipped sizes in the slow tier
        *(
            pytest.param(name, marks=pytest.mark.slow)
            for name in ("digits/loop", "digits/diffusion_nft", "digits/dpok")
        ),
    ],
)
def test_a_shipped_config_trains_the_same_on_two_processes(tmp_path, cache, name):
    if name.startswith("control"):
        pytest.importorskip("gymnasium")
    path = CONFIGS / f"{name}.yaml"
    overrides = [o for o in SHIPPED_RUN if name.startswith("control") or not o.startswith("total_env_steps")]
    epochs = 1 if name in ONE_EPOCH else 2
    if epochs == 1:
        overrides = [o for o in overrides if not o.startswith(("run.epochs", "eval.every"))] + ONE_EPOCH_RUN
    if name.startswith("digits"):
        overrides += DIGITS_BASE
    if name.startswith("control"):
        overrides = [o for o in overrides if not o.startswith(("run.samples_every", "eval.max_prompts"))]
        overrides += ["eval.episodes=2"]
    one, two = _train_together(
        dict(config=path, out=tmp_path / "one", cache=cache, processes=1, overrides=overrides),
        dict(config=path, out=tmp_path / "two", cache=cache, processes=2, overrides=overrides),
    )
    assert (one["processes"], two["processes"]) == (1, 2)
    rows_one, rows_two = _same_rows(tmp_path / "one", tmp_path / "two", epochs=epochs)
    assert rows_one[1]["optimizer_steps"] >= 2 and rows_one[1]["grad_norm"] > 0  # it stepped: its weights moved
    if name == "digits/grpo_guard":  # the trust region acts on two processes as on one
        assert rows_two[1]["clipfrac"] > 0
    assert rows_one[-1]["eval/reward"] == pytest.approx(rows_two[-1]["eval/reward"], rel=1e-3, abs=1e-4)
    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(1, 2)[:epochs])


def _sharded_weights(run, epoch: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"epoch_{epoch}" / "sharded_model.safetensors")


@pytest.mark.parametrize(
    ("trainer", "shard"),
    [
        ("flow_grpo", "fsdp2"),
        ("flow_grpo", "zero2"),
        ("flow_grpo", "zero3"),
        ("dpok", "fsdp2"),
        *(
            pytest.param(name, "fsdp2", marks=pytest.mark.slow)
            for name in ("grpo_guard", "loop", "diffusion_nft", "awm", "image_fpo", "acflow")
        ),
        pytest.param("grpo_guard", "zero3", marks=pytest.mark.slow),
    ],
)
def test_two_sharded_processes_equal_one(tmp_path, cache, trainer, shard):
    # on CPUs, over a gloo group of two: FSDP2 and ZeRO-3 shard the parameters, gradients and AdamW state, ZeRO-2
    # the gradients and AdamW state; every backward (and, sharded parameters, every forward) is a collective, so
    # the processes' calls must stay in step through sampling, the update and the evaluation
    ema = trainer == "flow_grpo" and shard != "zero3"  # ZeRO-3 partitions the parameters: no EMA there (refused)
    one, two = _train_together(
        dict(config=_config(tmp_path, trainer, 1, ema=ema), out=tmp_path / "one", cache=cache, processes=1),
        dict(
            config=_config(tmp_path, trainer, 2, shard=shard, ema=ema), out=tmp_path / "two", cache=cache, processes=2
        ),
    )
    assert (one["processes"], two["processes"]) == (1, 2) and (one["shard"], two["shard"]) == ("none", shard)
    _same_rows(tmp_path / "one", tmp_path / "two")
    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(1, 2), sharded=True)
    if ema:  # the EMA (sharded with the weights under FSDP2) is the one-process run's, gathered in the checkpoint
        for epoch in (1, 2):
            a, b = (
                load_file(run / "checkpoints" / f"epoch_{epoch}" / "extra.safetensors")
                for run in (tmp_path / "one", tmp_path / "two")
            )
            keys = [k for k in a if k.startswith("ema.")]
            assert keys and keys == [k for k in b if k.startswith("ema.")]
            for key in keys:
                torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=f"epoch {epoch}: {key}")
    # resuming the sharded run from epoch 1 (the full states scattered back into the shards) continues exactly
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "two" / "checkpoints" / "epoch_1", resumed / "checkpoints" / "epoch_1")
    shutil.copy(tmp_path / "two" / "config.yaml", resumed / "config.yaml")  # a resume reads the run's own config
    _train(_config(tmp_path, trainer, 2, shard=shard, ema=ema), resumed, cache, processes=2, resume=True)
    again, straight = _sharded_weights(resumed, 2), _sharded_weights(tmp_path / "two", 2)
    for name in straight:
        torch.testing.assert_close(again[name], straight[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("shard", ["fsdp2", pytest.param("zero3", marks=pytest.mark.slow)])
def test_offloaded_shards_train_as_one_process(tmp_path, cache, shard):
    # run.offload: the shards, gradients and optimizer state in CPU memory (FSDP2's CPUOffloadPolicy, ZeRO-Offload);
    # on a CPU machine the copies are CPU to CPU, so this checks the plumbing: the same training as one process
    one, two = _train_together(
        dict(config=_config(tmp_path, "flow_grpo", 1), out=tmp_path / "one", cache=cache, processes=1),
        dict(
            config=_config(tmp_path, "flow_grpo", 2, shard=shard),
            out=tmp_path / "two",
            cache=cache,
            processes=2,
            overrides=["run.offload=true"],
        ),
    )
    assert (one["processes"], two["processes"], two["shard"]) == (1, 2, shard)
    _same_rows(tmp_path / "one", tmp_path / "two")
    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(1, 2), sharded=True)


@pytest.mark.parametrize("shard", ["fsdp2", "zero2", pytest.param("zero3", marks=pytest.mark.slow)])
def test_sharded_bf16_rescoring_gives_ratio_one_before_the_first_update(tmp_path, cache, shard):
    # bf16 under sharding: the rollout and the update both forward the sharded model under autocast (FSDP2 also
    # gathers bf16 parameters), so before the first step the re-scored log-probs are the rollout's: ratio exactly 1
    losses = []
    for precision in ("no", "bf16"):
        path = _config(tmp_path, "grpo_guard", 2, shard=shard)
        data = yaml.safe_load(path.read_text())
        data["run"] = {**data["run"], "epochs": 1, "mixed_precision": precision}
        data["batch"] = {"mini_batch_size": 16, "micro_batch_size": 4, "inner_epochs": 1}  # one step: old weights
        path.write_text(yaml.safe_dump(data))
        out = tmp_path / f"run-{precision}"
        summary = _train(path, out, cache, processes=2)
        assert summary["shard"] == shard
        row = [r for r in _rows(out) if r.get("optimizer_steps")][0]
        assert row["optimizer_steps"] == 1 and row["ratio_mean"] == 1.0 and row["clipfrac"] == 0.0, (precision, row)
        assert math.isfinite(row["loss"]) and row["grad_norm"] > 0
        losses.append(row["loss"])
    assert losses[0] != losses[1]  # bf16 did act (the same seeds, other rounding)


TINY_MODEL_CONFIGS = ["sd35m", "wan"]
"""An image family's and a video family's tiny-model config (`configs/<folder>/tiny.yaml`), as shipped."""


@pytest.mark.parametrize("folder", TINY_MODEL_CONFIGS)
def test_a_tiny_model_config_trains_the_same_on_two_processes(tmp_path, cache, folder):
    # the real diffusers classes at toy sizes (model.name tiny:<family>): text encoders, VAE, LoRA, CFG, and for
    # video 5-D latents; rollouts split over the processes, rewards gathered, the update summed
    # One epoch: the tiny configs' rewards (JPEG sizes) jump with the last bit of an image, so the second epoch's
    # rewards would differ by reduction order alone; the first epoch's samples come from the same weights
    config = Path(__file__).resolve().parents[1] / "configs" / folder / "tiny.yaml"
    one, two = _train_together(
        dict(config=config, out=tmp_path / "one", cache=cache, processes=1, overrides=["run.epochs=1"]),
        dict(config=config, out=tmp_path / "two", cache=cache, processes=2, overrides=["run.epochs=1"]),
    )
    assert (one["processes"], two["processes"]) == (1, 2)
    (_, a), (_, b) = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    for key in ["reward/mean", "reward/std", "trained_samples", "optimizer_steps"]:
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    _same_diagnostics(a, b)
    w1, w2 = _weights(tmp_path / "one", 1), _weights(tmp_path / "two", 1)
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in w1.items())  # the adapter (zero at first) trained


CONTROL = {
    "env": {
        "id": "flowrl/BimodalPointMass-v0",
        "num_envs": 4,
        "steps_per_env": 60,
        "normalize_obs": True,
        "normalize_reward": True,
    },
    "batch": {"mini_batch_size": 48, "micro_batch_size": 48, "inner_epochs": 2},
    "objective": {"target_kl": 0.05},
    "run": {**RUN, "epochs": 3, "save_every": 1},
    "eval": {"episodes": 4, "every": 0},
}
"""Four environments (two per process) whose 50-step episodes end inside an epoch, both normalisers on, and
target_kl (a global decision): every piece of the control update that could differ by process count."""


def _control_two_equals_one(tmp_path, trainer: str) -> None:
    config = tmp_path / f"{trainer}.yaml"
    config.write_text(yaml.safe_dump({"trainer": trainer, **CONTROL}))
    one, two = _train_together(
        dict(config=config, out=tmp_path / "one", cache=tmp_path, processes=1),
        dict(config=config, out=tmp_path / "two", cache=tmp_path, processes=2),
    )
    assert (one["processes"], two["processes"]) == (1, 2)
    rows_one, rows_two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["epoch"] for r in rows_two] == [r["epoch"] for r in rows_one] == [0, 1, 2, 3]
    for a, b in zip(rows_one[1:], rows_two[1:]):
        # every environment's episodes (two of them stepped by each process) and the whole rollout's values
        assert a["episodes"] == b["episodes"] > 0 and a["env_steps"] == b["env_steps"] == 240 * a["epoch"]
        for key in ("reward/mean", "reward/std", "episode_length", "explained_variance", "value_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (key, a[key], b[key])
        assert a.get("early_stop_epoch") == b.get("early_stop_epoch")
        _same_diagnostics(a, b)
    assert rows_one[-1]["eval/reward"] == pytest.approx(rows_two[-1]["eval/reward"], rel=1e-3, abs=1e-4)
    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(2, 3))  # the two checkpoints kept
    # the normalisers' statistics (every environment's observations and returns) travel in the checkpoints
    s1 = load_file(tmp_path / "one" / "checkpoints" / "epoch_3" / "extra.safetensors")
    s2 = load_file(tmp_path / "two" / "checkpoints" / "epoch_3" / "extra.safetensors")
    for name in [k for k in s1 if k.startswith("normalizer.")]:
        torch.testing.assert_close(s2[name], s1[name], rtol=1e-6, atol=1e-8, msg=name)


def test_two_processes_equal_one_control_fpo(tmp_path):
    pytest.importorskip("gymnasium")
    _control_two_equals_one(tmp_path, "fpo")


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["ppo", "dppo"])
def test_two_processes_equal_one_control(tmp_path, trainer):
    pytest.importorskip("gymnasium")
    _control_two_equals_one(tmp_path, trainer)


TEXT = {
    "trainer": "text",
    "prompts": {"prompts_per_epoch": 8, "group_size": 4},
    "generation": {"max_new_tokens": 4},
    "batch": {"inner_epochs": 2},
    "run": {**RUN, "epochs": 2},
    "eval": {"every": 0, "max_prompts": 16},
}
"""32 completions of 8 prompts per epoch, 2 inner epochs."""


def _text_config(tmp_path, objective: str, mini: int = 16, micro: int = 16):
    data = json.loads(json.dumps(TEXT))
    data["objective"] = {"name": objective}
    data["batch"] = {**data["batch"], "mini_batch_size": mini, "micro_batch_size": micro}
    path = tmp_path / f"text-{objective}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("objective", "mini", "micro"),
    [
        ("grpo", 16, 16),
        pytest.param("dapo", 16, 16, marks=pytest.mark.slow),
        # objectives reading batch statistics (the ratio variance and its dual variable; the global entropy
        # quantile): every call reduces over the processes. Mini-batches of 2 completions, one per process on
        # average, so a process often holds none of a mini-batch and must still take part in the call; and
        # mini-batches of 8 in micro-batches of 2, the two-pass coefficient path on each process.
        pytest.param("r2vpo", 2, 2, marks=pytest.mark.slow),
        pytest.param("high_entropy", 8, 2, marks=pytest.mark.slow),
    ],
)
def test_two_processes_equal_one_text(tmp_path, cache, objective, mini, micro):
    config = _text_config(tmp_path, objective, mini, micro)
    one, two = _train_together(
        dict(config=config, out=tmp_path / "one", cache=cache, processes=1),
        dict(config=config, out=tmp_path / "two", cache=cache, processes=2),
    )
    assert (one["processes"], two["processes"]) == (1, 2)
    # the same completions (sampled row by row from the same seeds), rewards and advantages
    rows_one, rows_two = _same_rows(tmp_path / "one", tmp_path / "two")
    assert rows_one[-1]["eval/reward"] == pytest.approx(rows_two[-1]["eval/reward"], abs=1e-6)
    _same_weights(tmp_path / "one", tmp_path / "two", epochs=(1, 2))
