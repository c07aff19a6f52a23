"""`no_init_without_data`: a real-size build on `meta` (or fake tensors) skips `torch.nn.init`'s draws; a real tensor
is drawn as before, from the same generator stream."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flowrl.models.meta_init import no_init_without_data


def test_meta_and_fake_tensors_skip_the_draws_and_real_ones_draw_as_before(monkeypatch):
    calls = []
    original = torch.nn.init.normal_

    def recorded(tensor, *args, **kwargs):
        calls.append(tensor.device.type)
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "normal_", recorded)
    with no_init_without_data():
        torch.nn.init.normal_(torch.empty(3, device="meta"))
        with FakeTensorMode():
            torch.nn.init.normal_(torch.empty(3))
        torch.manual_seed(0)
        drawn = torch.nn.init.normal_(torch.empty(3))
        torch.manual_seed(1)
        inside = torch.nn.Linear(4, 4)
    assert calls == ["cpu"]  # the real tensor's draw only
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.randn(3))
    torch.manual_seed(1)
    assert torch.equal(inside.weight, torch.nn.Linear(4, 4).weight)  # kaiming_uniform_ as without the context
    assert torch.nn.init.normal_ is recorded  # restored on exit
