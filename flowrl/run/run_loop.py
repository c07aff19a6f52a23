"""The run loop: epochs of a `Trainer`'s named phases, with evaluations, logging, checkpoints and stop conditions.

    [resume: verify the checkpoint, load it]  ->  baseline evaluation (epoch 0)
    per epoch:  train_epoch -> [evaluate, keep the best, the over-optimisation brake] -> log -> samples
                -> [restore the best at the end] -> checkpoint
    summary.json, plots, the summary screen

The loop owns the run folder's life (`flowrl.run.run_folder`): a resume is verified before anything in the
folder changes, and a fresh run that fails before its first epoch leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from flowrl import checkpoint
from flowrl.config import save_config, to_dict
from flowrl.run import run_folder
from flowrl.tracking import MetricsLog, flat_config, plot_curves, scalar, summary_screen


class RunLoop:
    """Runs a `Trainer` to `run.epochs` (see the module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.config = trainer.config
        self.engine = trainer.engine

    def run(self, resume: str | Path | bool | None = None, overwrite: bool = False) -> dict:
        """`Trainer.train`: run (or resume) training; returns the summary."""
        out = self.trainer.output_dir
        fresh = not resume and (overwrite or not run_folder.holds_run(out))
        run_folder.check_folder(out, resume, overwrite)
        try:
            return self._run(resume, overwrite)
        except BaseException:
            if fresh and self.trainer.state.epoch == 0 and self.engine.is_main:
                run_folder.abandon(out)
            raise

    def _start(self, resume, overwrite: bool) -> float:
        """Prepare the run folder, resume, save the resolved config, start the trackers; returns the wall time of
        the run so far."""
        trainer, cfg, main = self.trainer, self.config, self.engine.is_main
        path = None
        if resume:  # the checkpoint is sound before anything of the run folder changes
            try:
                path = checkpoint.latest(trainer.output_dir) if resume is True else checkpoint.verify(Path(resume))
            except checkpoint.CheckpointError as err:
                found = checkpoint.list_checkpoints(trainer.output_dir)
                raise trainer.with_earlier(err, path or (found[-1] if found else None)) if found else err from None
        if main:
            run_folder.prepare_folder(trainer.output_dir, resume, overwrite)
            swept = run_folder.sweep(trainer.output_dir, cfg.run.keep_checkpoints)
            if swept:
                where = trainer.output_dir / "checkpoints"
                print(f"removed what an interrupted checkpoint write left in {where}: {', '.join(swept)}")
            trainer.output_dir.mkdir(parents=True, exist_ok=True)
        self.engine.accelerator.wait_for_everyone()
        trainer.log = MetricsLog(trainer.output_dir / "metrics.jsonl")
        trainer.log.history = trainer.state.metrics  # one list: the checkpoint saves what the log holds
        wall_before = 0.0
        if path is not None:
            wall_before = trainer.load_checkpoint(path)
            if main:
                print(f"resumed from {path} at epoch {trainer.epoch}")
                trainer.log.rewrite()
        if main:  # the run's resolved config (a resume's overrides included): what a later resume reads
            save_config(cfg, trainer.output_dir / "config.yaml")
        if self.engine.accelerator.trackers == [] and cfg.run.log_with:
            self._init_trackers()
        return wall_before

    def _run(self, resume, overwrite: bool) -> dict:
        from tqdm.auto import tqdm

        trainer, cfg = self.trainer, self.config
        start_time = time.time()
        wall_before = self._start(resume, overwrite)
        wall = lambda: wall_before + time.time() - start_time  # noqa: E731
        if not trainer.state.eval_history:
            if self.engine.is_main:
                print("evaluating the starting policy (the curves' baseline) ...", flush=True)
            evaluation = trainer.evaluate()
            trainer.watch.record(0, evaluation)
            self._log({"epoch": 0, **evaluation})  # the curves start at their baseline
            self._keep_best(evaluation, 0.0)

        epochs = range(trainer.epoch, cfg.run.epochs) if trainer.state.stopped is None else range(0)
        bar = tqdm(epochs, disable=not self.engine.is_main, desc=cfg.trainer, unit="epoch")
        for epoch in bar:
            record = trainer.train_epoch(epoch)
            trainer.state.epoch = epoch + 1
            last = trainer.epoch == cfg.run.epochs
            if last or (cfg.eval.every and trainer.epoch % cfg.eval.every == 0):
                last = self._evaluate(record, wall()) or last
            record["wall_s"] = wall()
            self._log(record)
            every = cfg.run.samples_every
            if every and (trainer.epoch % every == 0 or trainer.epoch == 1):
                trainer.log_samples()
            bar.set_postfix(
                reward=f"{scalar(record.get('reward/mean', float('nan'))):.3f}",
                eval=f"{trainer.state.eval_history[-1].get('eval/reward', float('nan')):.3f}",
            )
            if last:
                self._restore_best()
            if last or (cfg.run.save_every and trainer.epoch % cfg.run.save_every == 0):
                trainer.save_checkpoint(wall())
            if last:
                break
        return self._finish(wall())

    def _evaluate(self, record: dict, wall_s: float) -> bool:
        """The epoch's evaluation into `record`, the best kept; returns whether the brake stops the run."""
        trainer = self.trainer
        evaluation = trainer.evaluate()
        record.update(evaluation)
        trainer.watch.record(trainer.epoch, evaluation)
        self._keep_best(evaluation, wall_s)
        record.update(trainer.watch.overoptimisation())
        reason = trainer.watch.dropped()
        if reason and self.engine.is_main:
            print(reason)
        return bool(reason)

    def _finish(self, wall_s: float) -> dict:
        trainer, cfg = self.trainer, self.config
        history = trainer.log.history
        train_reward = history[-1].get("reward/mean") if history and "reward/mean" in history[-1] else None
        summary = run_folder.summary(
            cfg,
            trainer.state,
            processes=self.engine.processes.world,
            shard=self.engine.shard,
            wall_s=wall_s,
            train_reward_end=train_reward,
        )
        if self.engine.is_main:
            (trainer.output_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True))
            if trainer.config.run.plots:
                plot_curves(trainer.log.history, trainer.output_dir / "plots")
            print(summary_screen(summary, trainer.output_dir))
        self.engine.accelerator.end_training()
        return summary

    def _init_trackers(self) -> None:
        """TensorBoard gets the config as text in its one events file (its hparams plugin would write a second
        run folder); other trackers (W&B) get it as their run config."""
        import yaml

        accelerator = self.engine.accelerator
        accelerator.init_trackers("flowrl")
        for tracker in accelerator.trackers:
            if tracker.name == "tensorboard":
                text = yaml.safe_dump(to_dict(self.config), sort_keys=False)
                tracker.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)
            else:
                tracker.store_init_configuration(flat_config(to_dict(self.config)))

    def _keep_best(self, evaluation: dict, wall_s: float) -> None:
        """Save `checkpoints/best` when this evaluation beats the best one by `eval.best_metric`."""
        trainer = self.trainer
        if trainer.watch.improved(evaluation):
            trainer.state.wall_s = wall_s
            state, tensors = trainer.state_dict()
            checkpoint.save(trainer.output_dir / "checkpoints" / "best", self.engine.accelerator, state, tensors)

    def _restore_best(self) -> None:
        """`eval.restore_best`: load the best checkpoint's weights (and optimizer and EMA) at the run's end; the
        run's counters and history stay those of its last epoch."""
        trainer, engine = self.trainer, self.engine
        best = trainer.state.best
        if not self.config.eval.restore_best or best is None or best["epoch"] == trainer.epoch:
            return
        keep, counters = trainer.state, (engine.optimizer_steps, engine.nonfinite_steps)
        path = trainer.output_dir / "checkpoints" / "best"
        trainer.load_checkpoint(path)
        trainer.state = trainer.watch.state = keep
        engine.optimizer_steps, engine.nonfinite_steps = counters
        trainer.state.best = {**best, "restored": True}
        if trainer.log is not None:
            trainer.log.history = trainer.state.metrics
        if engine.is_main:
            print(
                f"restored the best evaluation's weights (epoch {best['epoch']}, {best['metric']} "
                f"{best['value']:.4f}) from {path}"
            )

    def _log(self, record: dict) -> None:
        record = {k: scalar(v) for k, v in record.items()}
        if self.engine.is_main:
            self.trainer.log.append(record)
        numeric = (k for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        numbers = {k: float(record[k]) for k in numeric if k != "epoch" and not math.isnan(record[k])}
        if self.engine.accelerator.trackers:
            self.engine.accelerator.log(numbers, step=record["epoch"])
