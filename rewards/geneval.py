"""GenEval-style compositional reward: GenEval's rules over the detections of a pluggable object detector.

GenEval (Ghosh et al. 2023, arXiv:2310.11513, djghosh13/geneval `evaluation/evaluate_images.py`) checks a generated
image against prompt metadata: `tag` (`single_object`, `two_object`, `counting`, `colors`, `position`,
`color_attr`), `include` clauses (`class`, `count`, optional `color`, optional `position = [relation, index]`:
"this object is <relation> the objects of include clause `index`") and `exclude` clauses (`class`, `count`: fail
when at least `count` are found). The shipped `compositional/{train,test}` prompt sets carry this metadata.

- `evaluate(metadata, detections) -> Verdict(correct, score, reason)` is the pure rule engine over typed
  `Detection`s (label, score, box xyxy in pixels, optional mask, optional colour). Three modes:
  `"geneval"` (the benchmark's binary rule: at least `count` objects, the top-`count` by score checked for colour
  and position, `exclude` clauses enforced), `"strict"` (Flow-GRPO's strict accuracy: exactly `count` objects
  and exactly `count` of the requested colour) and `"partial"` (Flow-GRPO's partial credit, the score its
  `geneval` reward trains on: the mean of per-clause terms `1 - |count - n| / count`).
- `TransformersDetector` adapts any transformers object detector (DETR, Deformable DETR, RT-DETR, YOLOS, ...:
  `AutoModelForObjectDetection` + `AutoImageProcessor`; OWL-ViT/OWLv2 zero-shot detectors queried with the COCO
  class names) to `Detection`s with labels mapped to COCO class names.
- Colours come from a pluggable classifier: `HueColorClassifier` (weight-free default: the mean colour of the
  mask/box pixels mapped to GenEval's ten colour names by hue, saturation and value; NOT GenEval's classifier) or
  `CLIPColorClassifier` (GenEval's CLIP zero-shot classifier: templates, grey background, box crop; GenEval uses
  OpenAI CLIP ViT-L/14, i.e. `openai/clip-vit-large-patch14`).
- The registered reward `geneval` runs detector + colour classifier + rules on each image with its prompt metadata.

GenEval's detector is mmdet Mask2Former (Swin-S, COCO); with another detector the scores are on another scale, so
the thresholds (tuned for Mask2Former) may need adjusting (`threshold=`, `counting_threshold=`).

The rules, constants and COCO tables are in `flowrl.rewards.geneval_rules`, the colour classifiers and the detector
adapter in `flowrl.rewards.geneval_models`, the reward here; this module re-exports the public names of both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from flowrl.rewards import register
from flowrl.rewards.base import Reward
from flowrl.rewards.geneval_models import (
    ZERO_SHOT_TYPES,
    CLIPColorClassifier,
    HueColorClassifier,
    TransformersDetector,
    hue_color,
    region_pixels,
)
from flowrl.rewards.geneval_rules import (
    ALIASES,
    COCO_CLASSES,
    COLORS,
    COUNTING_THRESHOLD,
    MAX_OBJECTS,
    MODES,
    NMS_THRESHOLD,
    POSITION_THRESHOLD,
    RELATIONS,
    TAGS,
    THRESHOLD,
    ColorOf,
    Detection,
    Verdict,
    canonical,
    compute_iou,
    evaluate,
    filter_detections,
    relative_position,
)


# --- the reward


def to_uint8(images: torch.Tensor) -> list[np.ndarray]:
    """`[B, 3, H, W]` in [0, 1] -> `[H, W, 3]` uint8 arrays (`round(255 x)`, as Flow-GRPO converts)."""
    x = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return list(x)


@register(
    "geneval",
    description="GenEval rules (objects, counts, colours, positions) over an object detector's boxes (needs: a "
    "transformers object detector `detector=` and GenEval metadata tag/include/exclude, e.g. compositional/train).",
)
class GenEvalReward(Reward):
    """GenEval-style compositional reward: detector -> `Detection`s -> colours -> `evaluate` per image.

    Reads the prompt metadata `include` (required), `exclude` and `tag`; a row without `include` scores NaN.

    Args:
        detector (`str` or callable): hub id / folder of a transformers object detector (`TransformersDetector`),
            or any `detector(images: list[[H, W, 3] uint8]) -> list[list[Detection]]`.
        mode (`str`, defaults to `"geneval"`): `"geneval"` (binary benchmark rule), `"strict"` or `"partial"`
            (Flow-GRPO's); see `evaluate`.
        color_classifier (`str` or callable, defaults to `"hue"`): `"hue"` (`HueColorClassifier`, weight-free),
            `"clip"` (`CLIPColorClassifier` on `clip_model`) or any `classifier(image, detection, classname) -> str`.
        clip_model (`str`, defaults to `openai/clip-vit-large-patch14`): the CLIP model of `color_classifier="clip"`.
        threshold, counting_threshold, max_objects, max_overlap, position_threshold: GenEval's rule options.
        label_map (`dict`, *optional*): detector label -> COCO class name (see `TransformersDetector`).
    """

    def __init__(
        self,
        detector: str | Callable[..., list[list[Detection]]] | None = None,
        mode: str = "geneval",
        color_classifier: str | Callable[..., str] = "hue",
        clip_model: str = CLIPColorClassifier.DEFAULT,
        threshold: float = THRESHOLD,
        counting_threshold: float = COUNTING_THRESHOLD,
        max_objects: int = MAX_OBJECTS,
        max_overlap: float = NMS_THRESHOLD,
        position_threshold: float = POSITION_THRESHOLD,
        label_map: Mapping[str, str] | None = None,
        device=None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 16,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if mode not in MODES:
            raise ValueError(f"unknown GenEval mode {mode!r}; choose from {', '.join(MODES)}")
        if detector is None:
            raise ValueError(
                "reward 'geneval' needs detector=: a transformers object detector (hub id or folder, "
                "e.g. facebook/detr-resnet-50) or a callable returning Detection lists"
            )
        self.mode = mode
        self.options = dict(
            threshold=threshold,
            counting_threshold=counting_threshold,
            max_objects=max_objects,
            max_overlap=max_overlap,
            position_threshold=position_threshold,
        )
        if isinstance(detector, str):
            floor = min(threshold, counting_threshold)
            detector = TransformersDetector(detector, self.device, self.dtype, min_score=floor, label_map=label_map)
        self.detector = detector
        if color_classifier == "hue":
            color_classifier = HueColorClassifier()
        elif color_classifier == "clip":
            color_classifier = CLIPColorClassifier(clip_model, device=self.device)
        elif isinstance(color_classifier, str):
            raise ValueError(f"unknown color_classifier {color_classifier!r}: 'hue', 'clip' or a callable")
        self.color_classifier = color_classifier

    def detect(self, images: torch.Tensor) -> tuple[list[np.ndarray], list[list[Detection]]]:
        """The uint8 images and their raw detections."""
        arrays = to_uint8(images)
        return arrays, self.detector(arrays)

    def verdicts(self, images: torch.Tensor, metadatas: Sequence[Mapping[str, Any] | None]) -> list[Verdict | None]:
        """`evaluate` per image (None where the metadata has no `include`)."""
        arrays, detections = self.detect(images)
        out = []
        for image, dets, meta in zip(arrays, detections, metadatas):
            if not meta or meta.get("include") is None:
                out.append(None)
                continue

            def color_of(det, classname, image=image):
                return det.color or self.color_classifier(image, det, classname)

            out.append(evaluate(meta, dets, mode=self.mode, color_of=color_of, **self.options))
        return out

    def score(self, images, prompts, tag=None, include=None, exclude=None, **metadata):
        if include is None:
            raise ValueError(
                "reward 'geneval' needs GenEval metadata (`include`, `exclude`, `tag`) on the prompts: "
                "use a prompt set such as compositional/train or a jsonl with those keys"
            )
        n = len(prompts)
        tag = tag if tag is not None else [None] * n
        exclude = exclude if exclude is not None else [None] * n
        metas = [
            None if inc is None else {"tag": t, "include": inc, "exclude": exc or []}
            for t, inc, exc in zip(tag, include, exclude)
        ]
        verdicts = self.verdicts(images, metas)
        return torch.tensor([float("nan") if v is None else v.score for v in verdicts], dtype=torch.float32)


__all__ = [
    "ALIASES",
    "CLIPColorClassifier",
    "COCO_CLASSES",
    "COLORS",
    "COUNTING_THRESHOLD",
    "ColorOf",
    "Detection",
    "GenEvalReward",
    "HueColorClassifier",
    "MAX_OBJECTS",
    "MODES",
    "NMS_THRESHOLD",
    "POSITION_THRESHOLD",
    "RELATIONS",
    "TAGS",
    "THRESHOLD",
    "TransformersDetector",
    "Verdict",
    "ZERO_SHOT_TYPES",
    "canonical",
    "compute_iou",
    "evaluate",
    "filter_detections",
    "hue_color",
    "region_pixels",
    "relative_position",
    "to_uint8",
]
