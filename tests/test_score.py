"""`flowrl score`: a reward's scores for image files, as a table or JSON, in process or through a reward server."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.cli import main
from flowrl.rewards.jpeg import JpegCompressibility
from tests.rewards.test_http import _start_cli_server, _wait_for_url


MULTI = '{"weights": {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5}}'


def nan_for_cats(images, prompts, **metadata):
    """A user reward (`tests.test_score:nan_for_cats`): NaN for a cat, else the mean pixel plus `bonus`."""
    bonus = torch.tensor([float(b) for b in metadata.get("bonus", [0] * len(prompts))])
    scores = images.mean(dim=(1, 2, 3)) + bonus
    scores[[i for i, p in enumerate(prompts) if "cat" in p]] = math.nan
    return scores


@pytest.fixture
def files(tmp_path):
    """A flat grey image, uniform noise, and a smaller greyscale one (converted to RGB; scored in its own batch)."""
    rng = np.random.default_rng(0)
    paths = [tmp_path / "flat.png", tmp_path / "noise.png", tmp_path / "gray.png"]
    Image.new("RGB", (64, 64), (120, 120, 120)).save(paths[0])
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(paths[1])
    Image.fromarray(rng.integers(0, 256, (32, 48), dtype=np.uint8), mode="L").save(paths[2])
    return [str(p) for p in paths]


def score_json(capsys, argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_jpeg_scores_a_flat_image_above_noise_and_match_the_reward(files, capsys):
    record = score_json(capsys, ["score", "jpeg_compressibility", *files])
    scores = [row["score"] for row in record["files"]]
    assert [row["file"] for row in record["files"]] == files
    assert scores[0] > scores[2] > scores[1]  # flat compresses best, noise worst
    pixels = torch.from_numpy(np.array(Image.open(files[1]))).permute(2, 0, 1)[None].float() / 255
    assert scores[1] == pytest.approx(JpegCompressibility()(pixels, [""]).item())
    assert record["count"] == 3 and record["nan"] == 0 and record["mean"] == pytest.approx(sum(scores) / 3)

    assert main(["score", "jpeg_compressibility", *files]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["file", "score"]
    assert lines[2].startswith(files[1]) and lines[2].endswith(f"{scores[1]:.4f}")
    assert lines[-1].startswith("3 files scored by 'jpeg_compressibility': mean ") and lines[-1].endswith("NaN: 0")


def test_multi_shows_each_component(files, capsys):
    record = score_json(capsys, ["score", "multi", *files[:2], "--kwargs", MULTI])
    assert record["components"] == ["jpeg_compressibility", "jpeg_incompressibility"]
    for row in record["files"]:
        parts = row["components"]
        assert parts["jpeg_incompressibility"] == pytest.approx(-parts["jpeg_compressibility"])
        assert row["score"] == pytest.approx(parts["jpeg_compressibility"] + 0.5 * parts["jpeg_incompressibility"])
    assert main(["score", "multi", *files[:2], "--kwargs", MULTI]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["file", "score", "jpeg_compressibility", "jpeg_incompressibility"]
    assert out[-1].endswith("score = 1 * jpeg_compressibility + 0.5 * jpeg_incompressibility")


def test_prompts_file_rows_and_metadata_reach_the_reward_and_nan_is_counted(files, tmp_path, capsys):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(
        '{"prompt": "a dog", "bonus": 1}\n{"prompt": "a cat", "bonus": 0}\n{"prompt": "a fox", "bonus": 2}\n'
    )
    record = score_json(capsys, ["score", "tests.test_score:nan_for_cats", *files, "--prompts", str(rows)])
    scores = [row["score"] for row in record["files"]]
    assert [row["prompt"] for row in record["files"]] == ["a dog", "a cat", "a fox"]
    assert scores[1] is None and record["nan"] == 1  # NaN is JSON null, and counted
    assert scores[0] == pytest.approx(120 / 255 + 1, abs=1e-6) and scores[2] > 2
    assert record["mean"] == pytest.approx((scores[0] + scores[2]) / 2)
    assert main(["score", "tests.test_score:nan_for_cats", *files, "--prompts", str(rows)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["file", "prompt", "score"] and lines[2].split()[-1] == "NaN"
    assert "mean" in lines[-1] and "over the finite scores; NaN: 1" in lines[-1]

    record = score_json(capsys, ["score", "tests.test_score:nan_for_cats", files[0], "--prompt", "a bird"])
    assert record["files"][0]["prompt"] == "a bird" and record["files"][0]["score"] == pytest.approx(120 / 255)


def test_a_video_file_is_scored_frame_by_frame(tmp_path, capsys):
    pytest.importorskip("imageio_ffmpeg")
    from flowrl.video import read_mp4, write_mp4

    path = write_mp4(torch.rand(3, 4, 16, 16, generator=torch.Generator().manual_seed(0)), tmp_path / "clip.mp4")
    record = score_json(capsys, ["score", "jpeg_compressibility", str(path)])
    expected = JpegCompressibility()(read_mp4(path)[None], [""]).item()  # the mean over the frames
    assert record["files"][0]["score"] == pytest.approx(expected)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["jpeg_compresibility", "{flat}"],
            "unknown reward 'jpeg_compresibility'. Did you mean 'jpeg_compressibility'",
        ),
        (["jpeg_compressibility", "{flat}", "{dir}/missing.png"], "no such image file: {dir}/missing.png"),
        (["jpeg_compressibility", "{dir}/broken.png"], "cannot read the image {dir}/broken.png: "),
        (["jpeg_compressibility", "{dir}"], "{dir} is a folder: pass image files"),
        (["jpeg_compressibility", "{flat}", "--prompts", "{dir}/two.txt"], "holds 2 prompts for 1 file: give one"),
        (["jpeg_compressibility", "{flat}", "--kwargs", "{quality: 5}"], "--kwargs is not valid JSON"),
        (["jpeg_compressibility", "{flat}", "--kwargs", "[5]"], "--kwargs must be a JSON object"),
        (
            ["jpeg_compressibility", "{flat}", "--kwargs", '{"qualty": 5}'],
            "reward 'jpeg_compressibility' takes no argument 'qualty'; its arguments: quality,",
        ),
        (
            ["jpeg_compressibility", "{flat}", "--server", "http://127.0.0.1:1", "--kwargs", '{"quality": 5}'],
            "with --server the reward's own arguments are the server's",
        ),
    ],
)
def test_bad_input_is_one_line(files, tmp_path, capsys, argv, message):
    (tmp_path / "broken.png").write_text("not an image")
    (tmp_path / "two.txt").write_text("one\ntwo\n")
    fill = lambda text: text.replace("{flat}", files[0]).replace("{dir}", str(tmp_path))  # noqa: E731
    assert main(["score", *map(fill, argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowrl score: ") and err.count("\n") == 1, err
    assert fill(message) in err, err
    assert "internal error" not in err


def test_through_a_server_the_scores_are_the_same(files, capsys):
    process, lines = _start_cli_server(0)
    try:
        url = _wait_for_url(lines)
        local = score_json(capsys, ["score", "jpeg_compressibility", *files])
        served = score_json(capsys, ["score", "jpeg_compressibility", *files, "--server", url])
        assert served["server"] == url
        assert [r["score"] for r in served["files"]] == [r["score"] for r in local["files"]]  # PNG: exact 8-bit pixels
        assert main(["score", "jpeg_incompressibility", files[0], "--server", url]) == 2
        err = capsys.readouterr().err
        assert f"the reward server at {url}/score serves 'jpeg_compressibility', not 'jpeg_incompressibility'" in err
    finally:
        process.kill()
        process.wait(timeout=10)
