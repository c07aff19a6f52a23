"""What a run downloads, checked first: offline, a real-model recipe ends at once in one message that lists every
missing artifact (model, reward models, processors) with its download line, before anything loads and without
the hub client's retries (`flowrl.run.artifacts`)."""

import glob
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from flowrl.cli import main
from flowrl.run.artifacts import check_artifacts, needed
from flowrl.trainers import load_config


ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(
    path
    for path in glob.glob(str(ROOT / "configs" / "*" / "*.yaml"))
    if "trainer:" in Path(path).read_text() and needed(load_config(path))
)
"""The shipped recipes that load anything from the hub (the real-model ones)."""


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, the hub switched off; nothing may load a model."""
    import flowrl.image.modality
    import flowrl.policies.build

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the artifacts were checked")

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(flowrl.policies.build, "load_policy", no_loading)
    monkeypatch.setattr(flowrl.image.modality, "build_image_policy", no_loading)
    return tmp_path / "hub"


def test_the_artifacts_of_a_recipe_are_its_model_and_its_rewards_models_and_processors():
    artifacts = needed(load_config(ROOT / "configs" / "qwen_image" / "flow_grpo_fast_pickscore.yaml"))
    assert [(a.what, a.location) for a in artifacts] == [
        ("the model", "Qwen/Qwen-Image-2512"),
        ("reward 'clip_score' model", "openai/clip-vit-large-patch14"),
        ("reward 'pickscore' model", "yuvalkirstain/PickScore_v1"),
        ("reward 'pickscore' processor", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"),
    ]
    assert len(RECIPES) >= 20


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: str(Path(path).relative_to(ROOT / "configs")))
def test_offline_a_recipe_lists_every_missing_artifact_in_one_line(recipe, empty_cache, tmp_path, capsys):
    assert main(["train", recipe, "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    artifacts = needed(load_config(recipe))
    assert f"this run needs {len(artifacts)} artifact(s) that are not on this machine" in err
    for artifact in artifacts:
        assert f"`hf download {artifact.location} --local-dir DIR`, then {artifact.setting}" in err, artifact


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_with_everything_cached_and_no_hub_the_run_goes_offline(tmp_path, monkeypatch):
    """Nothing missing but the hub unreachable: no error, and the libraries are told to read the cache only (else
    they try the network first, with retries)."""
    snapshot = tmp_path / "hub" / "models--someorg--some-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    check_artifacts(load_config({"trainer": "flow_grpo", "model": {"name": "someorg/some-model", "family": "sd3"}}))
    assert constants.HF_HUB_OFFLINE is True and os.environ["HF_HUB_OFFLINE"] == "1"


def test_without_network_a_recipe_ends_within_seconds_without_retries(tmp_path):
    """A new user's machine without hub access (no HF_HUB_OFFLINE): `flowrl train` of a real-model recipe ends in
    one line within 20 s (the hub client's retries took 45 s and 22 lines before the first artifact's error)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}")
    recipe = ROOT / "configs" / "qwen_image" / "flow_grpo_fast_pickscore.yaml"
    start = time.monotonic()
    command = [sys.executable, "-m", "flowrl", "train", str(recipe), "--output-dir", str(tmp_path / "run")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    took = time.monotonic() - start
    assert done.returncode == 2 and took < 20, (took, done.stderr[-2000:])
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "Retry" not in lines[0], lines
    assert "the hub at http://127.0.0.1:" in lines[0] and "cannot be reached" in lines[0]
    assert lines[0].count("hf download") == 4
