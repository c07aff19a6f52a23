"""The `geneval` reward: GenEval's rules on hand-written detections, the colour classifiers, and the transformers
detector adapter on a tiny random DETR."""

import math

import numpy as np
import pytest
import torch

from flowrl import prompts, rewards
from flowrl.rewards.geneval import (
    COCO_CLASSES,
    COLORS,
    RELATIONS,
    TAGS,
    CLIPColorClassifier,
    Detection,
    HueColorClassifier,
    TransformersDetector,
    evaluate,
    filter_detections,
    hue_color,
    relative_position,
)


def det(label, box=(0, 0, 10, 10), score=0.95, color=None, mask=None):
    return Detection(label, score, tuple(float(x) for x in box), mask=mask, color=color)


def check(meta, dets, mode="geneval", **kw):
    return evaluate(meta, dets, mode=mode, **kw)


SINGLE = {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}
TWO = {"tag": "two_object", "include": [{"class": "truck", "count": 1}, {"class": "bottle", "count": 1}]}
COUNT = {"tag": "counting", "include": [{"class": "orange", "count": 3}], "exclude": [{"class": "orange", "count": 4}]}
COLOR = {"tag": "colors", "include": [{"class": "stop sign", "count": 1, "color": "pink"}]}
# "a photo of a tie above a sink"
POSITION = {
    "tag": "position",
    "include": [{"class": "sink", "count": 1}, {"class": "tie", "count": 1, "position": ["above", 0]}],
}
ATTR = {
    "tag": "color_attr",
    "include": [{"class": "train", "count": 1, "color": "purple"}, {"class": "oven", "count": 1, "color": "green"}],
}


# --- the rules, one task at a time


def test_single_object():
    assert check(SINGLE, [det("bench")]) == (True, 1.0, "")
    wrong = check(SINGLE, [det("chair")])
    assert wrong.correct is False and wrong.score == 0.0 and "expected bench>=1, found 0" in wrong.reason
    # GenEval keeps a detection when score > 0.3 (strictly): exactly at the threshold is not found
    assert check(SINGLE, [det("bench", score=0.3)]).score == 0.0
    assert check(SINGLE, [det("bench", score=0.31)]).score == 1.0
    assert check(SINGLE, [det("bench", score=0.5)], threshold=0.6).score == 0.0
    assert check(SINGLE, []).score == 0.0


def test_two_object():
    assert check(TWO, [det("truck"), det("bottle", (20, 0, 30, 10))]).score == 1.0
    assert check(TWO, [det("truck")]).score == 0.0
    assert check(TWO, [det("truck")], mode="partial").score == 0.5  # (1 + 0) / 2


def test_counting_exact_and_off_by_one():
    three = [det("orange", (20 * i, 0, 20 * i + 10, 10)) for i in range(3)]
    assert check(COUNT, three).score == 1.0
    assert check(COUNT, three[:2]).score == 0.0  # one too few
    four = three + [det("orange", (70, 0, 80, 10))]
    verdict = check(COUNT, four)  # one too many: the exclude clause (count 4) fails
    assert verdict.score == 0.0 and "expected orange<4, found 4" in verdict.reason
    # counting prompts use the 0.9 threshold: a 0.5 fourth orange is not counted, a 0.5 third one is missing
    assert check(COUNT, three + [det("orange", (70, 0, 80, 10), score=0.5)]).score == 1.0
    assert check(COUNT, three[:2] + [det("orange", (40, 0, 50, 10), score=0.5)]).score == 0.0
    assert check(COUNT, three[:2] + [det("orange", (40, 0, 50, 10), score=0.5)], counting_threshold=0.4).score == 1
    # partial credit: 1 - |3 - n| / 3
    assert check(COUNT, three[:2], mode="partial").score == pytest.approx(2 / 3)
    assert check(COUNT, four, mode="partial").score == pytest.approx(2 / 3)
    assert check(COUNT, four, mode="partial").correct is False


def test_geneval_needs_at_least_count_strict_needs_exactly():
    two_benches = [det("bench"), det("bench", (30, 0, 40, 10), score=0.8)]
    assert check(SINGLE, two_benches).score == 1.0  # GenEval: >= count (no exclude clause here)
    assert check(SINGLE, two_benches, mode="strict").score == 0.0  # Flow-GRPO strict: == count
    assert check(SINGLE, two_benches, mode="partial").score == 0.0  # 1 - |1 - 2| / 1
    assert check(SINGLE, [det("bench")] * 16 + [det("bench")] * 4, mode="partial").score == -14.0  # 16 kept at most


def test_colors():
    assert check(COLOR, [det("stop sign", color="pink")]).score == 1.0
    wrong = check(COLOR, [det("stop sign", color="red")])
    assert wrong.score == 0.0 and "expected pink stop sign>=1, found 0 pink; and 1 red" in wrong.reason
    assert check(COLOR, [det("stop sign", color="red")], mode="partial").score == 0.5  # count 1, colour 0
    assert check(COLOR, [], mode="partial").score == 0.0  # count wrong: the colour term is 0 too
    # GenEval checks the colour of the top-`count` objects only: a pink second stop sign does not help
    two = [det("stop sign", color="red", score=0.9), det("stop sign", (20, 0, 30, 10), color="pink", score=0.8)]
    assert check(COLOR, two).score == 0.0
    # a colour classifier as a callable; detections without colour need one
    assert check(COLOR, [det("stop sign")], color_of=lambda d, c: "pink").score == 1.0
    with pytest.raises(ValueError, match="no colour"):
        check(COLOR, [det("stop sign")])


def test_color_attribution():
    right = [det("train", color="purple"), det("oven", (20, 0, 30, 10), color="green")]
    assert check(ATTR, right).score == 1.0
    swapped = [det("train", color="green"), det("oven", (20, 0, 30, 10), color="purple")]
    assert check(ATTR, swapped).score == 0.0
    assert check(ATTR, swapped, mode="partial").score == 0.5  # counts 1, 1; colours 0, 0


def test_position_and_its_margin():
    sink = det("sink", (0, 50, 10, 60))
    assert check(POSITION, [sink, det("tie", (0, 20, 10, 30))]).score == 1.0  # 30 px above
    assert check(POSITION, [sink, det("tie", (0, 80, 10, 90))]).score == 0.0  # below
    assert check(POSITION, [det("tie", (0, 20, 10, 30))]).score == 0.0  # no sink: no target
    # margin c = 0.1: offsets shrink by 0.1 * (10 + 10) = 2 px; "above" needs the shrunk dy / |offset| < -0.5,
    # i.e. a vertical offset beyond 4 px here. 4 px exactly: -2 / 4 = -0.5 is not < -0.5.
    assert check(POSITION, [sink, det("tie", (0, 46, 10, 56))]).score == 0.0
    assert check(POSITION, [sink, det("tie", (0, 45.5, 10, 55.5))]).score == 1.0
    assert relative_position(det("a", (0, 48, 10, 58)), sink) == set()  # within the margin: no relation at all
    assert relative_position(det("a", (0, 48, 10, 58)), sink, margin=0.0) == {"above"}
    # diagonal: both relations hold
    assert relative_position(det("a", (0, 0, 10, 10)), det("b", (10, 10, 20, 20))) == {"left of", "above"}
    # every tie must be above every matched sink (GenEval checks the top-`count` ties only)
    low_second = [sink, det("tie", (0, 20, 10, 30), score=0.9), det("tie", (0, 80, 10, 90), score=0.8)]
    assert check(POSITION, low_second).score == 1.0
    assert check(POSITION, low_second, mode="strict").score == 0.0  # 2 ties != 1
    # partial: counts 1 and 1, position 0 (Flow-GRPO's extra 1 after a failed position is not reproduced)
    assert check(POSITION, [sink, det("tie", (0, 80, 10, 90))], mode="partial").score == pytest.approx(2 / 3)


def test_excluded_object_present():
    meta = {
        "tag": "single_object",
        "include": [{"class": "cat", "count": 1}],
        "exclude": [{"class": "dog", "count": 1}],
    }
    assert check(meta, [det("cat")]).score == 1.0
    verdict = check(meta, [det("cat"), det("dog", (20, 0, 30, 10))])
    assert verdict.score == 0.0 and "expected dog<1, found 1" in verdict.reason
    assert check(meta, [det("cat"), det("dog", (20, 0, 30, 10), score=0.2)]).score == 1.0  # below threshold


def test_filtering_nms_and_class_names():
    boxes = [det("cup", (0, 0, 10, 10), 0.9), det("cup", (1, 0, 11, 10), 0.8), det("cup", (50, 0, 60, 10), 0.7)]
    assert len(filter_detections(boxes)["cup"]) == 3  # max_overlap 1.0: no NMS
    kept = filter_detections(boxes, max_overlap=0.5)["cup"]
    assert [d.score for d in kept] == [0.9, 0.7]
    assert len(filter_detections([det("cup", score=0.5)] * 20)["cup"]) == 16
    # spellings: GenEval's "computer mouse" metadata matches a detector's "mouse"; VOC's "sofa" is a couch
    meta = {"tag": "two_object", "include": [{"class": "computer mouse", "count": 1}, {"class": "couch", "count": 1}]}
    assert check(meta, [det("mouse"), det("Sofa", (20, 0, 30, 10))]).score == 1.0
    with pytest.raises(ValueError, match="mode"):
        check(SINGLE, [], mode="lenient")


def test_hue_color_classifier():
    named = {"red": (0.9, 0.1, 0.1), "orange": (1.0, 0.55, 0.0), "yellow": (0.95, 0.9, 0.1),
             "green": (0.1, 0.7, 0.2), "blue": (0.1, 0.2, 0.9), "purple": (0.5, 0.1, 0.8),
             "pink": (1.0, 0.6, 0.75), "brown": (0.45, 0.25, 0.1), "black": (0.05, 0.05, 0.05),
             "white": (0.95, 0.95, 0.95)}  # fmt: skip
    assert set(named) == set(COLORS)
    for name, rgb in named.items():
        assert hue_color(rgb) == name, name
    image = np.full((20, 20, 3), 255, dtype=np.uint8)
    image[8:12, 8:12] = (20, 40, 220)
    classify = HueColorClassifier()
    assert classify(image, det("car", (8, 8, 12, 12)), "car") == "blue"
    mask = np.zeros((20, 20), dtype=bool)
    mask[8:12, 8:12] = True
    assert classify(image, det("car", (0, 0, 20, 20), mask=mask), "car") == "blue"  # the mask excludes the white
    assert classify(image, det("car", (0, 0, 20, 20)), "car") == "white"  # the box alone is mostly white


def test_clip_color_classifier_runs(clip_dir):
    classify = CLIPColorClassifier(str(clip_dir))
    image = np.random.default_rng(0).integers(0, 255, (24, 24, 3), dtype=np.uint8)
    mask = np.zeros((24, 24), dtype=bool)
    mask[4:12, 4:12] = True
    assert classify(image, det("car", (2, 2, 20, 20), mask=mask), "car") in COLORS
    crop = classify.crop(image, det("car", (2, 2, 20, 20), mask=mask))
    assert crop.shape == (18, 18, 3) and (crop[0, 0] == 0x99).all()  # outside the mask: GenEval's grey


# --- the reward


def test_reward_reads_prompt_metadata():
    def detector(images):
        assert all(im.dtype == np.uint8 and im.shape == (16, 16, 3) for im in images)
        return [[det("bench", color="pink")], [det("chair")], [det("bench")]]

    reward = rewards.get("geneval", detector=detector, color_classifier=lambda im, d, c: "pink")
    metas = [SINGLE, SINGLE, None]
    scores = reward(
        torch.zeros(3, 3, 16, 16),
        ["a", "b", "c"],
        tag=[m and m["tag"] for m in metas],
        include=[m and m["include"] for m in metas],
        exclude=[None, None, None],
    )
    assert scores[:2].tolist() == [1.0, 0.0] and math.isnan(scores[2])
    with pytest.raises(ValueError, match="GenEval metadata"):
        reward(torch.zeros(3, 3, 16, 16), ["a", "b", "c"])
    with pytest.raises(ValueError, match="detector="):
        rewards.get("geneval")
    with pytest.raises(ValueError, match="mode"):
        rewards.get("geneval", detector=detector, mode="soft")


def test_shipped_compositional_metadata_is_geneval_format():
    rows = prompts.load("compositional/train") + prompts.load("compositional/test")
    assert {p.metadata["tag"] for p in rows} == set(TAGS)
    for p in rows:
        for clause in p.metadata["include"] + p.metadata.get("exclude", []):
            assert clause["class"] in COCO_CLASSES and clause["count"] >= 1
            assert clause.get("color") in (None, *COLORS)
            if "position" in clause:
                relation, index = clause["position"]
                assert relation in RELATIONS and 0 <= index < len(p.metadata["include"])
        # every prompt is satisfiable: objects laid out left to right, each of its colour, far enough apart
        dets, x = [], 0
        for clause in p.metadata["include"]:
            for _ in range(clause["count"]):
                dets.append(det(clause["class"], (x, 100, x + 10, 110), color=clause.get("color")))
                x += 30
        relation = next((c["position"][0] for c in p.metadata["include"] if "position" in c), None)
        if relation in ("left of", "above", "below"):  # re-place the second object to satisfy the relation
            a = {"left of": (-60, 100), "above": (0, 40), "below": (0, 160)}[relation]
            dets[1] = det(dets[1].label, (a[0], a[1], a[0] + 10, a[1] + 10))
        assert evaluate(p.metadata, dets).correct, p.text


@pytest.fixture(scope="module")
def detr_dir(tmp_path_factory):
    from transformers import DetrConfig, DetrForObjectDetection, DetrImageProcessor, ResNetConfig

    labels = {0: "N/A", 1: "bench", 2: "motorbike", 3: "orange", 4: "sink", 5: "tie"}
    backbone = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1], layer_type="basic", out_features=["stage4"]
    )
    config = DetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone_config=backbone,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        num_queries=8,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_detr")
    DetrForObjectDetection(config).save_pretrained(folder)
    DetrImageProcessor(size={"shortest_edge": 32, "longest_edge": 32}).save_pretrained(folder)
    return folder


def test_transformers_detector_adapter(detr_dir):
    detector = TransformersDetector(str(detr_dir))
    assert detector.labels[2] == "motorcycle" and detector.labels[0] is None  # mapped to COCO; N/A dropped
    images = [np.random.default_rng(i).integers(0, 255, (40, 48, 3), dtype=np.uint8) for i in range(2)]
    out = detector(images)
    assert len(out) == 2 and sum(map(len, out)) > 0
    for dets in out:
        for d in dets:
            assert isinstance(d, Detection) and d.label in COCO_CLASSES and 0 <= d.score <= 1
            assert len(d.box) == 4 and all(isinstance(v, float) for v in d.box)


def test_reward_end_to_end_on_a_tiny_detr(detr_dir):
    rows = [p for p in prompts.load("compositional/test") if p.metadata["tag"] in ("position", "color_attr")][:2]
    from flowrl.rewards.scoring import texts_and_metadata

    texts, metadata = texts_and_metadata(rows)
    for mode in ("geneval", "partial"):
        reward = rewards.get("geneval", detector=str(detr_dir), mode=mode, threshold=0.0, counting_threshold=0.0)
        scores = reward(torch.rand(2, 3, 40, 48), texts, **metadata)
        assert scores.shape == (2,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    with pytest.raises(rewards.RewardWeightsError):
        rewards.get("geneval", detector=str(detr_dir / "missing"))


def test_zero_shot_owlvit_adapter(tmp_path):
    from transformers import OwlViTConfig, OwlViTForObjectDetection, OwlViTImageProcessor, OwlViTProcessor

    from flowrl.models.tiny import tiny_clip_tokenizer

    tok = tiny_clip_tokenizer()
    text = dict(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=77,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        hidden_size=16, intermediate_size=16, num_attention_heads=2, num_hidden_layers=1, image_size=32, patch_size=8
    )
    torch.manual_seed(0)
    OwlViTForObjectDetection(OwlViTConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(
        tmp_path
    )
    size = {"height": 32, "width": 32}
    OwlViTProcessor(image_processor=OwlViTImageProcessor(size=size, crop_size=size), tokenizer=tok).save_pretrained(
        tmp_path
    )
    detector = TransformersDetector(str(tmp_path))
    assert detector.zero_shot  # queried with the 80 COCO class names
    out = detector([np.zeros((40, 48, 3), dtype=np.uint8)])
    assert len(out) == 1 and all(isinstance(d, Detection) and d.label in COCO_CLASSES for d in out[0])
