"""The trained network's attention kernel: `model.attention_backend: auto` picks diffusers' attention backend per
family and GPU and self-tests it at start-up (docs/models.md, "Memory, precision and speed").

Why not PyTorch's default: on an H100/H200 with torch 2.11, SDPA's cuDNN kernel crashed FLUX.1's LoRA backward
(`mha_graph.execute(...).is_good()`, then a CUDA illegal memory access); the same assertion is reported in
pytorch/pytorch#134001 and #190321, whose known mitigation is `torch.backends.cuda.enable_cudnn_sdp(False)`
(PyTorch already moved cuDNN back once for such faults: pytorch/pytorch#128539, #141133). So `auto` never tries cuDNN:
on CUDA it turns PyTorch's cuDNN SDPA kernel off (`native` then means flash, memory-efficient or math SDPA) and walks
an ordered list of diffusers backends, each checked by one tiny forward and backward against an fp64 reference.

What diffusers 0.42.1 (`diffusers/models/attention_dispatch.py`) can and cannot train, read from its source:
- `_flash_3` wraps FA3 in a `torch.library.custom_op` with no autograd formula: its backward raises. FA3's varlen
  form (`_flash_varlen_3`) calls FA3's autograd function, so it is the FA3 candidate (masked or not).
- `flash`, `_flash_3`, `_native_flash` and `sage` refuse an attention mask; the varlen forms pack each row's keys as
  `key[b, :valid]`, right only when the padding is at the end; `xformers` turns a 4-D boolean mask into a 0/1
  *additive* bias (wrong, silently), and every masked family passes a 4-D boolean mask.
- `sage` has no backward (SageAttention is inference-only: thu-ml/SageAttention#60); the `*_hub` backends download
  kernels from the Hub at run time; `flex` is slow uncompiled. None of these is a candidate.
"""

from __future__ import annotations

import dataclasses
import math

import torch


AUTO = "auto"

MASK_LAYOUTS = ("gaps", "padded", "padded_square", "causal")
"""The attention masks a family's network may hand to diffusers' dispatch (its adapter's `attention_mask`; the rest
pass none), checked against every family's tiny network in tests/models/test_attention.py. `gaps`: `[B, 1, 1, S]`
boolean, padding inside the sequence (Qwen-Image: `[text + its padding | image]`); `padded`: `[B, 1, 1, S]`, valid
tokens first (Z-Image, when its captions differ in length); `padded_square`: `[B, 1, S, S]`, valid tokens first and
padded queries masked too (HunyuanVideo 1.5, text- and image-to-video); `causal`: `[1, 1, S, S]`, lower-triangular
(Qwen-Image 2.1's text, whose image tokens then attend unmasked; its whole-sequence calls run on diffusers' active
backend, the layers' setting reaching only the cached decode flowrl does not use). SANA masks its text too, but its
attention calls PyTorch's SDPA directly (not dispatched)."""


def family_mask(family: str) -> str | None:
    """The mask layout (`MASK_LAYOUTS`) the family's network hands to diffusers' dispatch; None for none."""
    from flowrl.models.families import MODEL_FAMILIES

    return MODEL_FAMILIES.get(family).attention_mask


VARLEN_SAFE = ("padded", "padded_square")
"""Layouts diffusers' varlen backends pack correctly (valid keys first)."""


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The attention packages diffusers could import here (its own import and version checks)."""

    flash_attn: bool = False
    """flash-attn 2 (`flash_attn` >= 2.6.3): `flash`, `flash_varlen`."""
    flash_attn_3: bool = False
    """FlashAttention-3 (`flash_attn_interface`, Hopper): `_flash_varlen_3`."""
    xformers: bool = False
    """xformers >= 0.0.29: `xformers`."""


def installed_kernels() -> Kernels:
    """What diffusers found importable at its import (nothing is installed or downloaded)."""
    from diffusers.models import attention_dispatch as dispatch

    return Kernels(
        flash_attn=bool(getattr(dispatch, "_CAN_USE_FLASH_ATTN", False)),
        flash_attn_3=bool(getattr(dispatch, "_CAN_USE_FLASH_ATTN_3", False)),
        xformers=bool(getattr(dispatch, "_CAN_USE_XFORMERS_ATTN", False)),
    )


def candidates(
    capability: tuple[int, int] | None,
    kernels: Kernels,
    *,
    mask: str | None = None,
    dispatched: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> list[str]:
    """diffusers backends to try, best first, for a GPU of compute `capability` (None: no CUDA, `[]`: leave
    diffusers' default), the installed `kernels`, the family's mask layout (`MASK_LAYOUTS`) and weights `dtype`;
    always ends on `native`. A network whose attention does not go through diffusers' dispatch (`dispatched=False`:
    SD3, SANA, the UNets) calls PyTorch's SDPA itself: `["native"]`."""
    if capability is None:
        return []
    if not dispatched:
        return ["native"]
    half = dtype in (torch.float16, torch.bfloat16)  # the flash kernels take fp16/bf16 only
    names = []
    if mask is None:
        names += ["_flash_varlen_3"] if half and kernels.flash_attn_3 and capability[0] == 9 else []
        names += ["flash"] if half and kernels.flash_attn and capability >= (8, 0) else []
        names += ["_native_flash"] if half and capability >= (8, 0) else []
        names += ["_native_efficient"] + (["xformers"] if kernels.xformers else [])
    else:
        if mask in VARLEN_SAFE:
            names += ["_flash_varlen_3"] if half and kernels.flash_attn_3 and capability[0] == 9 else []
            names += ["flash_varlen"] if half and kernels.flash_attn and capability >= (8, 0) else []
        names += ["_native_efficient"]
    return names + ["native"]


def attention_shapes(network: torch.nn.Module) -> list[tuple[int, int]]:
    """The distinct `(heads, head_dim)` of the network's attention layers that go through diffusers' dispatch (a
    processor with an `_attention_backend`), read from the layers themselves (the model config's
    `num_attention_heads` / `attention_head_dim`, or a family's own names, as built)."""
    shapes = []
    for module in network.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            if hasattr(module, "heads"):
                shape = (int(module.heads), int(module.inner_dim) // int(module.heads))
            else:  # Kandinsky 5's attention: num_heads, to_query
                shape = (int(module.num_heads), module.to_query.out_features // int(module.num_heads))
            shapes += [shape] if shape not in shapes else []
    return shapes


def _test_inputs(heads: int, head_dim: int, mask: str | None):
    """Seeded fp64 `q, k, v, probe [2, S, heads, head_dim]`, the boolean mask shaped as the family passes it, and the
    valid query rows `[2, S]`: 13 text tokens (9 and 4 valid) and 30 image tokens, S = 43 (not a multiple of 8)."""
    generator = torch.Generator().manual_seed(0)  # the global RNG stays untouched
    text, image, valid = 13, 30, torch.tensor([9, 4])
    tokens = text + image
    q, k, v, probe = (
        torch.randn(2, tokens, heads, head_dim, generator=generator, dtype=torch.float64) for _ in "qkvp"
    )
    rows = torch.ones(2, tokens, dtype=torch.bool)
    if mask is None:
        return q, k, v, probe, None, rows
    position = torch.arange(tokens)
    if mask == "gaps":
        keys = (position >= text) | (position < valid[:, None])  # [text + padding | image]
    elif mask in VARLEN_SAFE:
        keys = position < (image + valid)[:, None]  # [image | text | padding]
    elif mask == "causal":
        return q, k, v, probe, (position[None, :] <= position[:, None]).expand(2, 1, tokens, tokens), rows
    else:
        raise ValueError(f"unknown attention mask layout {mask!r}; valid: gaps, causal, {', '.join(VARLEN_SAFE)}")
    if mask == "padded_square":
        rows = keys
        return q, k, v, probe * rows[..., None, None], (keys[:, None, None, :] & keys[:, None, :, None]), rows
    return q, k, v, probe, keys[:, None, None, :], rows


def _reference(q, k, v, attn_mask):
    """Softmax attention in fp64, by its formula (masked scores pushed to -1e30)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -1e30)
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""Largest error (relative to max(1, the reference's largest value)) of a backend's output and gradients against the
fp64 reference: bf16 rounding is a few 1e-3 here, a mishandled mask 0.2 or more (tests/models/test_attention.py)."""


def self_test(backend: str, *, heads: int, head_dim: int, dtype: torch.dtype, device, mask: str | None = None):
    """One forward and backward of `backend` through diffusers' dispatch, as a network's attention calls it, at
    `heads` x `head_dim` in `dtype` on `device` with the family's `mask` layout; raises if the backend fails, returns
    non-finite values, no gradient, or values off the fp64 reference (a mask it mishandles)."""
    from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn

    q, k, v, probe, attn_mask, rows = _test_inputs(heads, head_dim, mask)
    exact = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = _reference(*exact, attn_mask)
    (expected * probe).sum().backward()
    inputs = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
    with attention_backend(backend):
        out = dispatch_attention_fn(*inputs, attn_mask=None if attn_mask is None else attn_mask.to(device))
    (out.float() * probe.to(device, torch.float32)).sum().backward()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)  # a kernel's asynchronous fault surfaces here, inside the test
    tolerance = TOLERANCE.get(dtype, 1e-2)
    checks = [("output", out, expected, rows)]  # finite everywhere, compared where the query is not masked
    checks += [(f"d{name}", x.grad, ref.grad, ...) for name, x, ref in zip("qkv", inputs, exact)]
    for name, got, want, where in checks:
        if got is None:
            raise RuntimeError(f"no gradient reached {name[1:]}")
        got = got.detach().double().cpu()
        if not torch.isfinite(got).all():
            raise FloatingPointError(f"non-finite {name}")
        got, want = got[where], want.detach()[where]
        error = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
        if error > tolerance:
            raise ArithmeticError(f"{name} off the fp64 reference by {error:.3g} (tolerance {tolerance})")


def backend_in_use(network: torch.nn.Module) -> str:
    """The diffusers backend the network's dispatched attention runs (its processors' setting, else diffusers'
    active default); `native` for a network that calls PyTorch's SDPA itself."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    for module in network.modules():
        backend = getattr(getattr(module, "processor", None), "_attention_backend", None)
        if backend is not None:
            return str(getattr(backend, "value", backend))
    return str(_AttentionBackendRegistry._active_backend.value)


def _reason(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def choose_attention(network, family: str, *, capability: tuple[int, int] | None, kernels: Kernels, log=print) -> str:
    """Self-test the `candidates` for `network` (of `family`) in order and set the first that passes on it
    (`native`, last, is set untested); `log` gets one line per fallback. Returns the backend set, or with no CUDA
    (`capability` None) the untouched default."""
    shapes, mask = attention_shapes(network), family_mask(family)
    names = candidates(capability, kernels, mask=mask, dispatched=bool(shapes), dtype=network.dtype)
    if not names:
        return backend_in_use(network)
    chosen = names[-1]
    for name, following in zip(names, names[1:]):
        try:
            for heads, head_dim in shapes:
                self_test(name, heads=heads, head_dim=head_dim, dtype=network.dtype, device=network.device, mask=mask)
        except Exception as error:  # any failure of a kernel is a reason to try the next one
            log(f"attention: {name} failed its self-test ({_reason(error)}); using {following}")
            continue
        chosen = name
        break
    network.set_attention_backend(chosen)
    return chosen


def configure_attention(network, setting: str | None, *, family: str) -> str:
    """Apply `model.attention_backend` to the trained `network`: None leaves diffusers' default, a backend name is set
    as given, `auto` leaves a network off CUDA untouched and on CUDA turns PyTorch's cuDNN SDPA off and sets the
    first of its `candidates` that passes the self-test. Returns the backend the network runs."""
    if setting is None:
        return backend_in_use(network)
    if setting != AUTO:
        network.set_attention_backend(setting)
        return setting
    device = torch.device(network.device)
    if device.type != "cuda":
        return backend_in_use(network)
    torch.backends.cuda.enable_cudnn_sdp(False)  # pytorch/pytorch#134001, #190321: see the module docstring
    capability = torch.cuda.get_device_capability(device)
    return choose_attention(network, family, capability=capability, kernels=installed_kernels())
