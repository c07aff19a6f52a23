"""What a `DiffusionPolicy` trains and compares against: its trainable parameters, a LoRA adapter in diffusers'
format, and the reference policy (a frozen copy, or the network with its adapter disabled)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from flowrl.models.meta_init import no_init_without_data


class PolicyWeights:
    """The weights part of `DiffusionPolicy` (a mixin: it reads the policy's `adapter`, `model`, `device` and keeps
    `reference_model` / `reference_offload`)."""

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def has_lora(self) -> bool:
        return bool(getattr(self.model, "peft_config", None))

    def add_lora(
        self,
        rank: int = 32,
        alpha: float | None = None,
        target_modules: Sequence[str] | None = None,
        dropout: float = 0.0,
        init: str | bool = "gaussian",
        seed: int | None = 0,
    ) -> None:
        """Freeze the network and add a peft LoRA adapter (only its weights train).

        `target_modules` default to the family's (`ModelAdapter.lora_targets`; SD3/Flux: Flow-GRPO's attention
        projections of both streams). `alpha` defaults to `rank` (scale 1; Flow-GRPO uses rank 32, alpha 64);
        `init="gaussian"` keeps the adapter's output zero at first, so the policy starts exactly at the base; the
        random `A` matrices are drawn from `seed` (None: the global generator), not from whatever the process drew
        before, so every process (and a resumed run) starts from the same adapter.
        """
        from peft import LoraConfig

        targets = list(target_modules or self.adapter.lora_targets)
        modules = dict(self.model.named_modules())
        missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in modules)]
        if missing:  # peft would fail deep inside, or (for some targets) silently adapt nothing
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)})
            raise ValueError(
                f"model.lora_targets {missing} match no module of the {type(self.model).__name__}; "
                f"its linear layers are named {', '.join(leaves[:20])}"
            )
        config = LoraConfig(
            r=rank, lora_alpha=alpha or rank, lora_dropout=dropout, init_lora_weights=init, target_modules=targets
        )
        self.model.requires_grad_(False)
        # a network on `meta` (a plan's real-size build) gets its adapter there directly: peft builds each layer's
        # A and B on the CPU, draws them, then moves them to the base layer's device (a 20B network's: seconds)
        on_meta = all(p.device.type == "meta" for p in self.model.parameters())
        with torch.device("meta") if on_meta else contextlib.nullcontext(), no_init_without_data():
            if seed is None:
                self.model.add_adapter(config)
                return
            with torch.random.fork_rng(devices=[]):  # the global generator is left as it was
                torch.manual_seed(seed)
                self.model.add_adapter(config)

    def _pipeline_class(self):
        if self.adapter.pipeline is None:
            raise ValueError("saving LoRA in the diffusers format needs a pipeline-based policy")
        return type(self.adapter.pipeline)

    def _lora_parts(self) -> list[tuple[str, torch.nn.Module]]:
        """`(subfolder, network)` of each network with its own LoRA file: the model itself, or the parts a model
        made of several networks names (Wan 2.2 with both experts training: `experts()`)."""
        parts = getattr(self.model, "experts", None)
        return parts() if callable(parts) else [("", self.model)]

    def save_lora(self, directory: str | Path) -> Path:
        """Write the adapter as `pytorch_lora_weights.safetensors`, loadable by `pipe.load_lora_weights(dir)` (a model
        of several networks: one file per network, the others in the subfolders it names)."""
        if not self.has_lora:
            raise ValueError("this policy has no LoRA adapter to save (call add_lora first)")
        written = [self._save_lora_of(module, Path(directory) / sub) for sub, module in self._lora_parts()]
        return written[0]

    def _save_lora_of(self, module: torch.nn.Module, directory: Path) -> Path:
        from peft.utils import get_peft_model_state_dict

        state = get_peft_model_state_dict(module)
        metadata = module.peft_config["default"].to_dict()
        metadata["target_modules"] = sorted(metadata["target_modules"])
        key = self.adapter.lora_prefix
        pipeline_class = self._pipeline_class()
        if getattr(self.adapter, "lora_loader", None) is not None:  # no LoRA loader mixin (HunyuanVideo 1.5): the
            from diffusers.loaders.lora_base import LoraBaseMixin  # mixins' file, for `<component>.load_lora_adapter`

            LoraBaseMixin._save_lora_weights(str(directory), {key: state}, {key: metadata})
            return directory / "pytorch_lora_weights.safetensors"
        pipeline_class.save_lora_weights(
            str(directory), **{f"{key}_lora_layers": state, f"{key}_lora_adapter_metadata": metadata}
        )
        return directory / "pytorch_lora_weights.safetensors"

    def load_lora(self, directory: str | Path) -> None:
        """Load an adapter saved by `save_lora` (or any diffusers-format LoRA for this family) and train it."""
        parts = [(Path(directory) / sub, module) for sub, module in self._lora_parts()]
        for path, _ in parts:
            if not (path / "pytorch_lora_weights.safetensors").is_file():
                raise FileNotFoundError(f"no pytorch_lora_weights.safetensors in {path}")
        if self.has_lora:
            self.model.delete_adapters("default")
        self.model.requires_grad_(False)
        prefix = self.adapter.lora_prefix
        for path, module in parts:
            module.load_lora_adapter(
                str(path), weight_name="pytorch_lora_weights.safetensors", prefix=prefix, adapter_name="default"
            )
        for name, param in self.model.named_parameters():
            if "lora_" in name:
                param.requires_grad_(True)

    def freeze_reference(self, offload: bool = False) -> None:
        """Keep a frozen copy of the current network as the KL reference (for full fine-tuning); `offload` keeps it
        in CPU memory between its passes (`reference` brings it to the device for each)."""
        self.reference_model = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.reference_offload = offload
        if offload:
            self.reference_model.to("cpu")

    @torch.no_grad()
    def reset_reference(self) -> None:
        """Copy the trained parameters into the frozen reference copy (GARDO's periodic reference reset); the
        frozen parameters of both are the base model's already. Needs `freeze_reference()` first."""
        if self.reference_model is None:
            raise ValueError("reset_reference needs a reference copy of its own: call freeze_reference() first")
        reference = dict(self.reference_model.named_parameters())
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                reference[name].copy_(param.detach())

    @contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """Run the reference policy inside the block: the frozen copy, or the network with LoRA disabled."""
        if self.reference_model is not None:
            offload = self.reference_offload
            if offload:
                self.reference_model.to(self.device)
            try:
                yield self.reference_model
            finally:
                if offload:
                    self.reference_model.to("cpu")
        elif self.has_lora:
            self.model.disable_adapters()
            try:
                yield self.model
            finally:
                self.model.enable_adapters()
        else:
            raise ValueError("no reference policy: add a LoRA adapter or call freeze_reference() first")
