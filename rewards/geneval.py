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
the thresholds below (tuned for Mask2Former) may need adjusting (`threshold=`, `counting_threshold=`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from flowrl.rewards import register
from flowrl.rewards.base import Reward


# --- GenEval's constants: djghosh13/geneval evaluation/evaluate_images.py (`__main__` options and module globals);
# Flow-GRPO's reward (yifan123/reward-server reward_server/gen_eval.py) uses the same values.
THRESHOLD = 0.3
"""Detection confidence threshold (`THRESHOLD`, option `threshold`); a detection is kept when `score > THRESHOLD`."""
COUNTING_THRESHOLD = 0.9
"""Confidence threshold for `counting` prompts (`COUNTING_THRESHOLD`, option `counting_threshold`)."""
MAX_OBJECTS = 16
"""At most this many detections per class, the highest-scoring (`MAX_OBJECTS`, option `max_objects`)."""
NMS_THRESHOLD = 1.0
"""Greedy per-class NMS drops boxes with IoU >= this (`NMS_THRESHOLD`, option `max_overlap`); 1.0 disables it."""
POSITION_THRESHOLD = 0.1
"""The position rule's margin c (`POSITION_THRESHOLD`, option `position_threshold`): each centre offset is shrunk by
c times the sum of the two boxes' sizes along that axis before the direction is read."""
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
"""GenEval's colour names (`COLORS`)."""
RELATIONS = ("left of", "right of", "above", "below")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
MODES = ("geneval", "strict", "partial")

COCO_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow", "elephant",
    "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
    "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli",
    "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet",
    "tv", "laptop", "mouse", "remote", "keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
"""The 80 COCO classes under their COCO 2017 names (what DETR-family checkpoints' `id2label` use)."""
ALIASES = {
    "motorbike": "motorcycle", "aeroplane": "airplane", "sofa": "couch", "tvmonitor": "tv", "tv monitor": "tv",
    "television": "tv", "computer mouse": "mouse", "computer keyboard": "keyboard", "tv remote": "remote",
    "remote control": "remote", "diningtable": "dining table", "pottedplant": "potted plant",
    "mobile phone": "cell phone", "cellphone": "cell phone", "hair dryer": "hair drier", "hairdrier": "hair drier",
    "doughnut": "donut", "hotdog": "hot dog", "teddybear": "teddy bear", "wineglass": "wine glass",
    "fridge": "refrigerator", "people": "person",
}  # fmt: skip
"""Other spellings of COCO classes (PASCAL VOC, GenEval's prompt wording, hub checkpoints) -> the COCO 2017 name.
Applied to detector labels and metadata classes alike, so `computer mouse` in metadata matches a `mouse` box."""


def canonical(name: str) -> str:
    """The COCO 2017 name of a class spelling (lower case, `_`/`-` as spaces, aliases resolved)."""
    text = " ".join(str(name).lower().replace("_", " ").replace("-", " ").split())
    return ALIASES.get(text, text)


@dataclass(frozen=True)
class Detection:
    """One detected object.

    Args:
        label (`str`): the class name (compared after `canonical`).
        score (`float`): the detector's confidence in [0, 1].
        box (`tuple[float, float, float, float]`): `(x0, y0, x1, y1)` in pixels, y growing downward.
        mask (`np.ndarray`, *optional*): `[H, W]` bool instance mask over the whole image.
        color (`str`, *optional*): the object's colour (one of `COLORS`), when already classified.
    """

    label: str
    score: float
    box: tuple[float, float, float, float]
    mask: Any = None
    color: str | None = None


class Verdict(NamedTuple):
    """`evaluate`'s result: `correct` (the mode's binary criterion), `score` (the reward) and `reason` (why not)."""

    correct: bool
    score: float
    reason: str


def compute_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two xyxy boxes with GenEval's `+1` pixel convention (`compute_iou`)."""

    def area(box):
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])])
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def relative_position(a: Detection, b: Detection, margin: float = POSITION_THRESHOLD) -> set[str]:
    """GenEval's `relative_position`: the relations of box `a` to box `b` (`left of`, `right of`, `above`, `below`).

    The centre offset `a - b` is shrunk per axis by `margin * (size_a + size_b)` (clamped at 0, sign kept); if
    nothing is left (all below 1e-3) there is no relation; otherwise the shrunk offset divided by the norm of the
    original offset gives `(dx, dy)`, and a relation holds when its component is beyond 0.5 (strictly).
    """
    boxes = np.array([a.box, b.box], dtype=np.float64).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - margin * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def filter_detections(
    detections: Sequence[Detection],
    threshold: float = THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    max_overlap: float = NMS_THRESHOLD,
) -> dict[str, list[Detection]]:
    """GenEval's `evaluate_image` pre-processing: per COCO class, the detections with `score > threshold`, highest
    first, at most `max_objects`, then greedy NMS (IoU >= `max_overlap` dropped; 1.0 keeps everything)."""
    by_class: dict[str, list[Detection]] = {}
    for det in detections:
        by_class.setdefault(canonical(det.label), []).append(det)
    out = {}
    for name, dets in by_class.items():
        order = sorted((d for d in dets if d.score > threshold), key=lambda d: -d.score)[:max_objects]
        kept = []
        while order:
            best = order.pop(0)
            kept.append(best)
            order = [d for d in order if max_overlap == 1 or compute_iou(best.box, d.box) < max_overlap]
        if kept:
            out[name] = kept
    return out


ColorOf = Callable[[Detection, str], str]


def _color_of(det: Detection, classname: str) -> str:
    if det.color is None:
        raise ValueError(f"detection {det.label!r} has no colour: classify it first or pass color_of=")
    return det.color


def _colors(found: list[Detection], classname: str, color_of: ColorOf | None) -> list[str]:
    return [(color_of or _color_of)(d, classname) for d in found]


def _position_holds(found, targets, relation, margin) -> tuple[bool, str]:
    for obj in found:
        for target in targets:
            rels = relative_position(obj, target, margin)
            if relation not in rels:
                return False, f"found {' and '.join(sorted(rels)) or 'no relation'} target"
    return True, ""


def evaluate(
    metadata: Mapping[str, Any],
    detections: Sequence[Detection],
    *,
    mode: str = "geneval",
    color_of: ColorOf | None = None,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    max_overlap: float = NMS_THRESHOLD,
    position_threshold: float = POSITION_THRESHOLD,
) -> Verdict:
    """Check `detections` (raw: thresholds, per-class limit and NMS are applied here) against GenEval `metadata`.

    Args:
        metadata (`Mapping`): `{"tag": ..., "include": [...], "exclude": [...]}` (GenEval's format).
        detections (`Sequence[Detection]`): everything the detector found, any score.
        mode (`str`, defaults to `"geneval"`):
            - `"geneval"`: GenEval's `evaluate`: every include clause has >= `count` objects (its top-`count` by
              score must all have the `color`, and each must stand in `position[0]` relation to every object
              matched by include clause `position[1]`), and no exclude clause has >= `count` objects. `score` is
              1.0 or 0.0.
            - `"strict"`: Flow-GRPO's strict accuracy (`evaluate_reward`): exactly `count` objects per include
              clause (all of them checked), exactly `count` of them of the `color`, positions as above. Unlike
              Flow-GRPO, exclude clauses still apply (for GenEval's metadata they are implied by the exact count).
              `score` is 1.0 or 0.0.
            - `"partial"`: Flow-GRPO's partial credit, `correct` as in `"strict"`, `score` the mean of per-clause
              terms: `1 - |count - n| / count` for the count (negative when `n > 2 count`); if the count is wrong a
              colour or position clause adds 0; else colour adds `1 - |count - n_color| / count` and position adds
              1 if it holds (target clause matched and relation true) and 0 otherwise. Flow-GRPO adds an extra 1
              after a failed position check (a misplaced `append`); that quirk is not reproduced. Exclude clauses
              do not enter the score (as in Flow-GRPO).
        color_of (`Callable[[Detection, str], str]`, *optional*): the colour of a detection of a class; defaults
            to the detection's own `color`. Only called for clauses with a `color`.
        threshold, counting_threshold, max_objects, max_overlap, position_threshold: GenEval's options (defaults
            above); `counting_threshold` replaces `threshold` for `tag == "counting"`.
    """
    if mode not in MODES:
        raise ValueError(f"unknown GenEval mode {mode!r}; choose from {', '.join(MODES)}")
    thr = counting_threshold if metadata.get("tag") == "counting" else threshold
    objects = filter_detections(detections, thr, max_objects, max_overlap)
    exact = mode != "geneval"
    correct, reasons, terms, matched_groups = True, [], [], []
    for req in metadata.get("include") or []:
        name, count = canonical(req["class"]), int(req["count"])
        found = objects.get(name, [])
        if not exact:
            found = found[:count]  # GenEval checks colour and position on the top-`count` objects only
        matched = len(found) == count if exact else len(found) >= count
        terms.append(1 - abs(count - len(found)) / max(count, 1))
        if not matched:
            reasons.append(f"expected {name}{'==' if exact else '>='}{count}, found {len(found)}")
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if req.get("color") is not None:
                colors = _colors(found, name, color_of)
                n = colors.count(req["color"])
                terms.append(1 - abs(count - n) / max(count, 1))
                if (n != count) if exact else (n < count):
                    matched = False
                    seen = ", ".join(f"{colors.count(c)} {c}" for c in COLORS if c in colors)
                    reasons.append(f"expected {req['color']} {name}>={count}, found {n} {req['color']}; and {seen}")
            if req.get("position") is not None and matched:
                relation, index = req["position"]
                targets = matched_groups[index] if 0 <= index < len(matched_groups) else None
                if targets is None:
                    matched = False
                    reasons.append(f"no target for {name} to be {relation}")
                else:
                    matched, why = _position_holds(found, targets, relation, position_threshold)
                    if not matched:
                        reasons.append(f"expected {name} {relation} target, {why}")
                terms.append(1.0 if matched else 0.0)
        correct = correct and matched
        matched_groups.append(found if matched else None)
    for req in metadata.get("exclude") or []:
        name = canonical(req["class"])
        n = len(objects.get(name, []))
        if n >= int(req["count"]):
            correct = False
            reasons.append(f"expected {name}<{req['count']}, found {n}")
    if mode == "partial":
        score = float(sum(terms) / len(terms)) if terms else 0.0
    else:
        score = float(correct)
    return Verdict(bool(correct), score, "\n".join(reasons))


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
    "COCO_CLASSES",
    "COLORS",
    "CLIPColorClassifier",
    "Detection",
    "GenEvalReward",
    "HueColorClassifier",
    "TransformersDetector",
    "Verdict",
    "canonical",
    "evaluate",
    "filter_detections",
    "hue_color",
    "relative_position",
]
