"""GenEval's rule engine (djghosh13/geneval `evaluation/evaluate_images.py`): its constants and COCO class tables,
the typed `Detection`, and `evaluate(metadata, detections, mode=...) -> Verdict`, pure functions over detections.

The reward that runs a detector and these rules is `flowrl.rewards.geneval`, which re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


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
