"""DeepSpeed ZeRO under flowrl's update (`flowrl.run.sharding`): what the trainers rely on, proven on a gloo
group of two CPU processes against plain torch on one. The trainers' 2-process runs are in test_distributed.py."""

import os
import textwrap

import pytest

from .. import launch


pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

WORKER = textwrap.dedent(
    """
    import math, sys
    import torch, torch.distributed as dist
    from flowrl.run import sharding

    stage = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def net():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
        m[0].weight.requires_grad_(False)  # a frozen weight (LoRA's base) rides along, sharded under ZeRO-3
        return m

    ref = net()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    model = net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    engine = sharding.zero_engine(model, opt, stage, max_grad_norm=0.5)
    backward = sharding.ZeroBackward(engine, world)
    from deepspeed.comm import comm
    assert comm.cdb.shm_comm_op is None  # no shared-memory all-reduce compiled on a CPU (ZeRO never calls it)

    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        # one process: two minibatches of 4, each loss its share of the window's sum (flowrl's scales)
        for rows in (slice(0, 4), slice(4, 8)):
            ((ref(x[rows]) - y[rows]) ** 2).sum().div(8).backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        # two processes: each trains its 4 rows as two minibatches of 2, three backwards (one per minibatch and
        # one of zero weight, as a per-step backward or a padded row makes), then one step
        mine = slice(4 * rank, 4 * rank + 4)
        for rows in (slice(0, 2), slice(2, 4)):
            backward(((engine(x[mine][rows]) - y[mine][rows]) ** 2).sum().div(8))
        backward(engine(x[mine][:1]).sum() * 0.0)
        got = backward.step()
        assert abs(got - float(norm)) < 1e-5, (step, got, float(norm))

    # what the asynchronous mode publishes to its rollout workers, on every process (a collective: ZeRO-3's
    # partitions gathered one parameter at a time): the trained parameters in full, the frozen one left out
    published = sharding.full_parameters(engine.module)
    trained = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    assert published.keys() == trained.keys(), sorted(published)
    for name, p in trained.items():
        torch.testing.assert_close(published[name], p, rtol=1e-5, atol=1e-6)

    model_state, optim_state, metadata = sharding.zero_full_state(engine)
    if rank == 0:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(model_state[name], p.detach(), rtol=1e-5, atol=1e-6)
            if p.requires_grad:
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(optim_state[f"state/{name}/{key}"], ref_opt.state[p][key],
                                               rtol=1e-5, atol=1e-8)
                assert float(optim_state[f"state/{name}/step"]) == 3
        assert model_state.keys() == ref.state_dict().keys()

    # a NaN gradient: DeepSpeed skips the step (the weights stay) and reports a non-finite norm
    before = {k: v.clone() for k, v in sharding.zero_full_state(engine)[0].items()}
    backward(engine(x[mine]).sum() * float("nan"))
    assert not math.isfinite(backward.step())
    after = sharding.zero_full_state(engine)[0]
    if rank == 0:
        assert all(torch.equal(before[k], after[k]) for k in before)

    # full states load into a fresh engine's partitions: the weights, the moments and the step count, so the next
    # step is the one the first engine takes
    fresh_model = net()
    fresh_opt = torch.optim.AdamW([p for p in fresh_model.parameters() if p.requires_grad], lr=0.05)
    fresh = sharding.zero_engine(fresh_model, fresh_opt, stage, max_grad_norm=0.5)
    payload = [model_state, optim_state, metadata] if rank == 0 else [None, None, None]
    dist.broadcast_object_list(payload)  # the test's shortcut for every process reading the files
    sharding.zero_load_full_state(fresh, *payload)
    fresh_backward = sharding.ZeroBackward(fresh, world)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
    for eng, bwd in ((engine, backward), (fresh, fresh_backward)):
        bwd(((eng(x[mine]) - y[mine]) ** 2).sum().div(8))
        bwd.step()
    a, b = sharding.zero_full_state(engine), sharding.zero_full_state(fresh)
    if rank == 0:
        for k in a[0]:
            torch.testing.assert_close(b[0][k], a[0][k], rtol=0, atol=1e-7)
        for k in a[1]:
            torch.testing.assert_close(b[1][k], a[1][k], rtol=0, atol=1e-9)
        print("ok", flush=True)
    # close the gloo group before the interpreter tears down (a CI run once aborted at exit with "terminate called
    # without an active exception" after the checks had passed)
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_matches_one_process(tmp_path, stage):
    # accumulation over several backwards per step (the boundary marked late), the sum's scale, DeepSpeed's clip
    # and gradient norm, the full parameters the asynchronous mode publishes, skipped non-finite steps, and
    # full-state checkpoints that resume the next step exactly
    # forked from the session's forkserver as a group of two, with torchrun's variables (tests/launch.py)
    extensions = tmp_path / "torch_extensions"  # where a JIT-compiled DeepSpeed op would be built
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(extensions)}
    launched = launch.start_code(WORKER, env, tmp_path / "zero.log", processes=2, argv=["-c", str(stage)])
    exit_code, output = launched.wait(timeout=300), launched.log.read_text()
    assert exit_code == 0, output[-4000:]
    assert "ok" in output.splitlines(), output[-4000:]
    assert not extensions.exists(), list(extensions.rglob("*"))
