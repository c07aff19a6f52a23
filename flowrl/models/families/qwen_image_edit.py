"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (2509, 2511): the Qwen-Image adapter with source images, their options,
a processor that needs no torchvision, and tiny offline pipelines."""

from __future__ import annotations

import dataclasses

import torch

from flowrl.models.families import register_family
from flowrl.models.families.qwen_image import QwenImageAdapter, tiny_qwen_image_tokenizer
from flowrl.models.helpers import flux_forward, guidance_embedding, load_component, processor_without_video
from flowrl.models.tiny import _eval


VISION_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
"""The placeholder of one source image in the prompt template (the processor expands its `<|image_pad|>`)."""


def load_processor(name_or_path: str) -> object:
    """The `processor` component of a Qwen-Image-Edit pipeline folder (or hub id) as a `Qwen2VLProcessor` without
    its video slot (`processor_without_video`): its tokenizer and image processor (transformers' PIL one when
    torchvision is absent, as transformers itself falls back)."""
    return load_component(processor_without_video("Qwen2VLProcessor"), name_or_path, "processor")


@dataclasses.dataclass
class QwenImageEditOptions:
    """Options of the Qwen-Image-Edit families (`model.options`)."""

    max_sequence_length: int = 512
    """Text tokens kept per prompt after the template's 64-token prefix, besides the source images' vision tokens
    (Qwen-Image's option). Every pair's embeddings are zero-padded to its vision tokens plus this length with a
    mask, so a pair's conditioning never depends on its batch (sources of one size give pairs of one length); a
    longer prompt fails naming the length it needs. A source costs about 200 vision tokens at Plus's vision size
    (384^2 pixels) and 1300 at Qwen-Image-Edit's (1024^2)."""
    condition_size: list[int] | None = None
    """`[height, width]` every source image is resized to before the VAE (Flow-Factory's `condition_image_size`),
    floored to a multiple of 32 pixels. None: the pipeline's rule, about 1024^2 pixels at the image's aspect ratio
    (`calculate_dimensions(1024 * 1024, ratio)`)."""
    vision_size: list[int] | None = None
    """`[height, width]` every source image is resized to before the vision-language encoder. None: the pipeline's
    rule (Plus: about 384^2 pixels at the image's aspect ratio; Qwen-Image-Edit: the VAE's image)."""

    def __post_init__(self):
        if not 1 <= self.max_sequence_length <= 1024:
            raise ValueError(f"model.options.max_sequence_length must be in [1, 1024], got {self.max_sequence_length}")
        for name in ("condition_size", "vision_size"):
            size = getattr(self, name)
            if size is not None and (len(size) != 2 or min(size) < 32):
                raise ValueError(f"model.options.{name} must be [height, width] of at least 32 pixels, got {size}")


@register_family
class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit: Qwen-Image whose source images enter twice, as the pipeline does.

    Each source image is (1) VAE-encoded (the latent mode, normalised by the VAE's mean and std), packed 2x2 and
    concatenated after the target tokens, the prediction sliced back to them, with the source's latent grid added to
    `img_shapes` for the rotary positions; and (2) shown to the Qwen2.5-VL text encoder inside the prompt template,
    so the text conditioning depends on the (prompt, source images) pair. Under true CFG the negative prompt is
    encoded with the same source images. Without source images the prompt is encoded by the edit template with no
    image (text-to-image with the edit model, which the pipelines do not offer).
    """

    family = "qwen_image_edit"
    Options = QwenImageEditOptions
    pipeline_class = "QwenImageEditPipeline"
    real_models = ("Qwen/Qwen-Image-Edit: 20B",)
    """The model card's 20B MMDiT (Qwen-Image's transformer, trained for editing)."""
    conditioning = "edit"
    negative_sees_sources = True
    pipeline_needs_sources = True
    multi_source = False
    """Whether a prompt may come with several source images (Plus: "Picture 1: ... Picture 2: ...")."""

    @classmethod
    def pipeline_load_kwargs(cls, name_or_path: str) -> dict:
        """The processor, loaded without the video processor that needs torchvision (`load_processor`)."""
        return {"processor": load_processor(name_or_path)}

    # ----- the pipeline's size rules -----

    def _module(self):
        import importlib

        return importlib.import_module(type(self.pipeline).__module__)

    def _vae_size(self, image) -> tuple[int, int]:
        """`(height, width)` of the VAE's copy of a source image (PIL)."""
        if self.options.condition_size is not None:
            height, width = self.options.condition_size
        else:
            width, height = self._module().calculate_dimensions(1024 * 1024, image.size[0] / image.size[1])[:2]
        return height // 32 * 32, width // 32 * 32

    def _vision_size(self, image, vae_size) -> tuple[int, int]:
        """`(height, width)` of the vision encoder's copy of a source image (Qwen-Image-Edit: the VAE's)."""
        return tuple(self.options.vision_size) if self.options.vision_size is not None else vae_size

    def prepare_sources(self, images):
        """The pipeline's step 3 on one sample's source images (PIL; tensors in [0, 1] are quantised to 8 bits, as
        the processors take them): `(pixels [N, 3, H', W'] in [0, 1] as the VAE sees them, (vision images, VAE
        tensors [1, 3, 1, H', W']))`."""
        if not self.multi_source and len(images) != 1:
            raise ValueError(
                f"{self.family} edits one source image per prompt, got {len(images)} (the Plus "
                "family, qwen_image_edit_plus, takes several)"
            )
        processor = self.pipeline.image_processor
        vision, vae = [], []
        for image in images:
            image = _as_pil(image)
            vae_size = self._vae_size(image)
            height, width = self._vision_size(image, vae_size)
            if self.multi_source:  # Plus: the vision copy and the VAE copy are resized from the source apart
                vision.append(processor.resize(image, height, width))
                vae.append(processor.preprocess(image, *vae_size).unsqueeze(2))
            else:  # Qwen-Image-Edit: one resized copy, the VAE's, also shown to the vision encoder
                resized = processor.resize(image, *vae_size)
                vision.append(resized if (height, width) == vae_size else processor.resize(image, height, width))
                vae.append(processor.preprocess(resized, *vae_size).unsqueeze(2))
        if len({tuple(t.shape) for t in vae}) > 1:
            raise ValueError(
                "the source images of one prompt prepare to different sizes; set model.options.condition_size"
            )
        pixels = (torch.cat([t[:, :, 0] for t in vae]) / 2 + 0.5).clamp(0, 1)
        return pixels, (vision, vae)

    # ----- conditioning -----

    def _template_input(self, prompt: str, images: list) -> tuple[str, object]:
        """The prompt inside the pipeline's template and the images the processor receives with it."""
        template = self.pipeline.prompt_template_encode
        if not images:  # no source: the template without its image slot
            return template.replace(VISION_SLOT, "").format(prompt), None
        return template.format(prompt), images[0]

    def _embed(self, prompt: str, images: list) -> dict[str, torch.Tensor]:
        """`_get_qwen_prompt_embeds` of one prompt with its vision images (alone: nothing depends on a batch), the
        template's prefix dropped, zero-padded to its vision tokens plus `max_sequence_length` with a mask."""
        pipe = self.pipeline
        text, shown = self._template_input(prompt, images)
        inputs = pipe.processor(text=[text], images=shown, padding=True, return_tensors="pt")
        vision = int((inputs["input_ids"] == pipe.processor.image_token_id).sum())  # counted on the host
        inputs = inputs.to(self.device)
        out = pipe.text_encoder(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1][0, pipe.prompt_template_encode_start_idx :]  # [L, D]
        length, limit = hidden.shape[0], vision + self.options.max_sequence_length
        if length > limit:
            raise ValueError(
                f"a prompt needs {length - vision} text tokens, more than model.options."
                f"max_sequence_length={self.options.max_sequence_length}"
            )
        embeds = torch.cat([hidden, hidden.new_zeros(limit - length, hidden.shape[1])])
        mask = torch.cat([torch.ones(length, dtype=torch.long), torch.zeros(limit - length, dtype=torch.long)])
        return {"prompt_embeds": embeds.to(self.dtype), "prompt_embeds_mask": mask.to(self.device)}

    def encode(self, prompts):
        """Each prompt alone through the edit template without an image (its conditioning when no source comes)."""
        rows = [self._embed(p, []) for p in prompts]
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def encode_source_text(self, prompt: str, inputs) -> dict[str, torch.Tensor]:
        """The text conditioning of one (prompt, source images) pair: the prompt shown with the sources' vision
        images (`prompt_embeds [L, D]`, `prompt_embeds_mask [L]`)."""
        return self._embed(prompt, inputs[0])

    def encode_sources(self, prompt, inputs):
        """The conditioning of one (prompt, source images) pair: its text conditioning (`encode_source_text`), the
        sources' packed VAE latents one after another (`image_latents [N L_c, 4C]`) and each source's latent grid
        (`image_shapes [N, 3]`, the pipeline's `img_shapes` entries)."""
        pipe = self.pipeline
        latents, shapes = [], []
        for image in inputs[1]:
            latent = pipe._encode_vae_image(image.to(self.device, self.dtype), generator=None)  # the mode: no noise
            channels, _, height, width = latent.shape[1:]
            latents.append(pipe._pack_latents(latent, 1, channels, height, width)[0])
            shapes.append((1, height // 2, width // 2))
        return {
            **self.encode_source_text(prompt, inputs),
            "image_latents": torch.cat(latents).to(self.dtype),
            "image_shapes": torch.tensor(shapes),
        }

    # ----- the network -----

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        if "image_latents" not in cond:  # no source image
            return super().forward(latents, timesteps, cond, guidance_scale, model=model, static=static)
        n = latents.shape[0]
        sources = [tuple(s) for s in cond["image_shapes"][0].tolist()]  # one size per rollout
        return flux_forward(
            model or self.model,
            latents,
            timesteps,
            guidance_embedding(self.model, guidance_scale, n, latents.device),
            image_latents=cond["image_latents"],
            encoder_hidden_states_mask=cond["prompt_embeds_mask"],
            encoder_hidden_states=cond["prompt_embeds"],
            img_shapes=[[static["img_shape"], *sources]] * n,
        )

    def initial_latents(self, batch_size, height, width, generator):
        return self.pipeline_latents(batch_size, height, width, generator, image=True)

    @classmethod
    def tiny(cls, seed: int = 0, latent_channels: int = 16):
        """The family's pipeline over the tiny Qwen-Image components (`QwenImageAdapter.tiny`: a 2-layer transformer, a
        2-layer Qwen2.5-VL with a 1-block vision tower, a 2-level VAE), with a processor built in code whose image
        processor keeps sources small (at most 64 vision patches)."""
        import diffusers
        from transformers import Qwen2VLImageProcessorPil

        tokenizer = tiny_qwen_image_tokenizer(extra_words=_EDIT_TEMPLATE_WORDS)
        base = QwenImageAdapter.tiny(seed=seed, latent_channels=latent_channels, tokenizer=tokenizer)
        image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
        processor = processor_without_video("Qwen2VLProcessor")(image_processor=image_processor, tokenizer=tokenizer)
        components = {**base.components, "tokenizer": tokenizer, "processor": processor}
        return _eval(getattr(diffusers, cls.pipeline_class)(**components))


@register_family
class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Qwen-Image-Edit-Plus (2509, 2511): Qwen-Image-Edit with one or more source images per prompt.

    As `QwenImageEditPlusPipeline`: each source is resized apart for the vision encoder (about 384^2 pixels) and for
    the VAE (about 1024^2), announced in the prompt as "Picture i: <vision tokens>", and its latents join the
    target's one source after another. The diffusers pipeline takes one prompt per call; flowrl batches as usual.
    """

    family = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    real_models = ("Qwen/Qwen-Image-Edit-2509: 20B", "Qwen/Qwen-Image-Edit-2511: 20B")
    multi_source = True

    def _vision_size(self, image, vae_size):
        if self.options.vision_size is not None:
            return tuple(self.options.vision_size)
        module = self._module()
        width, height = module.calculate_dimensions(module.CONDITION_IMAGE_SIZE, image.size[0] / image.size[1])
        return height, width

    def _vae_size(self, image):
        if self.options.condition_size is not None:
            height, width = self.options.condition_size
            return height // 32 * 32, width // 32 * 32
        module = self._module()
        width, height = module.calculate_dimensions(module.VAE_IMAGE_SIZE, image.size[0] / image.size[1])
        return height, width

    def _template_input(self, prompt, images):
        slots = "".join(f"Picture {i + 1}: {VISION_SLOT}" for i in range(len(images)))
        return self.pipeline.prompt_template_encode.format(slots + prompt), (images or None)


def _as_pil(image):
    """A PIL image as RGB; a `[3, H, W]` tensor in [0, 1] as an 8-bit RGB PIL image."""
    if isinstance(image, torch.Tensor):
        from PIL import Image

        array = (image.detach().float().clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy()
        return Image.fromarray(array, "RGB")
    return image.convert("RGB")


_EDIT_TEMPLATE_WORDS = tuple(
    "Ġ" + w
    for w in "key features input explain how instruction should alter or modify Generate new that meets requirements "
    "while maintaining consistency with original where appropriate then user".split()
) + ("Ġ(", "color", "),", "'s", ("Ġ", "user"))
"""More whole words of the edit template for the tiny tokenizer: its system prefix is then 64 tokens, the pipelines'
`prompt_template_encode_start_idx`, so the dropped prefix is the same text as with the real tokenizer."""
