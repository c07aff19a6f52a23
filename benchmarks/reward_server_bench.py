"""Reward server throughput and latency: the stdlib server of an earlier commit against the FastAPI/uvicorn one.

    python benchmarks/reward_server_bench.py            # about 2 minutes
    python benchmarks/reward_server_bench.py --quick    # a 20 s smoke run

The old implementation (`rewards/server.py` and `rewards/http.py` of `--old-ref`, default 81f42df: a stdlib
`ThreadingHTTPServer` and a urllib client that opens a connection per request) is read with `git show` into a
temporary folder and imported from there; the new one is this checkout's. Both serve the same reward (`--reward`,
default `jpeg_compressibility`), each in its own subprocess with its default settings (`max_batch` 64,
`batch_wait_s` 0.01), both started before the first measurement and measured in turn (old, new) for every case, so
that a change in the machine's load hits both.

A case is an image size and a number of client processes (forked, each with its own `HttpReward` of its
implementation) that send the same batch of `--batch` images in a loop; the measurement window is `--seconds` long
and starts `--warmup` seconds after the clients. Reported per implementation, case and format (`png`, and `raw`
with uint8 pixels): images/s (each request counts for the part of it inside the window, so a request longer than
the window still counts right) and the p50/p99 latency of one request as the client sees it (encoding, HTTP, the
server's decoding, batching and scoring). Writes `benchmarks/results/reward_server_bench.json` and prints a
markdown table. Clients and servers share the machine's cores, as a trainer and a reward server on one machine do.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "reward_server_bench.json"
FORMATS = {"png": {"format": "png"}, "raw": {"format": "raw", "raw_dtype": "uint8"}}
"""Client arguments of each benchmarked format (both implementations take them)."""

SERVER = """
import sys
impl, folder, reward_name = sys.argv[1:4]
if impl == "old":
    sys.path.insert(0, folder)
    from old_server import RewardServer
else:
    from flowrl.rewards.serving.server import RewardServer
from flowrl import rewards

if reward_name == "mean":
    reward = lambda images, prompts, **metadata: images.mean(dim=(1, 2, 3))
else:
    reward = rewards.get(reward_name)
server = RewardServer(reward, name=reward_name, port=0)
print(server.url, flush=True)
server.serve_forever()
"""


def old_implementation(ref: str, folder: Path) -> None:
    """`rewards/http.py` and `rewards/server.py` of `ref` as the modules `old_http` and `old_server` in `folder`
    (the old client is not registered as a reward: the registry has this checkout's `http`)."""
    for name in ("http", "server"):
        try:
            text = subprocess.run(
                ["git", "show", f"{ref}:rewards/{name}.py"], cwd=ROOT, check=True, capture_output=True, text=True
            ).stdout
        except subprocess.CalledProcessError as err:
            raise SystemExit(
                f"reward_server_bench: cannot read rewards/{name}.py at {ref}: {err.stderr.strip()}"
            ) from None
        text = text.replace("from flowrl.rewards.http import", "from old_http import")
        text = "\n".join(line for line in text.splitlines() if not line.startswith("@register("))
        (folder / f"old_{name}.py").write_text(text + "\n")


def start_server(impl: str, folder: Path, reward: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, impl, str(folder), reward],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = process.stdout.readline().strip()
    if not url.startswith("http://"):
        process.kill()
        raise SystemExit(f"reward_server_bench: the {impl} server did not start (exit code {process.wait()})")
    return process, url


def client(
    impl: str, url: str, size: int, batch: int, fmt: str, start_at: float, end_at: float, seed: int, results
) -> None:
    """One client process: the same batch in a loop from `start_at` until `end_at`; puts `(requests as (start, end,
    whether it was the first), errors)` on `results`."""
    import torch

    torch.set_num_threads(1)
    if impl == "old":
        from old_http import HttpReward
    else:
        from flowrl.rewards.serving.http import HttpReward
    reward = HttpReward(url, batch_size=batch, **FORMATS[fmt])
    images = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))
    prompts = [f"a photo of a cat, client {seed}"] * batch
    requests, errors = [], []
    time.sleep(max(start_at - time.time(), 0))
    first = True
    while first or time.time() < end_at:
        begin = time.time()
        try:
            reward(images, prompts)
            requests.append((begin, time.time(), first))
        except Exception as err:  # noqa: BLE001  (counted and reported, not fatal)
            errors.append(f"{type(err).__name__}: {err}"[:200])
        first = False
    results.put((requests, errors))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(round(q / 100 * (len(ordered) - 1))), len(ordered) - 1)]


def measure(impl: str, url: str, size: int, clients: int, batch: int, fmt: str, warmup: float, seconds: float) -> dict:
    """One implementation on one case: `clients` forked processes, measured over one window of `seconds` that
    starts `warmup` seconds after they start. A request counts for the part of it inside the window (images/s
    is unbiased however long a request takes); the latencies are those of the requests that end in the window or
    after it, each client's first request (connecting, first-call costs) left out unless there are no others."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    start_at = time.time() + 0.3  # every client starts together
    window = (start_at + warmup, start_at + warmup + seconds)
    processes = [
        context.Process(target=client, args=(impl, url, size, batch, fmt, start_at, window[1], i, results))
        for i in range(clients)
    ]
    for process in processes:
        process.start()
    gathered = [results.get(timeout=warmup + seconds + 600) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    requests = [r for found, _ in gathered for r in found]
    errors = [e for _, found in gathered for e in found]
    inside = sum(
        batch * max(0.0, min(end, window[1]) - max(begin, window[0])) / max(end - begin, 1e-9)
        for begin, end, _ in requests
    )
    timed = [r for r in requests if r[1] > window[0]]
    latencies = [end - begin for begin, end, first in timed if not first] or [end - begin for begin, end, _ in timed]
    return {
        "server": impl,
        "size": size,
        "clients": clients,
        "batch": batch,
        "format": fmt,
        "images_per_s": round(inside / seconds, 1),
        "p50_ms": round(1000 * percentile(latencies, 50), 1),
        "p99_ms": round(1000 * percentile(latencies, 99), 1),
        "requests": len(latencies),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def table(rows: list[dict]) -> str:
    by = {(r["server"], r["size"], r["clients"], r["format"]): r for r in rows}
    lines = [
        "| images | clients | format | old images/s | new images/s | speed-up | old p50 / p99 ms | new p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (server, size, clients, fmt), old in by.items():
        new = by.get(("new", size, clients, fmt))
        if server != "old" or new is None:
            continue
        speedup = new["images_per_s"] / old["images_per_s"] if old["images_per_s"] else float("nan")
        lines.append(
            f"| {old['batch']} x {size} px | {clients} | {fmt} | {old['images_per_s']:g} | "
            f"{new['images_per_s']:g} | {speedup:.2f}x | {old['p50_ms']:g} / {old['p99_ms']:g} | "
            f"{new['p50_ms']:g} / {new['p99_ms']:g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-ref", default="81f42df", help="the commit of the old server and client (81f42df)")
    parser.add_argument(
        "--reward",
        default="jpeg_compressibility",
        help="a registered reward both servers serve, or `mean` (default jpeg_compressibility)",
    )
    parser.add_argument(
        "--cases",
        default="8x8,512x4",
        metavar="SIZExCLIENTS,...",
        help="image size x client processes (default 8x8,512x4)",
    )
    parser.add_argument("--formats", default="png,raw", help="png and/or raw (uint8 pixels); default both")
    parser.add_argument("--batch", type=int, default=16, help="images per request (16)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per case (8)")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds per case not counted (1.5)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 8 images per request, 1 s per case after 0.3 s of warm-up"
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"the JSON report (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.warmup, args.batch = 1.0, 0.3, min(args.batch, 8)
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
    formats = args.formats.split(",")
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"unknown format(s) {unknown}; choose from {', '.join(FORMATS)}")

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="reward-server-bench-") as folder:
        folder = Path(folder)
        old_implementation(args.old_ref, folder)
        sys.path.insert(0, str(folder))  # the forked old clients import old_http
        import httpx  # noqa: F401  (everything the clients use is imported before they fork)
        import old_http  # noqa: F401
        import PIL.PngImagePlugin  # noqa: F401

        import flowrl.rewards.serving.http  # noqa: F401

        servers = {impl: start_server(impl, folder, args.reward) for impl in ("old", "new")}
        rows = []
        try:
            for size, clients in cases:
                for fmt in formats:
                    for impl, (_, url) in servers.items():
                        row = measure(impl, url, size, clients, args.batch, fmt, args.warmup, args.seconds)
                        rows.append(row)
                        print(
                            f"{impl} {size} px x {clients} clients, {fmt}: {row['images_per_s']:g} images/s, "
                            f"p50 {row['p50_ms']:g} ms, p99 {row['p99_ms']:g} ms ({row['requests']} requests, "
                            f"{row['errors']} errors)",
                            flush=True,
                        )
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(timeout=30)

    import torch

    report = {
        "note": "old: rewards/server.py + rewards/http.py of old_ref (stdlib ThreadingHTTPServer, urllib client, "
        "a connection per request); new: this checkout (FastAPI on uvicorn, httpx client with keep-alive). "
        "raw = raw uint8 pixels. Clients are processes on the same machine as the server.",
        "old_ref": args.old_ref,
        "reward": args.reward,
        "batch": args.batch,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "wall_s": round(time.time() - started, 1),
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(table(rows))
    print(f"\n{report['wall_s']} s; wrote {args.out}")


if __name__ == "__main__":
    main()
