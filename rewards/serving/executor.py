"""Score rewards in background threads so a trainer can sample the next batch meanwhile.

Flow-GRPO and ddpo-pytorch submit `reward_fn(images, prompts, metadata)` to a `ThreadPoolExecutor` right after
each sampling batch and collect the results before computing advantages. PyTorch releases the GIL inside its
kernels and PIL while encoding, so reward models (often on another device, or JPEG encoding on the CPU) run
while the policy samples.

    with RewardExecutor(reward, max_workers=1) as pool:
        futures = [pool.submit(sample(batch).images, batch.prompts) for batch in batches]
        scores = torch.cat([f.result() for f in futures])
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class RewardExecutor:
    """A thread pool for one reward callable.

    Args:
        reward (`Callable`): `reward(images, prompts, **metadata) -> Tensor[B]`.
        max_workers (`int`, defaults to 1): worker threads; `0` runs each call inline at `submit` (for
            debugging: same interface, exceptions at `result()`).
    """

    def __init__(self, reward: Callable[..., Any], max_workers: int = 1):
        if max_workers < 0:
            raise ValueError(f"max_workers must be >= 0, got {max_workers}")
        self.reward = reward
        self.max_workers = max_workers
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="flowrl-reward") if max_workers else None

    def submit(self, images: torch.Tensor, prompts, **metadata) -> Future:
        """Start scoring `images` (detached, so later in-place edits by the caller cannot race) and return a Future."""
        images = images.detach().clone() if isinstance(images, torch.Tensor) else images
        prompts = list(prompts)
        if self._pool is not None:
            return self._pool.submit(self.reward, images, prompts, **metadata)
        future: Future = Future()
        try:
            future.set_result(self.reward(images, prompts, **metadata))
        except Exception as err:  # surfaced at future.result(), as a worker thread would
            future.set_exception(err)
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Stop accepting work; with `wait`, finish the pending calls first."""
        if self._pool is not None:
            self._pool.shutdown(wait=wait)

    def __enter__(self) -> RewardExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown(wait=True)
