"""`sum_gradients`: every gradient summed over the processes in a few bucketed collectives, not one per tensor.

The collective is replaced by a stand-in for two processes holding the same gradients (the sum doubles each flat
bucket), which records what each call carried; the real two-process sums are the `distributed` tier's (a run on
two processes equals one: tests/test_distributed.py)."""

import pytest
import torch

from flowrl.core import dist


@pytest.fixture
def collectives(monkeypatch):
    calls = []

    def all_reduce(flat, op=None):
        calls.append((flat.dtype, flat.numel()))
        flat.mul_(2)  # two processes holding the same values

    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return calls


def _params():
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2), (7,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64)))
    for p in params[:2] + params[3:]:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    params[0].grad = params[0].grad.t().contiguous().t()  # a gradient that is not row-major keeps its layout
    return params  # params[2] has no gradient (a process whose share of the batch was empty)


def test_gradients_are_summed_in_one_collective_per_dtype(collectives):
    params = _params()
    before = [None if p.grad is None else p.grad.clone() for p in params]
    dist.sum_gradients(params)
    for p, grad in zip(params, before):
        expected = torch.zeros_like(p) if grad is None else 2 * grad
        assert torch.equal(p.grad, expected)
    assert params[0].grad.stride() == (1, 3)
    assert collectives == [(torch.float32, 12 + 5 + 4 + 7), (torch.float64, 4)]


def test_a_bucket_holds_at_most_bucket_bytes(collectives):
    params = _params()
    before = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    dist.sum_gradients(params, bucket_bytes=4 * 16)  # 16 fp32 values: a tensor larger than that has its own bucket
    assert collectives == [(torch.float32, 12), (torch.float32, 5 + 4 + 7), (torch.float64, 4)]
    assert all(torch.equal(p.grad, 2 * grad) for p, grad in zip(params, before))


def test_one_process_leaves_the_gradients_alone(monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: pytest.fail("no collective on one process"))
    params = _params()
    dist.sum_gradients(params)
    assert params[2].grad is None
