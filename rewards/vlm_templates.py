"""The VLM judges' prompt templates (`flowrl.rewards.vlm_judges`): the named question texts with their score
patterns (`TEMPLATES`), and how a template is chosen and filled in.
"""

from __future__ import annotations

import re
from typing import Any


FINAL_SCORE = r"Final Score:\s*([1-5](?:\.\d+)?)"
"""Flow-GRPO's / DiffusionNFT's UnifiedReward pattern (its first match is read)."""

_UNIFIEDREWARD = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n"
    "1. Alignment with the Caption: Assess how well this image aligns with the provided caption. Consider the "
    "accuracy of depicted objects, their relationships, and attributes as described in the caption.\n"
    "2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail preservation, "
    "color accuracy, and overall aesthetic appeal.\n"
    "Based on the above criteria, assign a score from 1 to 5 after 'Final Score:'.\n"
    "Your task is provided as follows:\n"
    "Text Caption: [{prompt}]"
)
_UNIFIEDREWARD_DIMENSIONS = (
    "You are presented with a generated image and its associated text caption. Your task is to analyze the image "
    "across multiple dimensions in relation to the caption. Specifically:\n"
    "Provide overall assessments for the image along the following axes (each rated from 1 to 5):\n"
    "- Alignment Score: How well the image matches the caption in terms of content.\n"
    "- Coherence Score: How logically consistent the image is (absence of visual glitches, object distortions, "
    "etc.).\n"
    "- Style Score: How aesthetically appealing the image looks, regardless of caption accuracy.\n\n"
    "Output your evaluation using the format below:\n\n"
    "Alignment Score (1-5): X\n"
    "Coherence Score (1-5): Y\n"
    "Style Score (1-5): Z\n\n"
    "Your task is provided as follows:\n"
    "Text Caption: [{prompt}]"
)
_FLOW_FACTORY_QUALITY = (
    "You are an expert image quality assessor. Evaluate this AI-generated image by considering ALL of the following "
    "criteria:\n"
    "1. Naturalness: Does the scene look realistic with correct perspective, shadows, and lighting?\n"
    "2. Artifacts: Is the image free from distortions, blurriness, watermarks, deformed faces, unusual body parts, or "
    "unharmonized subjects?\n"
    "3. Aesthetic Appeal: Does the image exhibit pleasing composition, color harmony, and visual balance?\n"
    "4. Detail & Clarity: Are textures, edges, and fine details rendered sharply and coherently without noise or "
    "smearing?\n"
    "5. Overall Coherence: Is the image semantically consistent, with all elements logically fitting together in a "
    "unified scene?\n\n"
    "Considering all the above criteria holistically, is this a high-quality image? Answer Yes or No."
)
_EDIT_CRITERIA = (
    'The last image is the result of editing the image before it (the source) with the instruction: "{prompt}".\n'
    "Evaluate the edit on two criteria:\n"
    "1. Instruction following: the requested change is made, completely and correctly.\n"
    "2. Preservation: everything the instruction does not ask to change (subjects, identity, layout, background, "
    "style) stays as in the source, and the result looks natural, without artifacts.\n"
)
_VIDEO_CRITERIA = (
    "You are given {frames} frames sampled evenly, in order, from a video generated from the text caption: "
    '"{prompt}".\nEvaluate the video on: alignment with the caption; visual quality of the frames; temporal '
    "coherence (smooth, consistent motion and identities across frames).\n"
)
_I2V_CRITERIA = (
    "The first image is the start frame a video was generated from; the next {frames} images are frames sampled "
    'evenly, in order, from that video, generated with the text caption: "{prompt}".\nEvaluate the video on: '
    "fidelity to the start frame (the video begins from it and keeps its subjects, identities, layout and style); "
    "alignment with the caption (the motion and events it asks for happen); visual quality of the frames; temporal "
    "coherence (smooth, consistent motion across frames).\n"
)
_PAIRWISE = (
    "You are given a text caption and two {item}s generated from it: {item_cap} 1 is shown first, {item_cap} 2 second."
    "{frames_note}\nThe caption is: \u300c{prompt}\u300d\n"
    "Compare the two {item}s on: semantic consistency with the caption; visual quality and aesthetics; authenticity "
    "(realism and detail){video_note}. Reason briefly inside <think> and </think>, then give the final judgment "
    'inside <answer> and </answer>, containing only "{item_cap} 1 is better" or "{item_cap} 2 is better".'
)

TEMPLATES: dict[str, tuple[str, str | None]] = {
    "unifiedreward": (_UNIFIEDREWARD, FINAL_SCORE),
    "unifiedreward_alignment": (_UNIFIEDREWARD_DIMENSIONS, r"Alignment Score \(1-5\):\s*([0-5](?:\.\d+)?)"),
    "unifiedreward_coherence": (_UNIFIEDREWARD_DIMENSIONS, r"Coherence Score \(1-5\):\s*([0-5](?:\.\d+)?)"),
    "unifiedreward_style": (_UNIFIEDREWARD_DIMENSIONS, r"Style Score \(1-5\):\s*([0-5](?:\.\d+)?)"),
    "alignment": (
        'Does this image faithfully show the text caption "{prompt}", as a natural, good-quality image '
        "without visible artifacts? Answer Yes or No.",
        None,
    ),
    "quality": (_FLOW_FACTORY_QUALITY, None),
    "edit": (_EDIT_CRITERIA + "Based on both criteria, assign a score from 1 to 5 after 'Final Score:'.", FINAL_SCORE),
    "edit_yes_no": (_EDIT_CRITERIA + "Does the edit meet both criteria? Answer Yes or No.", None),
    "video": (_VIDEO_CRITERIA + "Based on the above, assign a score from 1 to 5 after 'Final Score:'.", FINAL_SCORE),
    "video_yes_no": (_VIDEO_CRITERIA + "Is this a good video for the caption on all three? Answer Yes or No.", None),
    "i2v": (_I2V_CRITERIA + "Based on the above, assign a score from 1 to 5 after 'Final Score:'.", FINAL_SCORE),
    "i2v_yes_no": (
        _I2V_CRITERIA + "Is this a good video for its start frame and caption on all four? Answer Yes or No.",
        None,
    ),
    "pairwise": (_PAIRWISE, None),
}
"""Named prompt templates (`template=` takes a name or your own text): `(text, score pattern)`. `{prompt}` is replaced
by the sample's prompt (`{frames}`: frames per video). `unifiedreward` is Flow-GRPO's / DiffusionNFT's UnifiedReward
text without its first line, a literal `<image>` that servers placing the image from the `image_url` part (vLLM,
`transformers serve`) would count as a second image; `unifiedreward_*` are Pref-GRPO's dimension scores; `quality`
is Flow-Factory's `vllm_evaluate` question (it does not read the prompt); the others are flowrl's."""


def _template(template: str | None, default: str) -> tuple[str, str | None]:
    name = default if template is None else template
    if name in TEMPLATES:
        return TEMPLATES[name]
    if re.fullmatch(r"\w+", name):
        raise ValueError(f"unknown template {name!r}; give your own text or one of {', '.join(TEMPLATES)}")
    return name, None


def _fill(template: str, **values: Any) -> str:
    for key, value in values.items():  # no str.format: templates may hold other braces (JSON examples)
        template = template.replace("{" + key + "}", str(value))
    return template
