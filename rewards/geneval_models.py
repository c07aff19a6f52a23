"""The models the `geneval` reward runs on images: colour classifiers (`classifier(image, detection, classname) ->
colour name`) and the transformers object-detector adapter (`detector(images) -> list[list[Detection]]`).

`flowrl.rewards.geneval` re-exports every name here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from flowrl.rewards.geneval_rules import COCO_CLASSES, COLORS, Detection, canonical


# --- colour classifiers: `classifier(image, detection, classname) -> colour name`, `image` an `[H, W, 3]` uint8 array


def region_pixels(image: np.ndarray, det: Detection) -> np.ndarray:
    """`[N, 3]` uint8 pixels of the detection: inside its mask when it has one, else inside its box."""
    h, w = image.shape[:2]
    x0, y0 = max(int(math.floor(det.box[0])), 0), max(int(math.floor(det.box[1])), 0)
    x1, y1 = min(int(math.ceil(det.box[2])), w), min(int(math.ceil(det.box[3])), h)
    if det.mask is not None:
        mask = np.asarray(det.mask, dtype=bool)
        if mask.shape == (h, w) and mask.any():
            return image[mask]
    if x1 <= x0 or y1 <= y0:
        return image.reshape(-1, 3)[:0]
    return image[y0:y1, x0:x1].reshape(-1, 3)


def hue_color(rgb: Sequence[float]) -> str:
    """GenEval colour name of a mean colour `rgb` in [0, 1]: black/white by value for dark or unsaturated colours,
    else by hue (red < 15 deg <= orange < 45 <= yellow < 70 <= green < 165 <= blue < 255 <= purple < 290 <= pink <
    345 <= red), dark or dull orange/yellow as brown and light, unsaturated red as pink."""
    import colorsys

    r, g, b = (float(min(max(c, 0.0), 1.0)) for c in rgb)
    h, s, v = colorsys.rgb_to_hsv(r, g, b)
    deg = h * 360
    if v < 0.2:
        return "black"
    if s < 0.2:
        return "white" if v >= 0.6 else "black"
    if deg < 15 or deg >= 345:
        return "pink" if s < 0.5 and v > 0.6 else "red"
    if deg < 45:
        return "brown" if v < 0.6 or s < 0.45 else "orange"
    if deg < 70:
        return "brown" if v < 0.45 else "yellow"
    if deg < 165:
        return "green"
    if deg < 255:
        return "blue"
    if deg < 290:
        return "purple"
    return "pink"


class HueColorClassifier:
    """Weight-free colour classifier: the mean RGB of the mask (or box) pixels named by `hue_color`.

    A rough stand-in for GenEval's CLIP classifier (`CLIPColorClassifier`): box pixels include background, and
    shading or multicoloured objects are reduced to one mean colour. Empty regions are `"black"`.
    """

    def __call__(self, image: np.ndarray, det: Detection, classname: str) -> str:
        pixels = region_pixels(image, det)
        if not len(pixels):
            return "black"
        return hue_color(pixels.reshape(-1, 3).mean(0) / 255.0)


class CLIPColorClassifier:
    """GenEval's colour classifier: CLIP zero-shot over `COLORS` with GenEval's three templates per class
    (`a photo of a {c} {classname}`, `a photo of a {c}-colored {classname}`, `a photo of a {c} object`; the unit
    text embeddings averaged per colour and renormalised, as clip_benchmark's `zero_shot_classifier`), on the box
    crop of the image with the pixels outside the instance mask set to grey `#999` (GenEval's `bgcolor`, `crop=1`).

    Args:
        model (`str`, defaults to `openai/clip-vit-large-patch14`): hub id or folder of a transformers CLIP model
            (GenEval uses OpenAI's ViT-L/14 through open_clip; these are the same weights).
    """

    DEFAULT = "openai/clip-vit-large-patch14"
    GREY = (0x99, 0x99, 0x99)

    def __init__(self, model: str = DEFAULT, device=None, dtype=torch.float32):
        from flowrl.rewards.clip_models import HFCLIP

        self.clip = HFCLIP("geneval", model, default_repo=self.DEFAULT, device=device, dtype=dtype)
        self.device = torch.device(device or "cpu")
        self._classifiers: dict[str, torch.Tensor] = {}

    def classifier(self, classname: str) -> torch.Tensor:
        """`[10, D]` unit colour embeddings for `classname`."""
        if classname not in self._classifiers:
            templates = [
                f"a photo of a {{c}} {classname}",
                f"a photo of a {{c}}-colored {classname}",
                "a photo of a {c} object",
            ]
            texts = [t.format(c=c) for c in COLORS for t in templates]
            emb = self.clip.encode_text(texts).float().reshape(len(COLORS), len(templates), -1).mean(1)
            self._classifiers[classname] = emb / emb.norm(dim=-1, keepdim=True)
        return self._classifiers[classname]

    def crop(self, image: np.ndarray, det: Detection) -> np.ndarray:
        """The box crop, pixels outside the mask (when there is one) grey."""
        h, w = image.shape[:2]
        out = image.copy()
        if det.mask is not None and np.asarray(det.mask).shape == (h, w):
            out[~np.asarray(det.mask, dtype=bool)] = self.GREY
        x0, y0 = max(int(det.box[0]), 0), max(int(det.box[1]), 0)
        x1, y1 = min(max(int(det.box[2]), x0 + 1), w), min(max(int(det.box[3]), y0 + 1), h)
        return out[y0:y1, x0:x1]

    def __call__(self, image: np.ndarray, det: Detection, classname: str) -> str:
        crop = torch.from_numpy(np.ascontiguousarray(self.crop(image, det))).permute(2, 0, 1)[None].float() / 255
        with torch.no_grad():
            emb = self.clip.encode_image(crop.to(self.device)).float()
        return COLORS[int((emb @ self.classifier(classname).T).argmax())]


# --- the detector adapter


ZERO_SHOT_TYPES = ("owlvit", "owlv2")


class TransformersDetector:
    """A transformers object detector as `detector(images) -> list[list[Detection]]` (`images` `[H, W, 3]` uint8).

    Closed-set detectors (`AutoModelForObjectDetection`: DETR, Deformable DETR, Conditional DETR, RT-DETR, YOLOS,
    ...) name their classes through `config.id2label`; OWL-ViT / OWLv2 (`AutoModelForZeroShotObjectDetection`) are
    queried with `a photo of a {class}` for the 80 COCO classes. Labels are mapped to COCO names by `canonical`
    (and `label_map` first); labels that are not COCO classes (`N/A`, ...) are dropped.

    Args:
        model (`str`): hub id or local folder (config, weights and `preprocessor_config.json`).
        min_score (`float`, defaults to 0.0): detections at or below it are dropped here (the rules apply
            GenEval's thresholds afterwards).
        label_map (`dict[str, str]`, *optional*): detector label -> COCO class name, for unusual label sets.
    """

    def __init__(
        self,
        model: str,
        device=None,
        dtype=torch.float32,
        min_score: float = 0.0,
        label_map: Mapping[str, str] | None = None,
    ):
        from transformers import AutoConfig

        from flowrl.rewards.loading import load_pretrained

        needs = "config.json, the weights and preprocessor_config.json of a transformers object detector"
        fix = "pass detector=DIR, a folder saved by `save_pretrained` (or `hf download ORG/NAME --local-dir DIR`)"

        def load(loader, what):
            return load_pretrained("geneval", loader, model, what=what, needs=needs, fix=fix)

        config = load(AutoConfig.from_pretrained, "detector config")
        self.zero_shot = config.model_type in ZERO_SHOT_TYPES
        if self.zero_shot:
            from transformers import AutoModelForZeroShotObjectDetection as Auto
            from transformers import AutoProcessor as Processor
        else:
            from transformers import AutoImageProcessor as Processor
            from transformers import AutoModelForObjectDetection as Auto
        self.model = load(Auto.from_pretrained, "object detector").to(device=device, dtype=dtype).eval()
        self.model.requires_grad_(False)
        self.processor = load(Processor.from_pretrained, "detector processor")
        self.device, self.dtype = torch.device(device or "cpu"), dtype
        self.min_score = min_score
        self.label_map = {canonical(k): canonical(v) for k, v in (label_map or {}).items()}
        id2label = {} if self.zero_shot else dict(config.id2label or {})
        self.labels = {int(i): self._coco(name) for i, name in id2label.items()}

    def _coco(self, name: str) -> str | None:
        name = canonical(name)
        name = self.label_map.get(name, name)
        return name if name in COCO_CLASSES else None

    def __call__(self, images: Sequence[np.ndarray]) -> list[list[Detection]]:
        sizes = [tuple(im.shape[:2]) for im in images]
        if self.zero_shot:
            queries = [f"a photo of a {c}" for c in COCO_CLASSES]
            inputs = self.processor(text=[queries] * len(images), images=list(images), return_tensors="pt")
        else:
            inputs = self.processor(images=list(images), return_tensors="pt")
        inputs = {
            k: v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device) for k, v in inputs.items()
        }
        outputs = self.model(**inputs)
        if self.zero_shot and hasattr(self.processor, "post_process_grounded_object_detection"):
            post = self.processor.post_process_grounded_object_detection  # transformers 5's OWL-ViT processors
        else:
            post = self.processor.post_process_object_detection
        results = post(outputs, threshold=self.min_score, target_sizes=sizes)
        out = []
        for result in results:
            dets = []
            for score, label, box in zip(
                result["scores"].tolist(), result["labels"].tolist(), result["boxes"].tolist()
            ):
                name = COCO_CLASSES[label] if self.zero_shot else self.labels.get(int(label))
                if name is not None and score > self.min_score:
                    dets.append(Detection(name, float(score), tuple(float(x) for x in box)))
            out.append(dets)
        return out
