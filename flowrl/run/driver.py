"""The run driver: a trainer assembled from its parts, and the loop that calls them in named phases.

`Trainer(config)` builds the parts of a run: the **engine** (device, precision, processes, sharding, optimizers;
`flowrl.run.engine`), the **modality** (policy, rewards, prompt sets: `flowrl.image`, `flowrl.control`,
`flowrl.llm`), the **algorithm** (advantages, the loss for a batch, extra models: the registered class), its
**collector** and **evaluator**, and the **update scheduler** (`flowrl.run.scheduler`). `train()` then runs
epochs (`flowrl.run.run_loop`):

    collect -> check -> advantages -> prepare -> update -> finish -> evaluate / log / checkpoint

with evaluations every `eval.every` epochs (and before the first and after the last), checkpoints every
`run.save_every`, the best evaluation kept and the over-optimisation brake (`flowrl.run.run_folder.Watch`).
Everything random is seeded per epoch, so a resumed run continues exactly.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from flowrl import checkpoint
from flowrl.run import run_folder
from flowrl.run.engine import Engine
from flowrl.run.registry import TRAINERS
from flowrl.run.scheduler import UpdateScheduler
from flowrl.run.state import RunState
from flowrl.sections import HasGroupFilter, HasKL, PromptedConfig
from flowrl.tracking import MetricsLog


class Trainer:
    """See the module docstring.

    Args:
        config: a trainer config (`flowrl.run.registry.load_config`).
        policy (*optional*): use this policy instead of loading `config.model`.
        reward_fns, eval_fns (`dict`, *optional*): the training rewards and gold metrics by name.
        output_dir (*optional*): the run folder (default: `run.output_dir`).
    """

    def __init__(
        self, config, *, policy=None, reward_fns: dict | None = None, eval_fns: dict | None = None, output_dir=None
    ):
        algorithm_class = TRAINERS.get(config.trainer)
        if not isinstance(config, algorithm_class.config_class):
            raise TypeError(
                f"trainer {config.trainer!r} needs a {algorithm_class.config_class.__name__}, got "
                f"{type(config).__name__}"
            )
        self.config = config
        run = config.run
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.output_dir = Path(output_dir or run.output_dir.format(trainer=config.trainer, time=stamp))
        self.engine = Engine(
            run, config.optim, self.output_dir, ema_decay=config.ema_decay, ema_every=config.ema_every
        )
        self.state = RunState(trainer=config.trainer)
        self.modality = algorithm_class.modality_class(
            config,
            self.engine.context(),
            policy=policy,
            reward_fns=reward_fns,
            eval_fns=eval_fns,
            memory=self.engine.memory,
        )
        self.algorithm = algorithm_class(config, self.modality, self.engine)
        if self.algorithm.needs_reference():
            self.modality.ensure_reference(offload=isinstance(config, HasKL) and config.kl.reference_offload)
        check_world(config, algorithm_class, self.engine.processes.world, self.engine.shard)
        self.algorithm.build()
        module = self.algorithm.trained_module()
        refusals = [self.algorithm.shard_refusal] if self.algorithm.shard_refusal else []
        model = self.engine.prepare(
            module,
            aux=self.algorithm.auxiliary_modules(),
            refusals=refusals,
            optimizer_options=self.algorithm.optimizer_options,
        )
        if module is getattr(self.policy, "model", None):
            self.policy.forward_module = model  # training forwards go through the (DDP-)prepared module
        self.collector = self.algorithm.collector()
        if run.mode == "async":
            self.collector = self._async_collector()
        self.evaluator = self.algorithm.evaluator()
        self.scheduler = UpdateScheduler(
            config.batch, self.engine, self.algorithm, run.seed, grad_norms_every=config.optim.step_grad_norms_every
        )
        self.watch = run_folder.Watch(config.eval, self.state)
        self.log: MetricsLog | None = None
        self.last_batch = None  # the latest epoch's collected batch (main process), for its samples

    @property
    def policy(self):
        return self.modality.policy

    @property
    def is_main(self) -> bool:
        return self.engine.is_main

    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return self.state.epoch

    @property
    def model(self) -> torch.nn.Module:
        """The trained module as training forwards call it (DDP-prepared, sharded or inside a ZeRO engine)."""
        return self.engine.model

    @property
    def ema(self):
        return self.engine.ema

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The trained parameters (what the optimizer steps)."""
        return self.engine.params

    @property
    def optimizer(self):
        return self.engine.optimizer

    # ------------------------------------------------------------------------------------------
    # one epoch
    # ------------------------------------------------------------------------------------------

    def prepare_epoch(self, epoch: int):
        """collect -> check -> advantages -> prepare: `(UpdateBatch, collected, record)` of epoch `epoch`, nothing
        trained yet (the update's input, for `train_epoch` and for inspecting a loss)."""
        engine, algorithm = self.engine, self.algorithm
        algorithm.epoch = epoch
        engine.model.eval()
        collected = self.collector.collect(epoch)
        if collected.prompts is not None:
            from flowrl.prompts import group_key  # a prompt's text; editing: its (text, source images) pair

            keys = algorithm.group_keys([group_key(p) for p in collected.prompts])
            unique = {key: i for i, key in enumerate(dict.fromkeys(keys))}
            collected.group_ids = torch.tensor([unique[key] for key in keys])
        valid, record = self.modality.check(collected)
        advantages, adv_stats = algorithm.advantages(collected, valid)
        trainable = valid.clone()
        if isinstance(self.config, HasGroupFilter) and self.config.drop_zero_std_groups:
            trainable &= informative_groups(collected.group_ids, advantages, valid)
        batch, prepared = algorithm.prepare(collected, advantages, trainable, epoch)
        record = {
            **record,
            **{f"adv/{k}": v for k, v in adv_stats.items()},
            "trained_samples": int(trainable.sum()),
            **prepared,
        }
        return batch, collected, record

    def train_epoch(self, epoch: int) -> dict:
        """`prepare_epoch` -> update -> finish; returns the epoch's metrics row."""
        start = time.time()
        engine = self.engine
        threads = engine.threads.adjust()
        lr = self.config.optim.lr_at(epoch, self.config.run.epochs)
        engine.set_lr(lr)
        engine.epoch = epoch + 1
        engine.memory.start()
        batch, collected, record = self.prepare_epoch(epoch)
        self.state.samples_scored += collected.size
        t0 = time.time()
        # every process updates when any sample trains: the gradient reductions need all of them
        train = (
            self.scheduler.run(batch, epoch) if batch.trainable.any() or batch.mini_batches else {"optimizer_steps": 0}
        )
        train.update(self.algorithm.finish(batch, epoch))
        if self.config.run.mode == "async":
            train.update(self.collector.updated(epoch) or {})  # the workers get the new weights when due
        row = {
            "epoch": epoch + 1,
            **record,
            self.modality.budget_key: self.state.samples_scored,
            "nonfinite_steps": engine.nonfinite_steps,
            "lr": lr,
            "threads": threads,
            **train,
            **collected.times,
            **engine.memory.mark("update"),
            "time/train_s": time.time() - t0,
            "time_s": time.time() - start,
        }
        self.last_batch = collected if self.is_main else None
        return row

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The evaluator on the current (or EMA) weights."""
        self.engine.model.eval()
        with self.engine.evaluation_weights():
            return self.evaluator.evaluate()

    def log_samples(self) -> None:
        """The latest epoch's samples (images, completions, the bimodal action field) into the run folder."""
        if self.is_main and self.last_batch is not None:
            self.modality.log_samples(self.last_batch, self.output_dir, self.epoch, self.engine.accelerator.trackers)

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------

    def train(self, resume: str | Path | bool | None = None, overwrite: bool = False) -> dict:
        """Run (or resume) training to `run.epochs`; returns the summary (`flowrl.run.run_loop.RunLoop`).

        Args:
            resume: `True` continues the run folder's latest checkpoint, a path continues that checkpoint.
            overwrite (`bool`): start afresh in a run folder that already holds a run, deleting its checkpoints,
                metrics, images, plots and events (without it, such a folder is refused: nothing is lost).

        A fresh run that fails before its first epoch ends leaves nothing behind in its folder.
        """
        from flowrl.run.run_loop import RunLoop

        try:
            return RunLoop(self).run(resume, overwrite)
        finally:
            close = getattr(self.collector, "close", None)  # rollout workers, environment worker processes
            if close is not None:
                close()

    def _async_collector(self):
        """`run.mode: async`: the collector that takes each epoch's batch from rollout workers (Ray actors, or one
        in this process with `asynchrony.backend: inline`)."""
        from flowrl.run.async_rollouts import AsyncCollector
        from flowrl.run.inline_rollouts import InlineCollector

        if self.engine.processes.world > 1 and self.config.asynchrony.backend == "inline":
            raise ValueError(
                "asynchrony.backend: inline runs one learner process; a torchrun learner group samples "
                "on Ray rollout workers (asynchrony.backend: ray)"
            )
        return (InlineCollector if self.config.asynchrony.backend == "inline" else AsyncCollector)(self)

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """flowrl's own resumable state: `(JSON part, tensor part)` of the run, the algorithm and the modality."""
        self.state.optimizer_steps = self.engine.optimizer_steps
        self.state.nonfinite_steps = self.engine.nonfinite_steps
        algo_state, algo_tensors = self.algorithm.state_dict()
        state = {**self.state.to_json(), **algo_state}
        tensors = {**(self.engine.ema.state_dict() if self.engine.ema is not None else {}), **algo_tensors}
        tensors.update({f"modality.{k}": v for k, v in self.modality.state_dict().items()})
        return state, tensors

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        if state.get("trainer") != self.config.trainer:
            found, wanted = state.get("trainer"), self.config.trainer
            raise checkpoint.CheckpointError(f"checkpoint is from trainer {found!r}, not {wanted!r}")
        try:
            self.algorithm.load_state_dict(state, tensors)
        except KeyError as err:
            raise checkpoint.CheckpointError(str(err.args[0])) from None
        self.state = self.watch.state = RunState.from_json(state)
        self.engine.optimizer_steps = self.state.optimizer_steps
        self.engine.nonfinite_steps = self.state.nonfinite_steps
        if self.log is not None:
            self.log.history = self.state.metrics
        if self.engine.ema is not None:
            self.engine.ema.load_state_dict(tensors)
        modality = {k.removeprefix("modality."): v for k, v in tensors.items() if k.startswith("modality.")}
        self.modality.load_state_dict(modality)

    def with_earlier(self, err: Exception, path) -> checkpoint.CheckpointError:
        """`err` with the newest verified checkpoint older than `path` offered in its message."""
        earlier = checkpoint.previous_verified(self.output_dir, path)
        hint = f"; the previous verified checkpoint is {earlier} (--resume {earlier})" if earlier else ""
        return checkpoint.CheckpointError(f"{err}{hint}")

    def save_checkpoint(self, wall_s: float = 0.0) -> Path:
        self.state.wall_s = wall_s
        state, tensors = self.state_dict()
        folder = self.output_dir / "checkpoints" / f"epoch_{self.epoch}"
        return checkpoint.save(
            folder,
            self.engine.accelerator,
            state,
            tensors,
            keep=self.config.run.keep_checkpoints,
            files=self.engine.state_files(),
        )

    def load_checkpoint(self, path: str | Path) -> float:
        """Restore a checkpoint (weights, optimizer, the run's and the algorithm's state); returns its wall time."""
        try:
            state, tensors = checkpoint.load(path, self.engine.accelerator, trainer=self.config.trainer)
        except checkpoint.CheckpointMismatch:
            raise  # an older checkpoint of the same run would not fit either
        except checkpoint.CheckpointError as err:
            raise self.with_earlier(err, path) from None
        self.engine.load_state_files(Path(path))
        self.load_state_dict(state, tensors)
        return float(state.get("wall_s", 0.0))


def check_world(config, algorithm_class, world: int, shard: str = "none") -> None:
    """Refuse a config that cannot train on `world` processes sharded as `shard` (the run's driver and `flowrl plan
    --gpus N` ask)."""
    if shard == "zero3" and config.batch.backward == "per_step":
        raise ValueError(
            "batch.backward: per_step interleaves the steps' forwards with backwards that ZeRO-3 runs "
            "one loss late: use batch.backward: auto or whole, or run.shard: fsdp2"
        )
    prompts = config.prompts if isinstance(config, PromptedConfig) else None
    if algorithm_class.updates_groups and prompts is not None and prompts.prompts_per_epoch % world:
        raise ValueError(
            f"{config.trainer} updates whole groups, each sampled by one process: "
            f"prompts.prompts_per_epoch ({prompts.prompts_per_epoch}) must split over the {world} "
            "processes"
        )


def informative_groups(group_ids: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Samples whose group has any non-zero advantage."""
    nonzero = torch.zeros(int(group_ids.max()) + 1).index_add_(0, group_ids[valid], (advantages[valid] != 0).float())
    return nonzero[group_ids] > 0
