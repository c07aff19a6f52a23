"""The asynchronous pipeline's throughput model (`benchmarks/async_bench.py`: `pipeline`), on hand-derived numbers:
the synchronous epoch is the phases' sum; the asynchronous one is the slower of the learner's side and the rollout
side, the rollout shared by at most `min(workers, max_staleness + 1)` batches in flight while the learner waits;
staleness 0 overlaps nothing; work beyond the cores shares them."""

import importlib.util
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("async_bench", ROOT / "benchmarks" / "async_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_a_learner_bound_pipeline_loses_to_the_synchronous_run_on_too_few_threads(bench):
    # digits on two cores: the update is the longer phase, and on the learner's one thread it alone is longer
    # than the whole synchronous epoch (which has both threads for each phase)
    sync, learner = bench.Phases(1.0, 2.0, 0.5), bench.Phases(1.5, 3.0, 0.5)
    out = bench.pipeline(sync, learner, worker_rollout_s=1.5, publish_s=0.1, workers=1, staleness=1, cores=2)
    assert out["sync_s"] == 3.5  # 1 + 2 + 0.5
    assert out["async_s"] == pytest.approx(3.6)  # max(3 + 0.5 + 0.1, 1.5 / 1)
    assert out["bound"] == "learner" and not out["pays"] and out["speedup"] == pytest.approx(3.5 / 3.6)
    assert out["keep_up_workers"] == 1  # ceil(1.5 / 3.6): one worker keeps up already
    more = bench.pipeline(sync, learner, worker_rollout_s=1.5, publish_s=0.1, workers=2, staleness=2, cores=8)
    assert more["async_s"] == pytest.approx(3.6)  # learner-bound: a second worker changes nothing


def test_a_rollout_bound_pipeline_gains_from_workers_up_to_the_staleness_bound(bench):
    sync, learner = bench.Phases(4.0, 1.0), bench.Phases(4.0, 1.0)
    one = bench.pipeline(sync, learner, worker_rollout_s=4.0, publish_s=0.0, workers=1, staleness=1)
    assert (one["sync_s"], one["async_s"], one["bound"]) == (5.0, 4.0, "rollout")  # the update hides in the rollout
    # while the learner waits for epoch e, staleness 1 lets epochs e and e + 1 be sampled: two workers, a third idles
    two = bench.pipeline(sync, learner, 4.0, 0.0, workers=2, staleness=1)
    assert two["async_s"] == 2.0 and two["bound"] == "rollout" and two["speedup"] == 2.5  # max(1, 4 / 2)
    assert bench.pipeline(sync, learner, 4.0, 0.0, workers=3, staleness=1)["async_s"] == 2.0
    three = bench.pipeline(sync, learner, 4.0, 0.0, workers=3, staleness=2)
    assert three["async_s"] == pytest.approx(4 / 3)  # max(1, 4 / 3)
    assert two["keep_up_workers"] == 4  # ceil(4 / 1): past 4 workers (and staleness 3) the learner bounds
    four = bench.pipeline(sync, learner, 4.0, 0.0, workers=8, staleness=3)
    assert four["async_s"] == 1.0 and four["bound"] == "learner"  # max(1, 4 / 4): ties go to the learner


def test_staleness_zero_overlaps_nothing_and_oversubscribed_threads_share_the_cores(bench):
    sync, learner = bench.Phases(1.0, 2.0, 0.5), bench.Phases(1.0, 2.0, 0.5)
    serial = bench.pipeline(sync, learner, worker_rollout_s=1.0, publish_s=0.25, workers=3, staleness=0)
    assert serial["async_s"] == 3.75 and serial["bound"] == "serial"  # 1 + 2 + 0.5 + 0.25
    # per 2.5 s epoch (learner-bound: max(2.5, 3 / 2)) the learner works 2.5 s and the workers 3 s: 5.5
    # thread-seconds on two cores that give 5 in the epoch, so every phase slows by 1.1
    shared = bench.pipeline(sync, learner, worker_rollout_s=3.0, publish_s=0.0, workers=2, staleness=2, cores=2)
    assert shared["oversubscribed"] and shared["async_s"] == pytest.approx(2.5 * 5.5 / 5)
    own = bench.pipeline(sync, learner, worker_rollout_s=3.0, publish_s=0.0, workers=2, staleness=2, cores=3)
    assert not own["oversubscribed"] and own["async_s"] == 2.5


def test_the_docs_comparison_is_the_stored_run_tabulated_by_this_model():
    """docs/async.md's prediction-vs-measurement table is what `async_bench.py --tabulate` prints for the stored runs
    (the predictions made again by the current model): a change to the model or the results shows in the docs."""
    import subprocess

    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "async_bench.py"), "--tabulate"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    printed, config = set(), None
    for line in done.stdout.splitlines():
        if line.startswith("configs/"):
            config = line.split(":")[0].removeprefix("configs/").removesuffix(".yaml")
        elif line.startswith("| ") and "epoch s" not in line and "devices" not in line and line.count("|") == 10:
            printed.add(f"| `{config}` " + line)
    docs = (ROOT / "docs" / "async.md").read_text()
    rows = {line for line in docs.splitlines() if line.startswith("| `digits/") or line.startswith("| `wan/")}
    assert len(printed) == 8 and rows == printed
