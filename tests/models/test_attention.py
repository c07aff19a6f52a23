"""`model.attention_backend` (flowrl/models/attention.py): `auto` leaves the CPU untouched, orders its candidates as
docs/models.md's table says, self-tests each one for real, and falls back one printed line at a time."""

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from flowrl.models import ModelConfig, attention
from flowrl.models.attention import (
    AUTO,
    MASK_LAYOUTS,
    Kernels,
    attention_shapes,
    backend_in_use,
    candidates,
    choose_attention,
    configure_attention,
    self_test,
)
from flowrl.models.families import MODEL_FAMILIES
from flowrl.policies import DiffusionPolicy
from flowrl.policies.build import load_policy


ALL = Kernels(flash_attn=True, flash_attn_3=True, xformers=True)
H100, A100, RTX_4090, T4 = (9, 0), (8, 0), (8, 9), (7, 5)
MASKS = {
    f: MODEL_FAMILIES.get(f).attention_mask for f in MODEL_FAMILIES.names() if MODEL_FAMILIES.get(f).attention_mask
}
"""Each masked family's layout, as its adapter declares it (checked below on their tiny networks)."""


@pytest.fixture(autouse=True)
def _process_wide_switches_restored(monkeypatch):
    """`set_attention_backend` also sets diffusers' process-wide active backend, and `auto` on CUDA PyTorch's cuDNN
    SDPA switch: both put back after each test."""
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", _AttentionBackendRegistry._active_backend)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(cudnn)


def _processor_backends(network) -> set:
    return {
        m.processor._attention_backend
        for m in network.modules()
        if hasattr(m, "processor") and m.processor and hasattr(m.processor, "_attention_backend")
    }


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_auto_on_the_cpu_is_bit_identical_to_diffusers_default(family):
    assert ModelConfig().attention_backend == AUTO
    rollouts = {}
    for setting in (None, AUTO):
        config = ModelConfig(name=f"tiny:{family}@4", options={"max_sequence_length": 16}, attention_backend=setting)
        policy = load_policy(config, forward_batch_size=2)
        assert backend_in_use(policy.model) == "native" and _processor_backends(policy.model) <= {None}
        rollouts[setting] = policy.rollout(
            ["a cat", "a dog"],
            num_steps=3,
            guidance_scale=2.0,
            noise_level=0.8,
            height=64,
            width=64,
            generator=torch.Generator().manual_seed(0),
        )
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the CUDA switch is left alone off CUDA
    for field in ("latents", "log_probs", "images"):
        assert torch.equal(getattr(rollouts[None], field), getattr(rollouts[AUTO], field)), field


def _docs_table():
    """docs/models.md's `auto` table: each column's families, each row's compute capabilities and cells' backends."""
    lines = [line.strip() for line in (Path(__file__).resolve().parents[2] / "docs" / "models.md").open()]
    starts = [i for i, line in enumerate(lines) if line.startswith("| GPU (compute capability)")]
    assert len(starts) == 1, "docs/models.md has no table of `model.attention_backend: auto`"
    table = []
    for line in lines[starts[0] :]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split("|")])
    header, rows = table[0], table[2:]
    columns = [re.findall(r"`([^`]+)`", cell) for cell in header[1:]]
    parsed = []
    for row in rows:
        capabilities = [tuple(int(x) for x in c.split(".")) for c in re.findall(r"(\d+\.\d+)", row[0])]
        parsed.append((capabilities or [None], [re.findall(r"`([^`]+)`", cell) for cell in row[1:]]))
    return columns, parsed


def _not_dispatched() -> set[str]:
    """The docs table's families whose attention calls PyTorch's SDPA itself (checked below on their tiny
    networks)."""
    lines = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text().splitlines()
    header = next(line for line in lines if line.strip().startswith("| GPU (compute capability)"))
    cell = next(cell for cell in header.split("|") if cell.strip().startswith("not dispatched:"))
    return set(re.findall(r"`([^`]+)`", cell))


NOT_DISPATCHED = _not_dispatched()


def test_every_family_declares_a_known_mask_layout():
    assert set(MASKS.values()) == set(MASK_LAYOUTS)  # every layout is some family's
    assert {"qwen_image", "z_image", "hunyuan_video", "qwen_image_21"} <= set(MASKS) and "flux" not in MASKS
    assert {"sd3", "unet"} <= NOT_DISPATCHED and "flux" not in NOT_DISPATCHED


def test_the_candidates_are_the_docs_table():
    columns, rows = _docs_table()
    named = [family for column in columns for family in column]
    assert sorted(named) == sorted(MODEL_FAMILIES.names()), "every family in exactly one column of the docs table"
    seen = set()
    for capabilities, cells in rows:
        for capability in capabilities:
            seen.add(capability)
            for families, cell in zip(columns, cells):
                for family in families:
                    got = candidates(capability, ALL, mask=MASKS.get(family), dispatched=family not in NOT_DISPATCHED)
                    assert got == cell, (capability, family)
    assert {H100, A100, RTX_4090, T4, None} <= seen


def test_the_candidates_for_given_gpus_and_packages():
    flux, qwen, z_image = {"mask": None}, {"mask": MASKS["qwen_image"]}, {"mask": MASKS["z_image"]}
    assert candidates(H100, ALL, **flux) == [
        "_flash_varlen_3",
        "flash",
        "_native_flash",
        "_native_efficient",
        "xformers",
        "native",
    ]
    assert candidates(H100, Kernels(), **flux) == ["_native_flash", "_native_efficient", "native"]
    assert candidates(A100, ALL, **flux) == ["flash", "_native_flash", "_native_efficient", "xformers", "native"]
    assert candidates(RTX_4090, Kernels(xformers=True), **flux) == [
        "_native_flash",
        "_native_efficient",
        "xformers",
        "native",
    ]
    assert candidates(A100, ALL, **flux, dtype=torch.float32) == ["_native_efficient", "xformers", "native"]
    assert candidates(T4, ALL, **flux) == ["_native_efficient", "xformers", "native"]
    assert candidates(H100, ALL, **z_image) == ["_flash_varlen_3", "flash_varlen", "_native_efficient", "native"]
    assert candidates(RTX_4090, Kernels(flash_attn=True), **z_image) == ["flash_varlen", "_native_efficient", "native"]
    assert candidates(H100, ALL, **qwen) == candidates(RTX_4090, ALL, **qwen) == ["_native_efficient", "native"]
    assert candidates(H100, ALL, dispatched=False) == ["native"]
    for mask in (None, *MASKS.values()):
        assert candidates(None, ALL, mask=mask) == []  # no CUDA: diffusers' default, untouched
        for capability in (H100, A100, RTX_4090, T4):
            names = candidates(capability, ALL, mask=mask)
            assert names[-1] == "native" and "_native_cudnn" not in names and "_flash_3" not in names
            assert {n for n in names if n in ("flash", "_native_flash", "xformers")} <= (set() if mask else set(names))


def test_the_self_test_runs_for_real_at_a_real_head_size():
    self_test("native", heads=24, head_dim=128, dtype=torch.bfloat16, device="cpu")  # FLUX.1's 24 heads of 128
    for mask in sorted(set(MASKS.values())):
        self_test("native", heads=2, head_dim=128, dtype=torch.float32, device="cpu", mask=mask)
    state = torch.random.get_rng_state()
    self_test("_native_math", heads=2, head_dim=64, dtype=torch.float16, device="cpu", mask="gaps")
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's random stream is not touched


def _wrapped(monkeypatch, backend: str, change):
    """Replace diffusers' `backend` by itself with its keyword arguments passed through `change` first."""
    name = AttentionBackendName(backend)
    original = _AttentionBackendRegistry._backends[name]
    monkeypatch.setitem(_AttentionBackendRegistry._backends, name, lambda **kwargs: original(**change(kwargs)))


def test_the_self_test_catches_a_mishandled_mask_and_a_non_finite_output(monkeypatch):
    def first_keys(kwargs):  # what diffusers' varlen backends do: a row's `valid` first keys, wherever the padding is
        mask = kwargs["attn_mask"]
        if mask is not None:
            keys = mask.expand(mask.shape[0], 1, mask.shape[-2], mask.shape[-1]).any(dim=(1, 2))
            kwargs["attn_mask"] = (torch.arange(keys.shape[-1]) < keys.sum(-1, keepdim=True))[:, None, None, :]
        return kwargs

    _wrapped(monkeypatch, "_native_math", first_keys)
    self_test("_native_math", heads=2, head_dim=32, dtype=torch.bfloat16, device="cpu", mask="padded")  # right here
    with pytest.raises(ArithmeticError, match=r"output off the fp64 reference by (0\.[2-9]|[1-9])"):
        self_test("_native_math", heads=2, head_dim=32, dtype=torch.bfloat16, device="cpu", mask="gaps")
    _wrapped(monkeypatch, "native", lambda kwargs: {**kwargs, "query": kwargs["query"] * float("nan")})
    with pytest.raises(FloatingPointError, match="non-finite output"):
        self_test("native", heads=2, head_dim=32, dtype=torch.float32, device="cpu")


def _tiny_network(family="flux", dtype=torch.bfloat16):
    return MODEL_FAMILIES.get(family).tiny(seed=0).transformer.to(dtype)


def test_failing_candidates_fall_back_one_printed_line_each(monkeypatch, capsys):
    network = _tiny_network()
    tried = []

    def fake(name, **kwargs):
        tried.append((name, kwargs["heads"], kwargs["head_dim"], kwargs["dtype"], kwargs["mask"]))
        if name in ("_flash_varlen_3", "flash"):
            raise ImportError(f"no {name} here\nsecond line")

    monkeypatch.setattr(attention, "self_test", fake)
    capsys.readouterr()
    assert choose_attention(network, "flux", capability=H100, kernels=ALL) == "_native_flash"
    assert capsys.readouterr().out.splitlines() == [
        "attention: _flash_varlen_3 failed its self-test (ImportError: no _flash_varlen_3 here); using flash",
        "attention: flash failed its self-test (ImportError: no flash here); using _native_flash",
    ]
    assert tried == [(name, 4, 16, torch.bfloat16, None) for name in ("_flash_varlen_3", "flash", "_native_flash")]
    assert _processor_backends(network) == {AttentionBackendName._NATIVE_FLASH}
    assert backend_in_use(network) == "_native_flash"


def test_every_candidate_failing_ends_on_native_untested(monkeypatch):
    network = _tiny_network("qwen_image")
    tried, lines = [], []

    def fake(name, **kwargs):
        tried.append((name, kwargs["mask"]))
        raise RuntimeError("kernel fault")

    monkeypatch.setattr(attention, "self_test", fake)
    chosen = choose_attention(network, "qwen_image", capability=H100, kernels=ALL, log=lines.append)
    assert chosen == "native" and tried == [("_native_efficient", "gaps")]
    assert lines == ["attention: _native_efficient failed its self-test (RuntimeError: kernel fault); using native"]
    assert _processor_backends(network) == {AttentionBackendName.NATIVE}


def test_the_real_self_tests_on_the_cpu_choose_pytorch_s_flash_kernel_for_a_simulated_h100():
    """The packages claimed here are missing: their backends fail diffusers' own check inside the self-test."""
    network, lines = _tiny_network(), []
    assert choose_attention(network, "flux", capability=H100, kernels=ALL, log=lines.append) == "_native_flash"
    assert [line.split(" failed")[0] for line in lines] == ["attention: _flash_varlen_3", "attention: flash"]
    assert all("is not usable because of missing package" in line for line in lines)


def test_explicit_names_none_and_unknown_names():
    network = _tiny_network(dtype=torch.float32)
    assert configure_attention(network, None, family="flux") == "native" and _processor_backends(network) == {None}
    assert configure_attention(network, AUTO, family="flux") == "native" and _processor_backends(network) == {None}
    assert configure_attention(network, "_native_math", family="flux") == "_native_math"
    assert _processor_backends(network) == {AttentionBackendName._NATIVE_MATH}
    with pytest.raises(
        ValueError, match=r"'flash_attn9' is not one of diffusers' backends or auto: auto, .*_native_flash"
    ):
        ModelConfig(attention_backend="flash_attn9")


def _spied_rollout(family, monkeypatch) -> tuple[set, list]:
    """The mask layouts the tiny family's network hands to diffusers' dispatch in a 1-step rollout (None: no mask),
    and its dispatched attention shapes. Only the network's calls count (LTX-2's text connectors dispatch too, on
    the default backend: `configure_attention` sets the network's). Qwen-Image-Edit's sources at toy sizes: the
    caller takes tests/conftest.py's `small_edit_sources`."""
    seen, inside = set(), [False]

    def record(kwargs):
        mask = kwargs["attn_mask"]
        if not inside[0]:
            return kwargs
        if mask is None:
            seen.add(None)
            return kwargs
        keys = mask.expand(mask.shape[0], 1, mask.shape[-2], mask.shape[-1]).any(dim=(1, 2))
        prefix = bool((keys == (torch.arange(keys.shape[-1]) < keys.sum(-1, keepdim=True))).all())
        square = mask.shape[-2] > 1
        lower = torch.ones(mask.shape[-2:], dtype=torch.bool).tril(mask.shape[-1] - mask.shape[-2])
        causal = square and bool((mask == lower).all())  # Qwen-Image 2.1's text: each query its own and earlier keys
        layout = {(True, False): "padded", (True, True): "padded_square"}.get((prefix, square), "gaps")
        seen.add("causal" if causal else layout)
        assert mask.dtype == torch.bool and mask.ndim == 4 and (prefix or not square)
        return kwargs

    _wrapped(monkeypatch, "native", record)
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", AttentionBackendName.NATIVE)
    cls = MODEL_FAMILIES.get(family)
    fields = {f.name for f in dataclasses.fields(cls.Options)}
    wanted = {
        "max_sequence_length": 64 if family == "z_image" else 32 if cls.pipeline_needs_sources else 16,
        "num_frames": 5,
        "text_tokens": 24,
        "glyph_tokens": 8,
    }
    policy = DiffusionPolicy.from_pipeline(cls.tiny(seed=0), options={k: v for k, v in wanted.items() if k in fields})
    policy.model.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    policy.model.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    sources = {}
    if cls.pipeline_needs_sources:
        from flowrl.prompts.edit_shapes import draw

        sources = {"source_images": [draw("square", "blue", (10, 12, 40, 42))] * 2}
    prompts = ["a cat", "a red dog on a hill" * (6 if family == "z_image" else 1)]  # Z-Image masks unequal captions
    with torch.no_grad():
        policy.rollout(
            prompts,
            num_steps=1,
            guidance_scale=1.0,
            height=64,
            width=64,
            generator=torch.Generator().manual_seed(0),
            **sources,
        )
    return seen, attention_shapes(policy.model)


LAYOUTS_COVERED = ("flux", "qwen_image", "z_image", "hunyuan_video")
"""One family per mask layout (none, `gaps`, `padded`, `padded_square`) in the default tier; the rest in `models`."""


@pytest.mark.parametrize(
    "family",
    [f if f in LAYOUTS_COVERED else pytest.param(f, marks=pytest.mark.models) for f in MODEL_FAMILIES.names()],
)
def test_masks_table_is_what_each_family_hands_to_diffusers(family, monkeypatch, small_edit_sources):
    seen, shapes = _spied_rollout(family, monkeypatch)
    if family in NOT_DISPATCHED:
        assert seen == set() and shapes == []
    else:
        assert shapes and seen - {None} == ({MASKS[family]} if family in MASKS else set())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["flux", "qwen_image", "z_image", "sd3"])
def test_auto_on_cuda_chooses_self_tested_and_rescores_exactly(family):
    cls = MODEL_FAMILIES.get(family)
    options = {"max_sequence_length": 64} if "max_sequence_length" in cls.Options.__dataclass_fields__ else {}
    policy = DiffusionPolicy.from_pipeline(cls.tiny(seed=2).to("cuda", torch.bfloat16), options=options)
    chosen = configure_attention(policy.model, AUTO, family=family)
    print(f"{family}: {chosen} on {torch.cuda.get_device_name()}", file=sys.stderr)
    assert not torch.backends.cuda.cudnn_sdp_enabled() and backend_in_use(policy.model) == chosen
    names = candidates(
        torch.cuda.get_device_capability(),
        attention.installed_kernels(),
        mask=MASKS.get(family),
        dispatched=family not in NOT_DISPATCHED,
    )
    assert chosen in names
    g = torch.Generator("cuda").manual_seed(0)
    rollout = policy.rollout(
        ["a cat", "a red dog on a hill" * 6],  # Z-Image: captions of unequal lengths, so its mask is on
        num_steps=3,
        guidance_scale=3.5,
        generator=g,
        height=64,
        width=64,
        sampler=cls.default_sampler,
        noise_level=0.8,
    )
    steps = rollout.sde_steps.expand(2, -1)
    assert torch.equal(policy.log_prob(rollout, steps).detach(), rollout.log_probs[:, rollout.sde_steps])
    policy.model.requires_grad_(True)
    policy.log_prob(rollout, steps).sum().backward()
    grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
