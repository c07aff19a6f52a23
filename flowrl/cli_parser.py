"""The `flowrl` command line's arguments: `build_parser` declares every subcommand and its options, and nothing else
(`flowrl.cli` parses with it and runs the function of the subcommand named, `args.command`)."""

from __future__ import annotations

import argparse


DESCRIPTION = "The `flowrl` command line."
"""`flowrl --help`'s first line."""


def build_parser() -> argparse.ArgumentParser:
    from flowrl import __version__

    parser = argparse.ArgumentParser(prog="flowrl", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"flowrl {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="list registered objectives, estimators, weightings, rewards, ...")
    p_list.add_argument("section", nargs="?", help="only this section (e.g. objectives, rewards)")
    p_list.add_argument("--markdown", action="store_true", help="markdown tables (what docs/registries.md holds)")
    p_train = sub.add_parser("train", help="train from a YAML config")
    p_train.add_argument("config", help="YAML run config (see configs/); with --resume, the run folder may be given")
    p_train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    p_train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="resume the run (its own saved config; --set overrides are printed) from its latest "
        "checkpoint, or from the checkpoint PATH",
    )
    p_train.add_argument("--output-dir", help="run folder (overrides run.output_dir)")
    p_train.add_argument(
        "--overwrite", action="store_true", help="start afresh in a run folder that holds another run (deletes it)"
    )
    p_plan = sub.add_parser("plan", help="a run's GPU memory per phase, traced without weights, and what fits")
    p_plan.add_argument("config", help="YAML run config (an image or video run)")
    p_plan.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    p_plan.add_argument("--gpus", type=int, default=None, help="processes (GPUs) the run is launched on (default 1)")
    p_plan.add_argument(
        "--gpu-memory", type=float, default=80.0, metavar="GB", help="memory of each GPU in GiB (default 80: an H100)"
    )
    p_export = sub.add_parser("export", help="write a run's weights in diffusers' formats (LoRA or model folder)")
    p_export.add_argument("run", help="a run folder (with config.yaml and checkpoints/)")
    p_export.add_argument("--out", required=True, help="the folder to write")
    p_export.add_argument("--checkpoint", help="a checkpoint folder (default: the run's latest)")
    p_export.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="export the EMA weights (default: when the run kept them)",
    )
    p_demos = sub.add_parser("demos", help="record a control run's policy as demonstrations (.npz) for `trainer: bc`")
    p_demos.add_argument("run", help="a control run folder (or one of its checkpoint folders)")
    p_demos.add_argument("--out", required=True, help="the .npz file to write")
    p_demos.add_argument("--episodes", type=int, default=20, help="whole episodes to record (default 20)")
    p_demos.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="std of Gaussian noise added to each action, in action units (default 0)",
    )
    p_demos.add_argument("--seed", type=int, default=0, help="first episode's seed (then seed + 1, ...)")
    p_demos.add_argument("--checkpoint", help="a checkpoint folder (default: the run's latest)")
    p_sample = sub.add_parser("sample", help="images (PNGs and a captioned grid) from a run's checkpoint")
    p_sample.add_argument("target", help="a run folder or one of its checkpoint folders")
    p_sample.add_argument(
        "--prompts", required=True, help="a prompt, a .txt/.jsonl file or a shipped prompt set (digits/test)"
    )
    p_sample.add_argument("--n", type=int, default=4, help="images per prompt (default 4)")
    p_sample.add_argument("--seed", type=int, default=0, help="noise seed: the same seed, the same images")
    p_sample.add_argument("--sampler", help="ode (default; ddim for UNets), flow_sde, dance_sde, cps, ...")
    p_sample.add_argument("--noise-level", type=float, help="the sampler's noise (default: the run's)")
    p_sample.add_argument("--num-steps", type=int, help="denoising steps (default: the run's evaluation steps)")
    p_sample.add_argument("--guidance-scale", type=float, help="default: the run's evaluation guidance")
    p_sample.add_argument("--checkpoint", default="latest", help="latest (default), best, or a checkpoint folder")
    p_sample.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="use the EMA weights (default: when the run kept them)",
    )
    p_sample.add_argument("--out", help="output folder (default: RUN/samples/<checkpoint>)")
    p_sample.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="editing models: a source image every prompt edits (repeat for several; default: an "
        "editing prompt set's own, e.g. edit_shapes/test); image-to-video models: the start "
        "frame of every prompt, or repeated, one per prompt",
    )
    p_eval = sub.add_parser("eval", help="evaluate a run folder's checkpoint, or a config's base model")
    p_eval.add_argument("target", help="a run folder (with config.yaml and checkpoints/) or a YAML config")
    p_eval.add_argument("--checkpoint", help="a checkpoint folder (default: the run's latest)")
    p_eval.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (e.g. eval.*)")
    p_eval.add_argument("--out", help="also write the result to this JSON file")
    p_ablate = sub.add_parser("ablate", help="train configs x a grid of overrides x seeds and tabulate the results")
    p_ablate.add_argument("configs", nargs="+", help="YAML run configs, or one study file (an `ablate:` section)")
    p_ablate.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="values to sweep (repeatable)")
    p_ablate.add_argument("--seeds", help="comma-separated seeds (default: the study's, else 0)")
    p_ablate.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every run")
    p_ablate.add_argument("--output-dir", help="where runs and results go (default: the study's, runs/ablation)")
    p_ablate.add_argument(
        "--threshold",
        metavar="METRIC=VALUE",
        help="report reward evaluations and seconds until METRIC first reaches VALUE",
    )
    p_ablate.add_argument(
        "--skip-done",
        action="store_true",
        help="reuse runs that already finished in --output-dir with the same config",
    )
    p_serve = sub.add_parser(
        "serve-reward",
        help="serve a reward over HTTP: one model copy for many runs (FastAPI "
        "on uvicorn: pip install 'flowrl-toolkit[serve]')",
    )
    p_serve.add_argument("name", help="a registered reward (see `flowrl list rewards`) or package.module:attribute")
    p_serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface (default 127.0.0.1: this machine only; another needs a token or --insecure)",
    )
    p_serve.add_argument(
        "--insecure",
        action="store_true",
        help="serve on a --host other than this machine's without a token (anyone who reaches the "
        "port can use the reward)",
    )
    p_serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p_serve.add_argument(
        "--token",
        help="require Authorization: Bearer TOKEN (default: $FLOWRL_REWARD_TOKEN if "
        "set, which keeps the token out of the process list)",
    )
    p_serve.add_argument("--max-batch", type=int, default=64, help="merge requests up to this many images (64)")
    p_serve.add_argument("--max-body-mb", type=float, default=256.0, help="refuse larger requests with 413 (256)")
    p_serve.add_argument(
        "--max-image-pixels",
        type=int,
        default=4096 * 4096,
        help="refuse an image of more pixels (H x W) with 413, before decoding it (4096 x 4096)",
    )
    p_serve.add_argument(
        "--max-inflight-mb",
        type=float,
        default=2048.0,
        help="memory budget of the requests in flight together: bodies and decoded pixels; beyond "
        "it a request gets 503 and is sent again (2048)",
    )
    p_serve.add_argument(
        "--batch-wait",
        type=float,
        default=0.01,
        metavar="SECONDS",
        help="how long to wait for more requests to merge (0.01)",
    )
    p_serve.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="a reward constructor argument, e.g. --set device=cuda (repeatable)",
    )
    p_score = sub.add_parser("score", help="a reward's scores for image (or video) files: check it before training")
    p_score.add_argument("reward", help="a registered reward (see `flowrl list rewards`) or package.module:attribute")
    p_score.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...) or videos (.mp4)")
    p_score_prompts = p_score.add_mutually_exclusive_group()
    p_score_prompts.add_argument("--prompt", help="the prompt of every image (default: the empty prompt)")
    p_score_prompts.add_argument(
        "--prompts",
        metavar="FILE",
        help="a .txt/.jsonl prompt file with one row per image, in order (jsonl keys go to the reward as metadata)",
    )
    p_score.add_argument(
        "--server", metavar="URL", help="score through `flowrl serve-reward REWARD` at URL (the http reward)"
    )
    p_score.add_argument(
        "--kwargs",
        metavar="JSON",
        help='the reward\'s constructor arguments, e.g. \'{"device": "cuda"}\' (with --server: the '
        "http client's, e.g. timeout_s, deadline_s (10 s here), token)",
    )
    p_score.add_argument(
        "--image",
        metavar="IMAGE",
        help="the conditioning image of every file (an image-to-video "
        "start frame, an edit's source) for the rewards that read it",
    )
    p_score.add_argument("--json", action="store_true", help="print the scores as JSON (NaN as null)")
    p_digits = sub.add_parser("digits", help="the digits world: `flowrl digits build [--force]`")
    p_digits.add_argument("action", choices=["build"])
    p_digits.add_argument("rest", nargs=argparse.REMAINDER)
    return parser
