import torch

from flowrl.policies.value import StateValueNet, pooled_text


def test_value_net_shapes_any_latent_size_and_packed_tokens():
    net = StateValueNet(4, 6, hidden=16)
    for shape in [(3, 4, 8, 8), (3, 4, 5, 7)]:
        out = net(torch.randn(*shape), torch.rand(3), torch.randn(3, 6))
        assert out.shape == (3,)
    packed = StateValueNet(64, 6, hidden=16)(torch.randn(2, 256, 64), torch.rand(2), torch.randn(2, 6))
    assert packed.shape == (2,)


def test_value_net_regresses_a_constant_and_depends_on_its_inputs():
    torch.manual_seed(0)
    net = StateValueNet(1, 3, hidden=16)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    x, s, t = torch.randn(32, 1, 8, 8), torch.rand(32), torch.randn(32, 3)
    for _ in range(200):
        loss = (net(x, s, t) - 0.7).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 1e-3
    fresh = StateValueNet(1, 3, hidden=16)
    assert not torch.allclose(fresh(x, s, t), fresh(x, s.flip(0), t))  # the noise level matters


def test_pooled_text():
    cond = {"prompt_embeds": torch.ones(2, 5, 3)}
    assert torch.equal(pooled_text(cond), torch.ones(2, 3))
    cond["pooled"] = torch.zeros(2, 4)
    assert torch.equal(pooled_text(cond), torch.zeros(2, 4))
