"""The `flowrl` subcommands that use a run or a reward once it exists: `export`, `demos`, `sample`, `eval`,
`ablate`, `serve-reward`, `score` and `digits` (`flowrl.cli` parses the command line and calls them; training and
planning stay there). Each takes the parsed arguments and returns the exit code; the libraries are imported inside
them, so that `flowrl --help` stays fast."""

from __future__ import annotations

import argparse
import sys


def cmd_export(args: argparse.Namespace) -> int:
    from flowrl.export import export, indented

    record = export(args.run, args.out, checkpoint_path=args.checkpoint, ema=args.ema)
    print(
        f"exported {record['kind']} weights of {record['checkpoint']} (epoch {record['epoch']}"
        f"{', EMA' if record['ema'] else ''}) to {args.out}\nload them with: {record['load']}"
    )
    if "diffusers" in record:
        print("sample with a plain diffusers pipeline as flowrl evaluates:\n" + indented(record["diffusers"]))
    return 0


def cmd_demos(args: argparse.Namespace) -> int:
    """Record a control run's policy as demonstrations (`flowrl.control.demos`)."""
    from flowrl.control.demos import record
    from flowrl.trainers import load_run

    run = load_run(args.run, args.checkpoint or "latest", device="cpu")
    if not hasattr(run.modality, "normalizer"):
        raise ValueError(f"{args.run} is a {run.config.trainer} run: demonstrations come from a control run")
    env = run.config.env
    demos = record(
        run.algorithm.policy.actor,
        run.modality.normalizer,
        env.id,
        env.kwargs,
        episodes=args.episodes,
        noise=args.noise,
        seed=args.seed,
    )
    path = demos.save(args.out)
    returns = demos.episode_returns
    print(
        f"{len(demos)} transitions of {args.episodes} {env.id} episodes (return {returns.mean():.1f} ± "
        f"{returns.std():.1f}, action noise {args.noise}) in {path}"
    )
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from flowrl.export import indented
    from flowrl.sample import sample

    record = sample(
        args.target,
        args.prompts,
        n=args.n,
        seed=args.seed,
        sampler=args.sampler,
        noise_level=args.noise_level,
        num_steps=args.num_steps,
        guidance_scale=args.guidance_scale,
        checkpoint=args.checkpoint,
        ema=args.ema,
        out=args.out,
        image=args.image,
    )
    count = len(record["files"])
    kind = "video" if record["files"] and record["files"][0]["file"].endswith(".mp4") else "image"
    print(
        f"{count} {kind}{'s' if count != 1 else ''} of {record['checkpoint']} (epoch {record['epoch']}"
        f"{', EMA' if record['ema'] else ''}, sampler {record['sampler']}, seed {record['seed']}) in "
        f"{record['out']}; grid: {record['out']}/grid.png"
    )
    if "diffusers" in record:
        print("the same with a plain diffusers pipeline:\n" + indented(record["diffusers"]))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a run's checkpoint (latest, or --checkpoint) or a config's untrained model on the test prompts,
    loading the policy and the rewards without a trainer."""
    import json
    from pathlib import Path

    import torch

    from flowrl.run.inference import build_parts
    from flowrl.trainers import load_config, load_run

    target = Path(args.target)
    overrides = list(args.set or [])
    if target.is_dir():
        run = load_run(target, args.checkpoint or "latest", rewards=True, overrides=overrides)
        algorithm, label, epoch = run.algorithm, str(run.checkpoint), run.epoch
    else:
        from flowrl.run.artifacts import check_artifacts

        config = load_config(target, [*overrides, "run.log_with=[]"])
        check_artifacts(config)
        _, algorithm = build_parts(config, rewards=True)
        label, epoch = "base model", 0
    with torch.no_grad():
        result = {"evaluated": label, "epoch": epoch, **algorithm.evaluator().evaluate()}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from flowrl import ablate

    study = {}
    if len(args.configs) == 1 and ablate.is_study(args.configs[0]):
        study = ablate.load_study(args.configs[0])
    configs = study.get("configs", args.configs)
    grid = {**study.get("grid", {}), **ablate.parse_grid(args.grid or [])}
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else study.get("seeds", [0])
    output_dir = args.output_dir or study.get("output_dir", "runs/ablation")
    threshold = ablate.parse_threshold(args.threshold) if args.threshold else study.get("threshold")
    rows = ablate.run(
        configs,
        grid=grid,
        seeds=seeds,
        output_dir=output_dir,
        overrides=[*study.get("overrides", []), *(args.set or [])],
        skip_done=args.skip_done,
        threshold=threshold,
    )
    print(ablate.table(rows))
    print(f"results: {output_dir}/results.json, results.md, results.csv; plots: {output_dir}/plots/")
    return 0


def cmd_serve_reward(args: argparse.Namespace) -> int:
    """Serve a registered reward over HTTP until Ctrl-C (`flowrl.rewards.serving.server.serve_reward`)."""
    import os

    from flowrl.config import apply_overrides
    from flowrl.rewards.serving.server import serve_reward
    from flowrl.rewards.serving.server_requests import is_loopback
    from flowrl.rewards.serving.wire import TOKEN_ENV

    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None

    def ready(server) -> None:
        auth = "a token required" if token else "no token"
        if not token and not is_loopback(args.host):  # --insecure: said once more
            print(
                f"flowrl serve-reward: warning: {args.host} without a token (--insecure) lets anyone who reaches "
                "the port use the reward",
                file=sys.stderr,
            )
        config = f"rewards: [{{name: http, kwargs: {{url: {server.url}}}}}]"
        print(
            f"serving reward {args.name!r} at {server.url} (POST /score, GET /health; {auth}; Ctrl-C stops it)\n"
            f"use it in a run config as: {config}",
            flush=True,
        )

    try:
        serve_reward(
            args.name,
            host=args.host,
            port=args.port,
            token=token,
            max_batch=args.max_batch,
            max_body_bytes=int(args.max_body_mb * 1024 * 1024),
            batch_wait_s=args.batch_wait,
            reward_kwargs=apply_overrides({}, args.set or []),
            ready=ready,
            max_image_pixels=args.max_image_pixels,
            max_inflight_bytes=int(args.max_inflight_mb * 1024**2),
            insecure=args.insecure,
        )
    except KeyboardInterrupt:
        print(f"flowrl serve-reward: stopped serving {args.name!r}", file=sys.stderr)
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    """Score image/video files with a reward and print a table (or JSON): `flowrl.score`."""
    from flowrl.score import format_table, parse_kwargs, score_files, to_json

    record = score_files(
        args.reward,
        args.images,
        prompt=args.prompt,
        prompts_file=args.prompts,
        server=args.server,
        kwargs=parse_kwargs(args.kwargs),
        image=args.image,
    )
    print(to_json(record) if args.json else format_table(record))
    return 0


def cmd_digits(args: argparse.Namespace) -> int:
    from flowrl.digits.build import main as build_main

    return build_main(args.rest)
