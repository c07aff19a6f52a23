"""A plan's trace remembers `meta` ops' outputs (flowrl/plan/meta_memo.py): a remembered op's outputs are new tensors
of the shapes, strides and dtypes the op made, and a trace counts the same bytes and FLOPs with the memo as without."""

import pytest
import torch

from flowrl.plan.meta_memo import MetaMemo, _key
from flowrl.plan.trace import CudaAutocast, GpuAttention, LiveMemory


aten = torch.ops.aten


def test_a_repeated_op_is_built_from_memory_as_a_new_tensor():
    x = torch.empty(4, 8, device="meta")
    w = torch.empty(16, 8, device="meta").t()  # a transposed input: its strides are part of the key
    mem = LiveMemory()
    with mem:
        a = x @ w
        b = x @ w
    assert mem.memo.hits == 1
    assert (b.shape, b.stride(), b.dtype) == (a.shape, a.stride(), a.dtype) == ((4, 16), (16, 1), torch.float32)
    assert b.untyped_storage()._cdata != a.untyped_storage()._cdata
    assert mem.current == 2 * 4 * 16 * 4  # both outputs counted (x and w were not registered)
    assert mem.flops == 2 * (2 * 4 * 8 * 16)  # the remembered call's FLOPs too


def test_views_in_place_ops_real_tensors_and_aliasing_kernels_are_not_remembered():
    memo = MetaMemo()
    x = torch.empty(4, 8, device="meta")
    assert memo.lookup(aten.view.default, (x, [32]), {}) == (None, None)  # a view: the input's storage
    assert memo.lookup(aten.add_.Tensor, (x, x), {}) == (None, None)  # in place
    assert memo.lookup(aten.mm.default, (torch.ones(2, 2), torch.ones(2, 2)), {}) == (None, None)  # real data
    key, found = memo.lookup(aten.clone.default, (x,), {})
    assert key is not None and found is None
    memo.store(key, x, 0, aliased=True)  # a kernel that handed back its input is never remembered
    assert memo.lookup(aten.clone.default, (x,), {}) == (None, None)
    # arguments equal in Python but not to an op are different keys
    assert len({_key(1), _key(1.0), _key(True)}) == 3


def test_an_op_whose_schema_hides_a_view_is_counted_as_the_view_it_is():
    # `_unsafe_view` declares no alias but returns its input's storage (a reshape in Qwen2.5-VL's attention): the
    # first call shows it, and no later call allocates
    x = torch.empty(4, 8, device="meta")
    mem = LiveMemory()
    with mem:
        views = [aten._unsafe_view.default(x, [32]) for _ in range(3)]
    assert mem.current == 0 and mem.memo.hits == 0
    assert all(v.untyped_storage()._cdata == x.untyped_storage()._cdata for v in views)


def _trace(monkeypatch, memo: bool) -> tuple:
    from diffusers import SD3Transformer2DModel

    if not memo:
        monkeypatch.setattr(MetaMemo, "lookup", lambda self, func, args, kwargs: (None, None))
    with torch.device("meta"):
        net = SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=8,
            out_channels=4,
        )
    inputs = {
        "hidden_states": torch.empty(2, 4, 8, 8, device="meta"),
        "encoder_hidden_states": torch.empty(2, 5, 16, device="meta"),
        "pooled_projections": torch.empty(2, 8, device="meta"),
        "timestep": torch.empty(2, device="meta"),
    }
    mem = LiveMemory()
    mem.register([*net.parameters()])
    with mem, GpuAttention(), CudaAutocast(torch.bfloat16):
        with mem.phase("forward"):
            out = net(**inputs).sample
        with mem.phase("backward"):
            out.float().pow(2).mean().backward()
    phases = {name: (p.start, p.peak, p.end) for name, p in mem.phases.items()}
    return mem.peak, mem.current, mem.flops, phases, mem.memo.hits


def test_a_trace_counts_the_same_bytes_and_flops_with_the_memo_as_without(monkeypatch):
    with_memo = _trace(monkeypatch, memo=True)
    assert with_memo[-1] > 100  # three alike blocks: most of their ops remembered
    with pytest.MonkeyPatch.context() as patch:
        without = _trace(patch, memo=False)
    assert without[-1] == 0 and with_memo[:-1] == without[:-1]
