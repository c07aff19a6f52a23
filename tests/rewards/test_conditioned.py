"""Rewards for conditioned video (`rewards/conditioned.py`), each against a value computed by hand, and `flowrl score`
with a conditioning image."""

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl import rewards
from flowrl.rewards import RewardError
from flowrl.score import score_files
from flowrl.video import write_mp4
from tests.rewards.tiny_models import save_tiny_clip


def _video(values, size=4):
    """`[B, 3, F, size, size]`: sample b, frame f is the constant `values[b][f]`."""
    v = torch.tensor(values, dtype=torch.float32)
    return v[:, None, :, None, None].expand(-1, 3, -1, size, size).clone()


def test_first_frame_fidelity_is_one_minus_the_mean_absolute_difference_to_the_start_image():
    videos = _video([[0.5, 0.9, 0.1], [0.2, 0.2, 0.2]])
    start = torch.full((2, 1, 3, 4, 4), 0.5)
    start[1, 0, 0] = 0.8  # sample 1: red channel 0.8, green and blue 0.5
    reward = rewards.get("first_frame_fidelity")
    # sample 0: the first frame equals the start image; sample 1: |0.2 - 0.8| on one channel, |0.2 - 0.5| on two
    expected = torch.tensor([1.0, 1 - (0.6 + 0.3 + 0.3) / 3])
    torch.testing.assert_close(reward(videos, ["a", "b"], source_images=start), expected)
    # over the first two frames: sample 0 averages |0.5 - 0.5| and |0.9 - 0.5|
    two = rewards.get("first_frame_fidelity", frames=2)
    assert two(videos, ["a", "b"], source_images=start)[0].item() == pytest.approx(1 - 0.2)
    with pytest.raises(ValueError, match="start images"):
        reward(videos, ["a", "b"])


def test_first_frame_fidelity_resizes_the_start_image_to_the_frames():
    videos = _video([[0.25, 0.0]], size=8)
    start = torch.full((1, 1, 3, 2, 2), 0.25)  # constant: any resize keeps it
    assert rewards.get("first_frame_fidelity")(videos, ["a"], source_images=start).item() == pytest.approx(1.0)


def test_motion_is_the_mean_frame_change_over_a_target_capped_at_one_and_zero_when_still():
    videos = _video([[0.1, 0.1, 0.1], [0.1, 0.11, 0.13], [0.0, 1.0, 0.0]])
    reward = rewards.get("motion", target=0.02)
    # sample 1: changes 0.01 and 0.02, mean 0.015, over 0.02: 0.75; sample 2: mean change 1, capped at 1
    torch.testing.assert_close(reward(videos, ["a"] * 3), torch.tensor([0.0, 0.75, 1.0]))
    assert rewards.get("motion")(_video([[0.3]]), ["a"]).item() == 0.0  # one frame: no motion
    still = rewards.get("temporal_consistency")(videos, ["a"] * 3)
    assert still[0] == 1.0 and reward(videos, ["a"] * 3)[0] == 0.0  # the still video: consistent, but no motion
    with pytest.raises(ValueError, match="target"):
        rewards.get("motion", target=0)


def test_first_frame_similarity_is_the_cosine_of_clip_image_embeddings(tmp_path):
    folder = save_tiny_clip(tmp_path / "clip")
    reward = rewards.get("first_frame_similarity", model=str(folder))
    torch.manual_seed(0)
    start = torch.rand(2, 1, 3, 32, 32)
    other = torch.rand(2, 3, 32, 32)
    videos = torch.stack([start[:, 0], other], dim=2)  # [2, 3, 2, 32, 32]: the start image, then another frame
    torch.testing.assert_close(reward(videos, ["a", "b"], source_images=start), torch.ones(2), rtol=0, atol=1e-6)
    # the second frame against the start image, by hand: CLIP's image tower, projection, unit norm, dot product
    clip = reward.clip.model
    pixels = reward.clip.image_settings
    a = clip.visual_projection(clip.vision_model(pixel_values=pixels(other)).pooler_output)
    b = clip.visual_projection(clip.vision_model(pixel_values=pixels(start[:, 0])).pooler_output)
    by_hand = (a / a.norm(dim=-1, keepdim=True) * b / b.norm(dim=-1, keepdim=True)).sum(-1)
    shifted = torch.stack([other, start[:, 0]], dim=2)
    torch.testing.assert_close(reward(shifted, ["a", "b"], source_images=start), by_hand.detach(), rtol=0, atol=1e-6)
    both = rewards.get("first_frame_similarity", model=str(folder), frames=2)
    torch.testing.assert_close(both(videos, ["a", "b"], source_images=start), (1 + by_hand.detach()) / 2)


def test_vlm_i2v_shows_the_start_frame_then_the_frames_then_the_question():
    from flowrl.rewards.vlm_judges import to_pixels

    judge = rewards.get("vlm_i2v", url="http://127.0.0.1:1", model="m", frames=3)
    assert judge.needs_source_images and judge.video
    videos = torch.rand(2, 3, 5, 8, 8)
    start = torch.rand(2, 1, 3, 8, 8)
    question = judge.questions(videos, ["a cat runs", "a dog"], source_images=start)[0]
    expected = [start[0, 0], videos[0, :, 0], videos[0, :, 2], videos[0, :, 4]]
    assert len(question.images) == 4 and all(
        np.array_equal(a, to_pixels(b)) for a, b in zip(question.images, expected)
    )
    assert question.text.startswith("The first image is the start frame") and '"a cat runs"' in question.text
    assert "the next 3 images" in question.text and "Final Score:" in question.text
    with pytest.raises(ValueError, match="start images"):
        judge.questions(videos, ["a", "b"])


def test_flowrl_score_passes_a_conditioning_image_to_the_rewards_that_read_it(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    start = tmp_path / "start.png"
    Image.fromarray(np.full((16, 16, 3), 128, dtype=np.uint8)).save(start)
    video = torch.full((3, 5, 16, 16), 128 / 255)
    video[:, 1:] = 0.0  # the first frame is the start image, the rest black
    write_mp4(video, tmp_path / "clip.mp4")
    record = score_files("first_frame_fidelity", [str(tmp_path / "clip.mp4")], image=str(start))
    assert record["files"][0]["score"] == pytest.approx(1.0, abs=0.02)  # H.264 is lossy by a few levels
    moving = score_files("motion", [str(tmp_path / "clip.mp4")], image=str(start))["files"][0]["score"]
    assert moving == pytest.approx(1.0)  # mean change (128/255) / 4 far above the target; motion ignores the image
    with pytest.raises(RewardError, match="start images"):
        score_files("first_frame_fidelity", [str(tmp_path / "clip.mp4")])
