"""The loop every trainer shares: collect -> rewards -> advantages -> update -> evaluate, log, checkpoint.

A trainer is a config dataclass (a `TrainerConfig` subclass) and a `Trainer` subclass with a few hooks, one
meaning each:

- `build_policy`, `build_collector`, `build_evaluator`: the modality's parts (`ImageTrainer` builds the
  image ones; a text or control trainer brings its own collector and evaluator and reuses the rest);
- `setup`, `trained_module`, `auxiliary_modules`: algorithm pieces built before the optimizers (noise
  policies, critics, buffers), the module the main optimizer trains, networks with optimizers of their own;
- `train_elements(rollout, epoch) -> [B, k]` and `num_elements(rollout) -> K`: which of each sample's K
  elements (denoising steps, draws, tokens) train;
- `score(batch, index [b, c]) -> Terms`: the per-element loss inputs of those elements of a minibatch;
- `update(rollout, advantages, trainable, epoch)`: the epoch's update; the default runs inner epochs x
  minibatches of `flowrl.trainers.update.minibatch_update` (one `compute_policy_loss` call per minibatch
  on `[b, K]`), and off-policy trainers (DPOK's replay buffer) or those with critics wrap or replace it.

Advantages come from the `advantage` config section for every trainer (`AdvantageEstimator`): the sample's
advantage before any learned baseline. The loop runs on accelerate: one process on a CPU, `accelerate launch`
for many GPUs; prompts are drawn identically on every process, each samples and trains its share, rewards
are gathered so group statistics are global. Everything random is seeded per epoch, so runs resume exactly.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from abc import ABC, abstractmethod
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowrl import checkpoint
from flowrl import rewards as reward_registry
from flowrl.config import RewardConfig, TrainerConfig, save_config, to_dict
from flowrl.core import get_objective
from flowrl.core.objectives import uses_batch_statistics
from flowrl.threads import ThreadGovernor
from flowrl.tracking import MetricsLog, PeakMemory, flat_config, plot_curves, scalar, summary_screen
from flowrl.trainers import sharding
from flowrl.trainers.advantages import AdvantageEstimator
from flowrl.trainers.scoring import Rewards
from flowrl.trainers.state import EMA, Processes, RunState, seeded
from flowrl.trainers.update import EpochStats, GradProbe, Terms, minibatch_update, normaliser


class Trainer(ABC):
    """The shared loop; see the module docstring. Subclasses set `config_class` and implement the hooks."""

    config_class = TrainerConfig
    uses_objective = True
    """Whether the policy loss is a ratio objective of the core (`objective` section); AC-Flow's is not."""
    shard_refusal: str | None = None
    """Why this trainer cannot shard its model (`run.shard`: FSDP2 or ZeRO), beyond what `check_shardable` checks."""
    optimizer_options: dict[str, dict] = {}
    """Extra keyword arguments of each `optim.optimizer` (control's small networks: fused AdamW)."""
    image_scale = False
    """Whether the log-probs are means over latent elements (images): the objective's image-scale defaults apply
    to every hyper-parameter the config does not set (`flowrl.core.IMAGE_SCALE`, docs/objectives.md)."""

    def __init__(self, config: TrainerConfig, *, policy=None, reward_fns: dict | None = None,
                 eval_fns: dict | None = None, output_dir=None):  # fmt: skip
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        from accelerate import Accelerator

        _check_launch()
        self.config = config
        run = config.run
        shard = launch_shard(run.shard)  # before accelerate reads its launcher's DeepSpeed/FSDP settings
        _check_trackers(run.log_with)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.output_dir = Path(output_dir or run.output_dir.format(trainer=config.trainer, time=stamp))
        # without a GPU, the CPU explicitly: accelerate then forms a gloo group of the processes `torchrun`
        # starts (asked for the default device, it would leave each one a separate single-process run)
        cpu = run.cpu or not torch.cuda.is_available()
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=run.mixed_precision,
                                       log_with=run.log_with or None, project_dir=str(self.output_dir))  # fmt: skip
        self.processes = Processes(self.accelerator)
        self.threads = ThreadGovernor(run.threads)  # measures from here: model loading is the first interval
        self.memory = PeakMemory(self.accelerator.device)
        self.state = RunState(trainer=config.trainer)
        # rewards and data first: a bad reward name or prompt fails before any model is loaded
        if reward_fns is None:
            reward_fns = self.build_rewards(config.rewards)
        if eval_fns is None:
            eval_fns = {name: reward_registry.get(name) for name in config.eval.metrics}
        weights = {spec.name: spec.weight for spec in config.rewards}
        self.rewards = Rewards(reward_fns, weights, self.processes, run.max_bad_reward_frac)
        self.eval_fns = eval_fns
        self.check_inputs()
        self.policy = policy if policy is not None else self.build_policy()
        self.advantages = AdvantageEstimator(config.advantage, weights, config.reward_aggregation)
        self.objective = config.objective.name if self.uses_objective else None
        self.objective_hparams = {}
        if self.uses_objective:
            presets = get_objective(self.objective).image_hparams if self.image_scale else {}
            self.objective_hparams = {**presets, **config.objective.hparams()}  # what the user sets wins
        self.batch_statistics = uses_batch_statistics(get_objective(self.objective) if self.objective else None,
                                                      self.objective_hparams)  # fmt: skip
        """Whether the objective reduces over the global batch in each call (`uses_batch_statistics`)."""
        self.agg = self.objective_hparams.get("agg") or (get_objective(self.objective).agg if self.objective
                                                         else "token_mean")  # fmt: skip
        self.setup()
        module = self.trained_module()
        self.shard = shard if self.processes.world > 1 else "none"
        """How the trained model is split over the processes (`run.shard`, or the accelerate config's; one process:
        `none`)."""
        self.sharded = self.shard != "none"
        """Whether the model is sharded (FSDP2 or ZeRO, `flowrl.trainers.sharding`): its backwards are collectives."""
        if self.sharded:
            self.check_shardable()
        if self.shard == "fsdp2":
            sharding.shard(module, self.processes.world, self.accelerator.device)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(self).__name__} has no trainable parameters")
        opt = config.optim
        if opt.optimizer == "rmsprop":
            optimizer = torch.optim.RMSprop(params, lr=opt.lr, alpha=0.99, eps=opt.eps, weight_decay=0.0,
                                            **self.optimizer_options.get("rmsprop", {}))  # fmt: skip
        else:
            optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay,
                                          eps=opt.eps, **self.optimizer_options.get("adamw", {}))  # fmt: skip
        self.zero_backward = None
        if self.shard in sharding.ZERO_STAGES:  # DeepSpeed's engine wraps both; its optimizer steps the partitions
            engine = sharding.zero_engine(module, optimizer, sharding.ZERO_STAGES[self.shard], opt.max_grad_norm)
            self.model, self.optimizer = engine, engine.optimizer
            self.zero_backward = sharding.ZeroBackward(engine, self.processes.world)
        elif self.sharded:  # FSDP2: the module is sharded in place, not wrapped; flowrl steps the raw optimizer
            self.model, self.optimizer = module, optimizer
        else:
            self.model, self.optimizer = self.accelerator.prepare(module, optimizer)
        if module is getattr(self.policy, "model", None):
            self.policy.forward_module = self.model  # training forwards go through the (DDP-)prepared module
        self.params = params
        # one process, no mixed precision: accelerate's backward and clipping would only add per-call overhead
        # (it re-checks installed packages on every call: 0.2 ms, a third of a small control minibatch)
        self.plain = (self.processes.world == 1 or self.sharded) and run.mixed_precision == "no"
        # auxiliary networks (critics, value functions) with optimizers of their own, prepared and checkpointed
        self.aux = {}
        for name, (aux_module, lr) in self.auxiliary_modules().items():
            aux_opt = torch.optim.AdamW(aux_module.parameters(), lr=lr, weight_decay=0.0)
            self.aux[name] = self.accelerator.prepare(aux_module.to(self.accelerator.device), aux_opt)
        self.ema = EMA(params, config.ema_decay) if config.ema_decay else None
        self.collector = self.build_collector()
        self.evaluator = self.build_evaluator()
        self.log: MetricsLog | None = None
        self.last_epoch = None  # (rollout, this process's rewards) of the latest epoch, for sample grids

    def check_shardable(self) -> None:
        """Refuse `run.shard` (FSDP2, ZeRO) where flowrl does not keep the processes' forward and backward calls in
        step (each is a collective when sharded) or keeps copies of the full parameters."""
        run, name = self.config.run, self.config.trainer
        reasons = []
        if type(self).update is not Trainer.update:
            reasons.append(f"trainer {name!r} has its own update loop")
        if self.shard_refusal:
            reasons.append(self.shard_refusal)
        if self.config.ema_decay:
            reasons.append("ema_decay keeps a full copy of the parameters")
        if self.config.optim.step_grad_norms_every:
            reasons.append("optim.step_grad_norms_every measures full per-step gradients")
        if run.mixed_precision != "no":
            reasons.append("mixed precision under sharding is not wired (use run.mixed_precision: no)")
        if self.shard in sharding.ZERO_STAGES and self.config.optim.optimizer != "adamw":
            reasons.append("ZeRO runs keep AdamW's state (use optim.optimizer: adamw)")
        if reasons:
            raise ValueError(f"run.shard: {self.shard} is not supported here: {'; '.join(reasons)}. Use run.shard: "
                             "none (DDP), or a trainer on the shared update (flow_grpo, grpo_guard, ...)")  # fmt: skip

    @property
    def is_main(self) -> bool:
        return self.processes.is_main

    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return self.state.epoch

    # ------------------------------------------------------------------------------------------
    # the modality's parts and the algorithm's pieces
    # ------------------------------------------------------------------------------------------

    @abstractmethod
    def build_policy(self):
        """The policy from `config.model`."""

    @abstractmethod
    def build_collector(self):
        """The modality's collector: `collect(epoch) -> Collected`."""

    @abstractmethod
    def build_evaluator(self):
        """The modality's evaluator: `evaluate() -> {"eval/...": value}`."""

    def build_rewards(self, specs: list[RewardConfig]) -> dict:
        return {spec.name: reward_registry.get(spec.name, **spec.kwargs) for spec in specs}

    def check_inputs(self) -> None:  # noqa: B027  (an optional hook)
        """Validate the data against the rewards before any model is loaded (a modality's prompts, ...)."""

    def setup(self) -> None:  # noqa: B027  (an optional hook, not an abstract method)
        """Build algorithm-specific pieces before the optimizers exist (noise policies, critics, buffers)."""

    def trained_module(self) -> torch.nn.Module:
        """The module the main optimizer trains (default: the policy's network; FIND: its noise policy)."""
        return self.policy.model

    def auxiliary_modules(self) -> dict[str, tuple[torch.nn.Module, float]]:
        """`{name: (module, learning rate)}` of networks trained by their own optimizer (critics, value nets)."""
        return {}

    @abstractmethod
    def train_elements(self, rollout, epoch: int) -> torch.Tensor:
        """`[B, k]` indices of the elements each sample trains, in `[0, num_elements(rollout))`."""

    @abstractmethod
    def num_elements(self, rollout) -> int:
        """K, the elements per sample (the `[B, K]` layout the core sees)."""

    @abstractmethod
    def score(self, batch, index: torch.Tensor) -> Terms:
        """Per-element loss inputs (`[b, c]` each) of the elements `index [b, c]` of the minibatch `batch`."""

    def group_keys(self, texts: list[str]) -> list:
        """The baseline group of each of the epoch's samples (`[N]` hashables): its prompt. TempFlow-GRPO groups
        by prompt and branching step."""
        return texts

    def compute_advantages(self, rewards: dict[str, torch.Tensor], group_ids: torch.Tensor, prompts: list[str]):
        """`(advantages [N], stats)` of the valid samples from the `advantage` section (no learned baseline)."""
        return self.advantages(rewards, group_ids, prompts)

    # ------------------------------------------------------------------------------------------
    # one epoch
    # ------------------------------------------------------------------------------------------

    def begin_epoch(self, epoch: int) -> tuple[int, float]:
        """Set torch's threads (`run.threads`) and the epoch's learning rate; returns both for the log."""
        threads = self.threads.adjust()
        lr = self.config.optim.lr_at(epoch, self.config.run.epochs)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return threads, lr

    def train_epoch(self, epoch: int) -> dict:
        start = time.time()
        threads, lr = self.begin_epoch(epoch)
        self.model.eval()
        self.memory.start()
        batch = self.collector.collect(epoch)
        rollout, prompts, local, rewards = batch.rollout, batch.prompts, batch.local, batch.rewards
        self.state.samples_scored += len(prompts)
        valid, bad = self.rewards.check(rewards)
        texts = [str(p) for p in prompts]
        keys = self.group_keys(texts)
        unique = {key: i for i, key in enumerate(dict.fromkeys(keys))}
        group_ids = torch.tensor([unique[key] for key in keys])
        advantages = torch.zeros(len(prompts))
        valid_rewards = {k: v[valid] for k, v in rewards.items()}
        valid_texts = [t for t, ok in zip(texts, valid.tolist()) if ok]
        adv, adv_stats = self.compute_advantages(valid_rewards, group_ids[valid], valid_texts)
        advantages[valid] = adv.float()
        trainable = valid.clone()
        if self.config.drop_zero_std_groups:
            trainable &= informative_groups(group_ids, advantages, valid)
        local_trainable = trainable[local]
        t0 = time.time()
        # every process updates when any sample trains: the gradient reductions need all of them
        train = self.update(rollout, advantages[local], local_trainable, epoch) if trainable.any() else {}
        total = self.rewards.combined(valid_rewards)
        record = {
            "epoch": epoch + 1,
            "reward/mean": total.mean(),
            "reward/std": total.std() if len(total) > 1 else 0.0,
            **{f"reward/{name}": r[valid].mean() for name, r in rewards.items()},
            **{f"adv/{k}": v for k, v in adv_stats.items()},
            **bad,
            "trained_samples": int(self.processes.gather(local_trainable.float()).sum()),
            "reward_evals": self.state.samples_scored,
            "nonfinite_steps": self.state.nonfinite_steps,
            "lr": lr,
            "threads": threads,
            **train,
            **batch.times,
            **self.memory.mark("update"),
            "time/train_s": time.time() - t0,
            "time_s": time.time() - start,
        }
        self.last_epoch = (rollout, {k: v[local] for k, v in rewards.items()}) if self.is_main else None
        return record

    def update(self, rollout, advantages: torch.Tensor, trainable: torch.Tensor, epoch: int) -> dict:
        """Inner epochs x optimizer steps over the trainable samples of every process.

        Each inner epoch shuffles the global batch's trainable rows the same way on every process and cuts it
        into windows of `minibatch_size x optim.gradient_accumulation x processes` rows, one optimizer step
        each. A process trains the rows of the window it sampled, in minibatches of at most `minibatch_size`,
        each weighted by its share of the whole window's normaliser, and `optimizer_step` sums the gradients
        over the processes: a step's gradient is that of its window, on one process or many.

        An objective that reads batch statistics (`batch_statistics`: BAPO's bounds, Clip-Cov's covariance, the
        80/20 entropy quantile) reduces them over the processes in every call, so the processes must call it in
        step and the statistics should be those of the minibatch one process would train: the window is then cut
        into global minibatches of `minibatch_size x processes` rows and each process trains its rows of each
        (about `minibatch_size`; none at all still takes part, with a weightless row, see `train_padded`). A
        sharded model (`run.shard`: FSDP2, ZeRO) makes every backward (and forward) a collective: the processes' global
        minibatches are cut the same way and padded to the same rows, so each makes the same model calls.
        """
        cfg = self.config
        index = self.train_elements(rollout, epoch)  # [B, k]
        everyone = self.processes.gather(trainable.long()).bool()  # [N]: which rows of the global batch train
        offset = self.processes.rank * len(trainable)  # this process's rows are [offset, offset + B)
        rows = everyone.nonzero().flatten()
        size = self.minibatch_size
        window_rows = size * cfg.optim.gradient_accumulation * self.processes.world
        stats = EpochStats()
        self.model.train()
        for inner in range(cfg.inner_epochs):
            # the same order on every process (the trailing 0 keeps the stream one process always drew)
            order = rows[torch.randperm(len(rows), generator=seeded(cfg.run.seed, epoch, 3, inner, 0))]
            for start in range(0, len(order), window_rows):
                window = order[start : start + window_rows]

                def own(rows):  # this process's rows among `rows`, as indices of its rollout
                    return rows[(rows >= offset) & (rows < offset + len(trainable))] - offset

                if self.batch_statistics or self.sharded:  # every call a collective: keep them in step
                    cut = size * self.processes.world
                    chunks = [window[i : i + cut] for i in range(0, len(window), cut)]
                    minibatches = [own(chunk) for chunk in chunks]
                    # batch statistics: one call each; sharded: the same rows each (forwards are chunked by rows)
                    widths = [self.lockstep_rows(chunk, len(trainable)) if self.sharded else max(len(mb), 1)
                              for chunk, mb in zip(chunks, minibatches)]  # fmt: skip
                else:
                    mine = own(window)
                    minibatches = [mine[i : i + size] for i in range(0, len(mine), size)]
                    widths = [len(mb) for mb in minibatches]
                batches = [rollout.select(mb) if len(mb) else None for mb in minibatches]
                sizes = [(len(mb), self.trained_elements(b, index[mb]) if len(mb) else 0)
                         for mb, b in zip(minibatches, batches)]  # fmt: skip
                scales = self.window_scales(sizes)
                for mb, batch, scale, (_, n), width in zip(minibatches, batches, scales, sizes, widths):
                    if width > len(mb):
                        metrics = self.train_padded(rollout, index, advantages, mb, width, scale=scale)
                    else:
                        metrics = self.train_minibatch(batch, index[mb], advantages[mb], scale=scale)
                    if len(mb):
                        stats.add(metrics, weight=n, loss_weight=normaliser(self.agg, len(mb), n))
                stats.add_scalar("grad_norm", self.optimizer_step(reduction="sum"), shared=True)
        return stats.summary(self.processes)

    @property
    def minibatch_size(self) -> int:
        """Rows per training minibatch (images: `sampling.forward_batch_size`)."""
        return self.config.sampling.forward_batch_size

    def element_valid(self, batch, index: torch.Tensor) -> torch.Tensor | None:
        """`[b, k]` bool, False where a row's element is padding (text: tokens after the end of sequence); None:
        every element is real."""
        return None

    def trained_elements(self, batch, index: torch.Tensor) -> int:
        """The elements a minibatch trains: `index`'s, less padding (`element_valid`)."""
        valid = self.element_valid(batch, index)
        return index.numel() if valid is None else int(valid.sum())

    def window_scales(self, sizes: list[tuple[int, int]]) -> list[float]:
        """Each of this process's minibatches' weight in its accumulation window, from their `(rows, trained
        elements)`: its share of the aggregation's normaliser over the window of every process (elements for
        `token_mean`, rows for `seq_mean_*`; 1 for `sum`), so the window's gradient summed over the processes is
        that of one big minibatch."""
        counts = [normaliser(self.agg, rows, elements) for rows, elements in sizes]
        if self.agg == "sum":
            return [1.0] * len(counts)
        total = self.processes.sum(sum(counts)) if self.processes.world > 1 else sum(counts)
        return [c / total for c in counts]

    def train_minibatch(self, batch, index: torch.Tensor, advantages: torch.Tensor | None, *, scale: float,
                        extra_loss: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                        ) -> dict:  # fmt: skip
        """Forward and backward of one minibatch (`optim.backward`: whole or per step); returns its metrics.
        `extra_loss` (a value loss) joins the first backward pass, so the minibatch takes one backward in all;
        `valid` replaces `element_valid` (`train_padded` masks its padding).

        Gradients stay local (`no_sync`) until `optimizer_step`, which averages them over the processes: a
        whole-K minibatch makes several forward calls before its one backward, which DDP's reducer forbids.
        """
        backward = self.backward
        if extra_loss is not None:
            pending = [extra_loss * scale]

            def backward(loss):
                self.backward(loss + pending.pop() if pending else loss)

        context = nullcontext() if self.plain else self.accelerator.autocast()
        every = self.config.optim.step_grad_norms_every
        probe = GradProbe(self.params) if every and self.state.epoch % every == 0 else None
        # DDP: gradients stay local until `optimizer_step`; sharded: each backward reduces its share
        with nullcontext() if self.sharded else self.accelerator.no_sync(self.model), context:
            return minibatch_update(
                lambda columns: self.score(batch, index[:, columns]), index, self.num_elements(batch), advantages,
                objective=self.objective, hparams=self.objective_hparams,
                per_step=self.config.optim.backward == "per_step" or probe is not None, scale=scale,
                backward=backward, valid=self.element_valid(batch, index) if valid is None else valid, probe=probe,
            )  # fmt: skip

    def lockstep_rows(self, chunk: torch.Tensor, rows_per_process: int) -> int:
        """The most rows any process holds of the global minibatch `chunk` (at least 1): what each trains when the
        processes' model calls must match (every process's rows of the global batch are `rows_per_process`)."""
        owners = torch.bincount(chunk // rows_per_process, minlength=self.processes.world)
        return max(int(owners.max()), 1)

    def train_padded(self, rollout, index: torch.Tensor, advantages: torch.Tensor, rows: torch.Tensor, width: int,
                     *, scale: float) -> dict:  # fmt: skip
        """Train this process's `rows` padded to `width` rows with copies of a row whose elements are all masked:
        the padding adds nothing to the loss, its normaliser or the gradient, but the objective's reductions over
        the processes and a sharded model's collectives see the same calls on every process (a process holding
        no rows of a minibatch still takes part), and a stateful objective advances as on the others."""
        pad = torch.zeros(width - len(rows), dtype=torch.long)
        padded = torch.cat([rows, pad])
        batch = rollout.select(padded)
        valid = self.element_valid(batch, index[padded])
        valid = torch.ones(index[padded].shape, dtype=torch.bool) if valid is None else valid.bool()
        valid[len(rows) :] = False
        return self.train_minibatch(batch, index[padded], advantages[padded], scale=scale, valid=valid)

    def backward(self, loss: torch.Tensor) -> None:
        """The backward pass (accelerate's, which scales mixed-precision losses, unless `plain`; DeepSpeed's
        under ZeRO)."""
        if self.zero_backward is not None:
            self.zero_backward(loss)
        else:
            loss.backward() if self.plain else self.accelerator.backward(loss)

    def minibatch_loss(self, batch, index: torch.Tensor, advantages: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """The loss of one minibatch (whole K, with its graph) and its metrics, without a backward pass."""
        losses = []
        metrics = minibatch_update(lambda columns: self.score(batch, index[:, columns]), index,
                                   self.num_elements(batch), advantages, objective=self.objective,
                                   hparams=self.objective_hparams, backward=losses.append,
                                   valid=self.element_valid(batch, index))  # fmt: skip
        return losses[0], metrics

    def optimizer_step(self, reduction: str = "mean") -> float:
        """Reduce the gradients over the processes (`mean`, or `sum` when each process's loss is already its
        share of the global one), clip them, step AdamW (and the EMA); the gradient norm."""
        if self.zero_backward is not None:
            # DeepSpeed reduces (the losses carry the sum's scale), clips, and skips a non-finite step itself
            if reduction != "sum":
                raise RuntimeError("ZeRO runs only the shared update, whose losses are shares of a sum")
            norm = self.zero_backward.step()
            if not math.isfinite(norm):
                self._skip_nonfinite(norm)
            else:
                self.state.optimizer_steps += 1
            return norm
        if self.sharded:  # each process holds its shard of the summed gradient already
            if reduction == "mean":
                for p in self.params:
                    p.grad.div_(self.processes.world)
        elif self.processes.world > 1:
            for p in self.params:
                # a process whose share of the window was empty has no gradient: it adds zeros
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = self.accelerator.reduce(grad, reduction=reduction)
        max_norm = self.config.optim.max_grad_norm
        if self.sharded:  # the norm of the whole gradient (a collective over the shards); inf: measure only
            norm = sharding.local_value(torch.nn.utils.clip_grad_norm_(self.params, max_norm or math.inf))
        elif max_norm is not None and self.plain:
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        elif max_norm is not None:
            norm = self.accelerator.clip_grad_norm_(self.params, max_norm)
        else:
            norm = torch.norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None]))
        # accelerate's wrapper: the same step (a sharded run holds the raw optimizer)
        optimizer = self.optimizer.optimizer if self.plain and not self.sharded else self.optimizer
        # the same on every process (the gradients were reduced first); fp16's loss scaler skips its own overflows
        if not math.isfinite(float(norm)) and self.config.run.mixed_precision != "fp16":
            optimizer.zero_grad(set_to_none=True)
            self._skip_nonfinite(float(norm))
            return float(norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.state.optimizer_steps += 1
        if self.ema is not None and self.state.optimizer_steps % self.config.ema_every == 0:
            self.ema.update()
        return float(norm)

    def _skip_nonfinite(self, norm: float) -> None:
        """Count a skipped step; past `optim.max_nonfinite_steps` stop the run (its last checkpoint stays)."""
        self.state.nonfinite_steps += 1
        limit = self.config.optim.max_nonfinite_steps
        if self.state.nonfinite_steps > limit:
            raise NonFiniteError(
                f"{self.state.nonfinite_steps} optimizer steps had a non-finite gradient (norm "
                f"{norm}) by epoch {self.state.epoch + 1}, more than optim.max_nonfinite_steps="
                f"{limit}: lower optim.lr or check the rewards; the last checkpoint is kept"
            )

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The evaluator on the current (or EMA) weights."""
        self.model.eval()
        with self.ema.swapped() if self.ema is not None else nullcontext():
            return self.evaluator.evaluate()

    def log_samples(self) -> None:  # noqa: B027  (an optional hook)
        """Save a grid of the latest epoch's samples (images: `images/epoch_N.png`)."""

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------

    def train(self, resume: str | Path | bool | None = None, overwrite: bool = False) -> dict:
        """Run (or resume) training to `run.epochs`; returns the summary.

        Args:
            resume: `True` continues the run folder's latest checkpoint, a path continues that checkpoint.
            overwrite (`bool`): start afresh in a run folder that already holds a run, deleting its checkpoints,
                metrics, images, plots and events (without it, such a folder is refused: nothing is lost).
        """
        from tqdm.auto import tqdm

        cfg = self.config
        start_time = time.time()
        self._prepare_run_folder(resume, overwrite)
        self.log = MetricsLog(self.output_dir / "metrics.jsonl")
        self.log.history = self.state.metrics  # one list: the checkpoint saves what the log holds
        wall_before = 0.0
        if resume:
            try:
                path = checkpoint.latest(self.output_dir) if resume is True else Path(resume)
            except checkpoint.CheckpointError as err:
                found = checkpoint.list_checkpoints(self.output_dir)
                raise self._with_earlier(err, found[-1]) if found else err from None
            wall_before = self.load_checkpoint(path)
            if self.is_main:
                self.log.rewrite()
        if self.accelerator.trackers == [] and cfg.run.log_with:
            self._init_trackers()
        if not self.state.eval_history:
            if self.is_main:
                print("evaluating the starting policy (the curves' baseline) ...", flush=True)
            evaluation = self.evaluate()
            self._record_eval(0, evaluation)
            self._log({"epoch": 0, **evaluation})  # the curves start at their baseline
            self._keep_best(evaluation, 0.0)

        epochs = range(self.epoch, cfg.run.epochs) if self.state.stopped is None else range(0)
        bar = tqdm(epochs, disable=not self.is_main, desc=cfg.trainer, unit="epoch")
        for epoch in bar:
            record = self.train_epoch(epoch)
            self.state.epoch = epoch + 1
            last = self.epoch == cfg.run.epochs
            if last or (cfg.eval.every and self.epoch % cfg.eval.every == 0):
                evaluation = self.evaluate()
                record.update(evaluation)
                self._record_eval(self.epoch, evaluation)
                self._keep_best(evaluation, wall_before + time.time() - start_time)
                record.update(self._overoptimisation())
                last = last or self._stop_on_drop()
            record["wall_s"] = wall_before + time.time() - start_time
            self._log(record)
            if cfg.run.images_every and (self.epoch % cfg.run.images_every == 0 or self.epoch == 1):
                self.log_samples()
            bar.set_postfix(reward=f"{scalar(record['reward/mean']):.3f}",
                            eval=f"{self.state.eval_history[-1].get('eval/reward', float('nan')):.3f}")  # fmt: skip
            if last:
                self._restore_best()
            if last or (cfg.run.save_every and self.epoch % cfg.run.save_every == 0):
                self.save_checkpoint(wall_before + time.time() - start_time)
            if last:
                break
        summary = self._summary(wall_before + time.time() - start_time)
        if self.is_main:
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True))
            plot_curves(self.log.history, self.output_dir / "plots")
            print(summary_screen(summary, self.output_dir))
        self.accelerator.end_training()
        return summary

    def _prepare_run_folder(self, resume, overwrite: bool) -> None:
        """Create the run folder; refuse one that holds another run unless resuming it or overwriting it."""
        out = self.output_dir
        artifacts = [out / name for name in RUN_ARTIFACTS if (out / name).exists()]
        held = bool(checkpoint.list_checkpoints(out)) or (out / "metrics.jsonl").exists()
        if held and not resume and not overwrite:
            raise RunFolderError(f"run folder {out} already holds a run (checkpoints or metrics.jsonl): pass --resume "
                                 "to continue it, --overwrite to replace it, or another --output-dir")  # fmt: skip
        if resume and resume is not True and Path(resume).resolve().parent == (out / "checkpoints").resolve():
            newer = [p.name for p in checkpoint.list_checkpoints(out) if _epoch_of(p) > _epoch_of(Path(resume))]
            if newer and not overwrite:
                raise RunFolderError(f"the run went on past {Path(resume).name} ({', '.join(newer)}): resuming there "
                                     "would fork it; pass --overwrite to delete the later checkpoints")  # fmt: skip
            if self.is_main:
                for name in newer:
                    shutil.rmtree(out / "checkpoints" / name)
                best = out / "checkpoints" / "best" / "trainer_state.json"
                if newer and best.is_file() and (json.loads(best.read_text()).get("best") or {}).get(
                        "epoch", 0) > _epoch_of(Path(resume)):  # fmt: skip
                    shutil.rmtree(best.parent)  # the best of the abandoned continuation
        if overwrite and not resume and self.is_main:
            for path in artifacts:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        if self.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "images").mkdir(exist_ok=True)
            save_config(self.config, out / "config.yaml")
        self.accelerator.wait_for_everyone()

    def _init_trackers(self) -> None:
        """TensorBoard gets the config as text in its one events file (its hparams plugin would write a second
        run folder); other trackers (W&B) get it as their run config."""
        import yaml

        self.accelerator.init_trackers("flowrl")
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                text = yaml.safe_dump(to_dict(self.config), sort_keys=False)
                tracker.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)
            else:
                tracker.store_init_configuration(flat_config(to_dict(self.config)))

    def _keep_best(self, evaluation: dict, wall_s: float) -> None:
        """Save `checkpoints/best` when this evaluation beats the best one by `eval.best_metric`."""
        key = self.config.eval.best_key()
        if key is None:
            return
        name, sign = key
        if name not in evaluation:
            raise ValueError(f"eval.best_metric {self.config.eval.best_metric!r} is not an evaluation metric; "
                             f"choose from {', '.join(k.removeprefix('eval/') for k in evaluation)}")  # fmt: skip
        value = scalar(evaluation[name])
        best = self.state.best
        if best is None or sign * value > sign * best["value"]:
            self.state.best = {"epoch": self.epoch, "metric": name, "value": value}
            self.state.wall_s = wall_s
            state, tensors = self.state_dict()
            checkpoint.save(self.output_dir / "checkpoints" / "best", self.accelerator, state, tensors)

    def _overoptimisation(self) -> dict:
        """The proxy-gold divergence since the gold metric's best evaluation: `overopt/gold_drop` (how far the gold
        metric, `eval.best_metric` or else `eval.metrics[0]`, lies below its best so far) and `overopt/proxy_gain`
        (how much the proxy, `eval/reward`, rose since that evaluation). Both positive: the proxy rises while the
        gold falls."""
        e, history = self.config.eval, self.state.eval_history
        gold, sign = e.best_key() or (f"eval/{e.metrics[0]}" if e.metrics else "", 1.0)
        if gold not in history[-1] or "eval/reward" not in history[-1]:
            return {}
        best = max(history, key=lambda e: sign * e[gold])  # the first of equal values: the earliest peak
        return {"overopt/gold_drop": sign * (best[gold] - history[-1][gold]),
                "overopt/proxy_gain": history[-1]["eval/reward"] - best["eval/reward"]}  # fmt: skip

    def _stop_on_drop(self) -> bool:
        """`eval.stop_on_drop`: whether the watched metric fell that far below its best (records why)."""
        amount, key = self.config.eval.stop_on_drop, self.config.eval.best_key()
        if amount is None or self.state.best is None:
            return False
        name, sign = key
        value = self.state.eval_history[-1][name]
        if sign * (self.state.best["value"] - value) < amount:
            return False
        self.state.stopped = {"epoch": self.epoch, "metric": name, "best": self.state.best["value"], "value": value}
        if self.is_main:
            print(f"stopping at epoch {self.epoch}: {name} fell to {value:.4f}, {amount} below its best "
                  f"{self.state.best['value']:.4f} (epoch {self.state.best['epoch']}; eval.stop_on_drop)")  # fmt: skip
        return True

    def _restore_best(self) -> None:
        """`eval.restore_best`: load the best checkpoint's weights (and optimizer and EMA) at the run's end; the
        run's counters and history stay those of its last epoch."""
        best = self.state.best
        if not self.config.eval.restore_best or best is None or best["epoch"] == self.epoch:
            return
        keep = self.state
        path = self.output_dir / "checkpoints" / "best"
        self.load_checkpoint(path)
        self.state = keep
        self.state.best = {**best, "restored": True}
        if self.log is not None:
            self.log.history = self.state.metrics
        if self.is_main:
            print(f"restored the best evaluation's weights (epoch {best['epoch']}, {best['metric']} "
                  f"{best['value']:.4f}) from {path}")  # fmt: skip

    def _record_eval(self, epoch: int, evaluation: dict) -> None:
        self.state.eval_history.append({"epoch": epoch, **{k: scalar(v) for k, v in evaluation.items()}})

    def _log(self, record: dict) -> None:
        record = {k: scalar(v) for k, v in record.items()}
        if self.is_main:
            self.log.append(record)
        numeric = (k for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        numbers = {k: float(record[k]) for k in numeric if k != "epoch" and not math.isnan(record[k])}
        if self.accelerator.trackers:
            self.accelerator.log(numbers, step=record["epoch"])

    def _summary(self, wall_s: float) -> dict:
        first, last = self.state.eval_history[0], self.state.eval_history[-1]
        best = self.state.best
        if best is not None and best.get("restored"):  # the final weights are the best evaluation's
            last = next(e for e in self.state.eval_history if e["epoch"] == best["epoch"])
        gold = self.config.eval.metrics[0] if self.config.eval.metrics else None
        metrics = [k for k in last if k != "epoch"]
        return {
            "trainer": self.config.trainer,
            "epochs": self.epoch,
            "processes": self.processes.world,
            "shard": self.shard,
            "wall_s": round(wall_s, 1),
            "reward_start": first.get("eval/reward"),
            "reward_end": last.get("eval/reward"),
            "gold_metric": gold,
            "gold_start": first.get(f"eval/{gold}") if gold else None,
            "gold_end": last.get(f"eval/{gold}") if gold else None,
            "eval_start": {k: first.get(k) for k in metrics},
            "eval_end": {k: last.get(k) for k in metrics},
            "eval_history": self.state.eval_history,
            "samples_scored": self.state.samples_scored,
            "best": best,
            "stopped": self.state.stopped,
            "train_reward_end": self.log.history[-1]["reward/mean"] if self.log and self.log.history else None,
        }

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """flowrl's own resumable state (JSON part, tensor part); subclasses extend it."""
        state = self.state.to_json()
        if self.advantages.state_dict():
            state["advantage"] = self.advantages.state_dict()
        return state, self.ema.state_dict() if self.ema is not None else {}

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        if state.get("trainer") != self.config.trainer:
            found, wanted = state.get("trainer"), self.config.trainer
            raise checkpoint.CheckpointError(f"checkpoint is from trainer {found!r}, not {wanted!r}")
        try:
            self.advantages.load_state_dict(state.get("advantage", {}))
        except KeyError as err:
            raise checkpoint.CheckpointError(str(err.args[0])) from None
        self.state = RunState.from_json(state)
        if self.log is not None:
            self.log.history = self.state.metrics
        if self.ema is not None:
            self.ema.load_state_dict(tensors)

    def _with_earlier(self, err: Exception, path) -> checkpoint.CheckpointError:
        """`err` with the newest verified checkpoint older than `path` offered in its message."""
        earlier = checkpoint.previous_verified(self.output_dir, path)
        hint = f"; the previous verified checkpoint is {earlier} (--resume {earlier})" if earlier else ""
        return checkpoint.CheckpointError(f"{err}{hint}")

    def save_checkpoint(self, wall_s: float = 0.0) -> Path:
        self.state.wall_s = wall_s
        state, tensors = self.state_dict()
        folder = self.output_dir / "checkpoints" / f"epoch_{self.epoch}"
        files = None
        if self.sharded:  # gathered on every process (a collective), written by the main one
            if self.zero_backward is not None:
                model, optim, metadata = sharding.zero_full_state(self.model)
            else:
                model, optim, metadata = sharding.full_state(self.model, self.optimizer)
            files = {sharding.MODEL_FILE: (model, None), sharding.OPTIMIZER_FILE: (optim, metadata)}
        return checkpoint.save(folder, self.accelerator, state, tensors, keep=self.config.run.keep_checkpoints,
                               files=files)  # fmt: skip

    def load_checkpoint(self, path: str | Path) -> float:
        try:
            state, tensors = checkpoint.load(path, self.accelerator, trainer=self.config.trainer)
        except checkpoint.CheckpointMismatch:
            raise  # an older checkpoint of the same run would not fit either
        except checkpoint.CheckpointError as err:
            raise self._with_earlier(err, path) from None
        if self.sharded:
            self._load_sharded(Path(path))
        self.load_state_dict(state, tensors)
        if self.is_main:
            print(f"resumed from {path} at epoch {self.epoch}")
        return float(state.get("wall_s", 0.0))

    def _load_sharded(self, folder: Path) -> None:
        """A sharded run's model and optimizer from the full states its checkpoint holds."""
        from safetensors import safe_open

        model_file, optim_file = folder / sharding.MODEL_FILE, folder / sharding.OPTIMIZER_FILE
        if not model_file.is_file() or not optim_file.is_file():
            raise checkpoint.CheckpointMismatch(f"checkpoint {folder} was not written by a sharded run (no "
                                                f"{sharding.MODEL_FILE}); resume it with run.shard: none")  # fmt: skip
        with safe_open(str(optim_file), "pt") as f:
            metadata = f.metadata() or {}
        try:
            model, optim = load_file(model_file), load_file(optim_file)
            if self.zero_backward is not None:
                sharding.zero_load_full_state(self.model, model, optim, metadata)
            else:
                sharding.load_full_state(self.model, self.optimizer, model, optim, metadata)
        except (RuntimeError, ValueError, KeyError) as err:
            detail = " ".join(str(err).split())[:300]
            raise checkpoint.CheckpointMismatch(f"checkpoint {folder} does not fit this run's model or optimizer: "
                                                f"{detail}") from None  # fmt: skip


def informative_groups(group_ids: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Samples whose group has any non-zero advantage."""
    nonzero = torch.zeros(int(group_ids.max()) + 1).index_add_(0, group_ids[valid], (advantages[valid] != 0).float())
    return nonzero[group_ids] > 0


class NonFiniteError(RuntimeError):
    """Too many optimizer steps had a NaN or infinite gradient."""


class LaunchError(RuntimeError):
    """The processes were launched in a way that cannot form one training group."""


def launch_shard(shard: str, environ=None) -> str:
    """`run.shard` under an accelerate config that asks for sharding: `distributed_type: DEEPSPEED` with ZeRO
    stage 2 or 3 is `zero2` / `zero3`, `distributed_type: FSDP` is `fsdp2` (configs/accelerate/). flowrl shards the
    model itself, so accelerate's own DeepSpeed and FSDP wrapping are switched off in `environ` (it only launched
    the processes); a `run.shard` that names another kind is refused."""
    import os

    env = os.environ if environ is None else environ
    asked = None
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        if stage not in ("2", "3"):
            raise LaunchError(f"the accelerate config asks for DeepSpeed ZeRO stage {stage}; flowrl runs stages 2 "
                              "and 3 (configs/accelerate/zero2.yaml, zero3.yaml)")  # fmt: skip
        asked = f"zero{stage}"
    elif env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        asked = "fsdp2"
    if asked is None:
        return shard
    if shard not in ("none", asked):
        raise LaunchError(f"the accelerate config launches {asked} but run.shard is {shard!r}: drop one of them")
    env["ACCELERATE_USE_DEEPSPEED"] = env["ACCELERATE_USE_FSDP"] = "false"
    return asked


def _check_launch(environ=None) -> None:
    """Refuse `accelerate launch --cpu --num_processes N`: accelerate's simple launcher starts one process (it
    sets a rendezvous address but no world size), which would train alone while the user counts on N."""
    import os

    env = os.environ if environ is None else environ
    use_cpu = env.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if use_cpu and "MASTER_PORT" in env and "WORLD_SIZE" not in env:
        raise LaunchError(
            "`accelerate launch --cpu --num_processes N` starts a single process; on CPUs launch N "
            "processes with `torchrun --nproc_per_node N -m flowrl train CONFIG` (docs/distributed.md)"
        )


def _check_trackers(log_with: list[str]) -> None:
    """Fail up front on a tracker whose package is missing (accelerate would only warn and train on)."""
    import importlib.util

    for name in log_with or []:
        package = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(name, name)
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"run.log_with lists {name}, which is not installed: pip install 'flowrl[{name}]' "
                             f"(or remove it from run.log_with)")  # fmt: skip


RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "summary.json", "images", "plots", "flowrl", "config.yaml")
"""What a run writes into its folder (`--overwrite` deletes exactly these)."""


class RunFolderError(ValueError):
    """A run folder that holds another run (or a later part of this one); the message says what to pass."""


def _epoch_of(path: Path) -> int:
    digits = path.name.removeprefix("epoch_")
    return int(digits) if digits.isdigit() else -1
