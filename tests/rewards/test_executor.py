import threading

import pytest
import torch

from flowrl.rewards import RewardExecutor


def test_submit_returns_while_the_reward_runs_and_copies_the_images():
    started, release = threading.Event(), threading.Event()

    def slow(images, prompts):
        started.set()
        assert release.wait(10)
        return images.mean(dim=(1, 2, 3))

    images = torch.rand(2, 3, 4, 4)
    expected = images.mean(dim=(1, 2, 3))
    with RewardExecutor(slow, max_workers=1) as pool:
        future = pool.submit(images, ["a", "b"])
        assert started.wait(10) and not future.done()  # the caller is free to sample the next batch now
        images.zero_()  # the next batch overwrites the buffer: the submitted copy is unaffected
        release.set()
        torch.testing.assert_close(future.result(timeout=10), expected)


def test_two_workers_score_two_batches_at_once():
    both = threading.Barrier(2, timeout=10)

    def meet(images, prompts):
        both.wait()  # only returns when both batches are being scored concurrently
        return torch.ones(len(prompts))

    with RewardExecutor(meet, max_workers=2) as pool:
        futures = [pool.submit(torch.zeros(1, 3, 2, 2), ["a"]) for _ in range(2)]
        assert [f.result(timeout=10).tolist() for f in futures] == [[1.0], [1.0]]


def test_inline_mode_and_errors_surface_at_result():
    def failing(images, prompts):
        raise RuntimeError("reward server down")

    pool = RewardExecutor(failing, max_workers=0)
    future = pool.submit(torch.zeros(1, 3, 2, 2), ["a"])
    assert future.done()
    with pytest.raises(RuntimeError, match="reward server down"):
        future.result()
    with pytest.raises(ValueError, match="max_workers"):
        RewardExecutor(failing, max_workers=-1)
