"""The `ocr` reward: Flow-GRPO's rule on hand-checked strings, and RapidOCR's real (bundled) models on PIL text."""

from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl import rewards
from flowrl.rewards.ocr import edit_distance, normalise, ocr_reward


pytest.importorskip("rapidocr_onnxruntime")
from PIL import Image, ImageDraw, ImageFont  # noqa: E402


DEJAVU = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")


def _fonts() -> dict:
    fonts = {"bitmap": ImageFont.load_default_imagefont()}  # PIL's built-in bitmap font (about 11 px high)
    fonts.update({f"default-{size}": ImageFont.load_default(size=size) for size in (16, 32, 48)})
    if DEJAVU.is_file():
        fonts["dejavu-28"] = ImageFont.truetype(str(DEJAVU), 28)
    return fonts


def render(text: str, font, size=(256, 128)) -> torch.Tensor:
    """Black `text` centred on a white image, as `[3, H, W]` in [0, 1]."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size[0] - right + left) / 2 - left, (size[1] - bottom + top) / 2 - top), text, "black", font=font)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


def test_normalisation_and_edit_distance_by_hand():
    assert normalise("Hello World ") == "helloworld"
    assert normalise("a\tb") == "a\tb"  # spaces only, as Flow-GRPO
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "abc") == 0
    assert ocr_reward("Hello World", "Hello World") == 1.0
    assert ocr_reward("hello world", "HELLO WORLD") == 1.0  # case and spaces ignored
    assert ocr_reward("Hel1o World", "Hello World") == pytest.approx(0.9)  # 1 substitution / 10
    assert ocr_reward("Helo World", "Hello World") == pytest.approx(0.9)  # 1 insertion / 10
    assert ocr_reward("Cafe", "Open Cafe") == pytest.approx(1 - 4 / 8)  # "cafe" -> "opencafe": 4 insertions / 8
    assert ocr_reward("GRAND OPEN SALE TODAY", "open") == 1.0  # a substring counts as found
    assert ocr_reward("", "Open") == 0.0  # nothing read
    assert ocr_reward("completely unrelated words", "Open") == 0.0  # the distance is clipped to len(target)
    with pytest.raises(ValueError, match="empty"):
        ocr_reward("x", "   ")


def test_registered_and_refuses_prompts_without_quotes():
    assert "ocr" in rewards.list_rewards()
    reward = rewards.get("ocr")
    reward.check_prompts(['a sign that says "Open"', 'a mug with "Tea" on it'])
    with pytest.raises(ValueError, match="double quotes"):
        reward.check_prompts(['a sign that says "Open"', "a red apple"])
    with pytest.raises(ValueError, match="double quotes"):
        reward(torch.ones(1, 3, 32, 32), ["a red apple"])


def test_real_ocr_scores_right_wrong_and_blank_images():
    reward = rewards.get("ocr")
    fonts = _fonts()
    right = [render("Hello World", font) for font in fonts.values()]
    wrong = [render("Quiet Cinema", font) for font in fonts.values()]
    blank = torch.ones(1, 3, 128, 256)
    images = torch.cat([torch.stack(right), torch.stack(wrong), blank])
    prompts = ['a wooden sign that says "Hello World"'] * len(images)
    scores = reward(images, prompts)
    n = len(fonts)
    for i, name in enumerate(fonts):
        assert scores[i] >= 0.9, (name, scores[i])
        assert scores[n + i] <= 0.5, (name, scores[n + i])
    assert scores[-1] == 0.0  # no text found
    # the metadata's `text` (prompts.load fills it from the quoted span) takes precedence over the prompt
    scores = reward(torch.stack([wrong[-1], wrong[-1]]), ["x", "y"], text=["Quiet Cinema", "Hello World"])
    assert scores[0] >= 0.9 and scores[1] <= 0.5


@pytest.mark.distributed
def test_flowrl_score_ocr_directly_and_through_flowrl_serve_reward(tmp_path):
    """The issue's check end to end: `flowrl score ocr` on PIL-rendered images of the quoted text (>= 0.9) and of
    other text (<= 0.5), offline, directly and through a `flowrl serve-reward ocr` subprocess."""
    import json
    import os
    import subprocess
    import sys

    from tests.rewards.test_http import _stop, _wait_for_url, free_port

    font = _fonts()["default-32"]
    paths = []
    for name, text in (("right", "Hello World"), ("wrong", "Quiet Cinema")):
        array = (render(text, font).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        paths.append(str(tmp_path / f"{name}.png"))
        Image.fromarray(array).save(paths[-1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    score = [
        sys.executable,
        "-m",
        "flowrl",
        "score",
        "ocr",
        *paths,
        "--prompt",
        'a sign that says "Hello World"',
        "--json",
    ]

    def scores(*extra):
        out = subprocess.run([*score, *extra], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        return [row["score"] for row in rows["files"]]

    direct = scores()
    assert direct[0] >= 0.9 and direct[1] <= 0.5, direct
    port = free_port()
    command = [sys.executable, "-m", "flowrl", "serve-reward", "ocr", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        import queue
        import threading

        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
        url = _wait_for_url(lines)
        assert scores("--server", url) == direct  # the same pixels (raw uint8 on the wire), the same scores
    finally:
        _stop(server)
