"""VLM judges as rewards: a vision-language model served over an OpenAI-compatible API (`flowrl.rewards.vlm`) reads
each image (or edit, or video, or pair of samples) and answers a question whose answer becomes the score.

- `vlm_score` (pointwise, as Flow-GRPO / DiffusionNFT ask UnifiedReward): the number after `Final Score:` (1-5, the
  first match of `Final Score:\\s*([1-5](?:\\.\\d+)?)`), divided by 5 (`scale: fraction`, Flow-GRPO's).
- `vlm_yes_no` (Flow-Factory's `vllm_evaluate`): `P(yes) / (P(yes) + P(no))` from the log-probabilities of the first
  generated token, summed over its case and space variants (`yes`, ` Yes`, `YES`, ...).
- `vlm_pairwise` (Pref-GRPO): each sample's win rate against the other samples of its prompt, from "Image 1/2 is
  better" verdicts on every pair of the group.
- `vlm_edit` (source and result images, instruction followed and source preserved) and `vlm_video` (evenly spaced
  frames), with either answer.

An answer that cannot be read scores NaN (the trainer drops and counts NaN samples) and is counted in `unparsable`
(`on_unparsable: nan | error | <number>`; never a silent 0). `pop_metrics()` returns the counters of the judge's
client (requests, cache hits, retries, unparsable, failures) since its last call; `Rewards.check` logs them as
`reward/<name>/<counter>` every epoch.

The question texts are in `flowrl.rewards.vlm_templates`, the answer parsers in `flowrl.rewards.vlm_answers`, the
judges here; this module re-exports the public names of both.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from flowrl.rewards import RewardError, register
from flowrl.rewards.base import Reward
from flowrl.rewards.pairwise import PairwiseWinRate
from flowrl.rewards.video import frame_indices
from flowrl.rewards.vlm import Answer, JudgeClient, Question, to_pixels
from flowrl.rewards.vlm_answers import (
    ANSWERS,
    SCALES,
    parse_preference,
    parse_score,
    scale_score,
    win_rates_of_read,
    yes_no_text,
    yes_probability,
)
from flowrl.rewards.vlm_templates import FINAL_SCORE, TEMPLATES, _fill, _template


def _unparsable_policy(value) -> str | float:
    if isinstance(value, str) and value in ("nan", "error"):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"on_unparsable must be 'nan', 'error' or a number, got {value!r}")


def _client(name: str, url: str, model: str, client_kwargs: dict[str, Any]) -> JudgeClient:
    unknown = set(client_kwargs) - {
        "api_key",
        "max_concurrency",
        "timeout",
        "retries",
        "backoff",
        "max_backoff",
        "cache_size",
        "cache_dir",
        "request",
        "transport",
    }
    if unknown:
        raise TypeError(f"reward {name!r} got unexpected arguments {sorted(unknown)}")
    return JudgeClient(url, model, name=f"VLM judge {name!r}", **client_kwargs)


class _Unparsable:
    """The unparsable-answer policy: counts every unreadable answer, then NaN, an error, or a fixed value."""

    def __init__(self, policy, client: JudgeClient):
        self.policy, self.client = _unparsable_policy(policy), client

    def __call__(self, value: float | None, answer: Answer, prompt: str) -> float:
        if value is not None:
            return value
        self.client.count("unparsable")
        if self.policy == "error":
            raise RewardError(
                f"{self.client.name} at {self.client.url}: cannot read the answer "
                f"{' '.join(answer.text.split())[:120]!r} (prompt {prompt[:60]!r}); set "
                "on_unparsable: nan to drop such samples"
            )
        return math.nan if self.policy == "nan" else float(self.policy)


# ----- pointwise judges -----


class VlmJudge(Reward):
    """A pointwise VLM judge (the base of `vlm_score`, `vlm_yes_no`, `vlm_edit`, `vlm_video`; needs: a server).

    Each sample is one question (its images, then the template with `{prompt}` filled in), asked through a
    `JudgeClient`; its answer is read as a score (`answer="score"`) or as P(yes) (`answer="yes_no"`).

    Args:
        url (`str`): the OpenAI-compatible server (`http://HOST:PORT`, a base URL ending in `/v1`, or the full
            chat-completions URL).
        model (`str`): the served model's name.
        answer (`str`, defaults to `"score"`): `"score"` (a number in the text, `score_pattern`) or `"yes_no"`.
        template (`str`, *optional*): a name of `TEMPLATES` or your own text (`{prompt}` is replaced by the prompt);
            default: the judge's own.
        system (`str`, *optional*): a system message sent before the question.
        image_size (`int`, *optional*): resize every image to `image_size x image_size` before sending (Flow-GRPO
            sends 512 x 512); default: as they are.
        on_unparsable (`str` or `float`, defaults to `"nan"`): an answer that cannot be read scores NaN (dropped and
            counted by the trainer), raises (`"error"`), or scores this number; always counted in `unparsable`.
        max_tokens (`int`, *optional*): the answer's length limit (default: 512 for scores, 1 for yes/no with
            logprobs, 8 for yes/no read from the text).
        temperature (`float`, defaults to 0): sampling temperature (0: greedy, as every peer).
        score_pattern (`str`, *optional*): a regex whose group 1 is the score; default: the template's
            (`Final Score:\\s*([1-5](?:\\.\\d+)?)`, Flow-GRPO's, for your own text).
        score_range (`tuple[float, float]`, defaults to `(1, 5)`): the valid scores; others are unparsable.
        scale (`str`, defaults to `"fraction"`): `fraction` `x / high` (Flow-GRPO's `score / 5`), `unit`
            `(x - low) / (high - low)`, or `raw` (Pref-GRPO's pointwise scores).
        logprobs (`bool`, defaults to `True`): yes/no: P(yes) from the first token's log-probabilities (the server
            must return `logprobs`; vLLM and SGLang do, `transformers serve` does not); `False` reads the text
            (yes 1, no 0).
        top_logprobs (`int`, defaults to 20): yes/no: candidates asked for (vLLM allows at most its
            `--max-logprobs`, 20 by default).
        canonicalize (`bool`, defaults to `True`): yes/no: sum the case and space variants of yes / no (`False`:
            only the tokens `Yes` and `No`, Flow-Factory's default).
        batch_size (`int`, defaults to 64): samples per call of `score` (their questions are asked concurrently).
        **client: `JudgeClient` arguments: `api_key` (default `$FLOWRL_JUDGE_API_KEY`), `max_concurrency` (8),
            `timeout` (60 s), `retries` (3), `backoff` (1 s), `max_backoff` (30 s), `cache_size` (4096), `cache_dir`,
            `request` (extra request fields).
    """

    name = "vlm_judge"
    default_template = {"score": "unifiedreward", "yes_no": "alignment"}

    def __init__(
        self,
        url: str,
        model: str,
        *,
        answer: str = "score",
        template: str | None = None,
        system: str | None = None,
        image_size: int | None = None,
        on_unparsable: str | float = "nan",
        max_tokens: int | None = None,
        temperature: float = 0.0,
        score_pattern: str | None = None,
        score_range: tuple[float, float] = (1, 5),
        scale: str = "fraction",
        logprobs: bool = True,
        top_logprobs: int = 20,
        canonicalize: bool = True,
        batch_size: int = 64,
        **client: Any,
    ):
        super().__init__(device="cpu", batch_size=batch_size)
        if answer not in ANSWERS:
            raise ValueError(f"reward {self.name!r}: answer must be one of {', '.join(ANSWERS)}, got {answer!r}")
        if scale not in SCALES:
            raise ValueError(f"reward {self.name!r}: scale must be one of {', '.join(SCALES)}, got {scale!r}")
        low, high = score_range
        if not low < high or (scale == "fraction" and high == 0):
            raise ValueError(f"reward {self.name!r}: score_range must be (low, high), low < high; got {score_range}")
        if image_size is not None and image_size < 1:
            raise ValueError(f"reward {self.name!r}: image_size must be >= 1, got {image_size}")
        self.answer, self.system, self.image_size = answer, system, image_size
        self.template, pattern = _template(template, self.default_template[answer])
        self.score_pattern = score_pattern or pattern or FINAL_SCORE
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as err:
            raise ValueError(f"reward {self.name!r}: score_pattern {self.score_pattern!r}: {err}") from None
        if groups < 1:
            raise ValueError(f"reward {self.name!r}: score_pattern needs a group around the number: 'Score: (\\d)'")
        self.score_range, self.scale = (float(low), float(high)), scale
        self.logprobs, self.canonicalize = bool(logprobs), bool(canonicalize)
        if answer == "yes_no" and self.logprobs and top_logprobs < 1:
            raise ValueError(f"reward {self.name!r}: top_logprobs must be >= 1, got {top_logprobs}")
        default_tokens = 512 if answer == "score" else 1 if self.logprobs else 8
        self.fields: dict[str, Any] = {
            "temperature": float(temperature),
            "max_tokens": int(max_tokens or default_tokens),
        }
        if answer == "yes_no" and self.logprobs:
            self.fields.update(logprobs=True, top_logprobs=int(top_logprobs))
        self.client = _client(self.name, url, model, client)
        self.unparsable = _Unparsable(on_unparsable, self.client)

    def pop_metrics(self) -> dict[str, float]:
        """The client's counters since the last call (`requests`, `cache_hits`, `retries`, `unparsable`,
        `failures`)."""
        return self.client.pop_metrics()

    def close(self) -> None:
        """Close the client's connections and threads."""
        self.client.close()

    def pixels(self, image: torch.Tensor):
        return to_pixels(image, self.image_size)

    def questions(self, images: torch.Tensor, prompts: list[str], **metadata) -> list[Question]:
        """One question per sample: its images and the filled-in template."""
        return [
            Question((self.pixels(image),), _fill(self.template, prompt=p), self.system)
            for image, p in zip(images, prompts)
        ]

    def read(self, answer: Answer) -> float | None:
        """The score in an answer, or None when it cannot be read."""
        if self.answer == "score":
            value = parse_score(answer.text, self.score_pattern, self.score_range)
            return None if value is None else scale_score(value, self.score_range, self.scale)
        if not self.logprobs:
            return yes_no_text(answer.text)
        if answer.first_token is None:
            raise RewardError(
                f"{self.client.name} at {self.client.url} answered without logprobs (the server must "
                "support `logprobs` / `top_logprobs`, as vLLM and SGLang do); set logprobs: false to "
                "read yes/no from the text"
            )
        return yes_probability(answer.first_token, self.canonicalize)

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        answers = self.client.ask(self.questions(images, prompts, **metadata), self.fields)
        return torch.tensor(
            [self.unparsable(self.read(a), a, p) for a, p in zip(answers, prompts)], dtype=torch.float32
        )


@register("vlm_score")
class VlmScore(VlmJudge):
    """A VLM judge's 1-5 score of image and prompt, UnifiedReward's, over 5 (needs: an OpenAI-compatible server).

    Flow-GRPO's / DiffusionNFT's `unifiedreward` scorer: the image, then `TEMPLATES["unifiedreward"]`; the first
    match of `Final Score:\\s*([1-5](?:\\.\\d+)?)` divided by 5 (`scale`), so in [0.2, 1]. Where they score 0 for an
    answer without a score, this scores NaN (`on_unparsable`). Arguments: those of `VlmJudge` but `answer`.
    """

    def __init__(self, url: str, model: str, **kwargs: Any):
        super().__init__(url, model, answer="score", **kwargs)


@register("vlm_yes_no")
class VlmYesNo(VlmJudge):
    """A VLM judge's P(yes) for image and prompt, from logprobs (needs: an OpenAI-compatible server with logprobs).

    Flow-Factory's `vllm_evaluate`: one generated token (`max_tokens: 1`, `logprobs`, `top_logprobs: 20`), score
    `P(yes) / (P(yes) + P(no))` over its candidates (`yes_probability`), in [0, 1]; NaN when neither appears (they
    score 0). The default question (`TEMPLATES["alignment"]`) reads the prompt; `template: quality` is Flow-Factory's
    own (it does not). Arguments: those of `VlmJudge` but `answer`.
    """

    def __init__(self, url: str, model: str, **kwargs: Any):
        super().__init__(url, model, answer="yes_no", **kwargs)


@register("vlm_edit")
class VlmEdit(VlmJudge):
    """Editing: a VLM judges the result against source and instruction (needs: an OpenAI-compatible server).

    Sends each sample's source images, then its result, then `TEMPLATES["edit"]` (a 1-5 score after `Final Score:`,
    divided by 5) or, with `answer: yes_no`, `TEMPLATES["edit_yes_no"]`. Arguments: those of `VlmJudge`.
    """

    needs_source_images = True
    default_template = {"score": "edit", "yes_no": "edit_yes_no"}

    def questions(self, images, prompts, source_images=None, **metadata) -> list[Question]:
        if source_images is None:
            raise ValueError(
                f"reward {self.name!r} compares edits with their source images: use an editing prompt "
                "set (rows with `image`) on an editing model"
            )
        return [
            Question(
                (*(self.pixels(s) for s in sources), self.pixels(image)), _fill(self.template, prompt=p), self.system
            )
            for image, sources, p in zip(images, source_images, prompts)
        ]


@register("vlm_video")
class VlmVideo(VlmJudge):
    """Videos: a VLM judges evenly spaced frames with the prompt (needs: an OpenAI-compatible multi-image server).

    Sends the frames (`flowrl.rewards.video.frame_indices`, first and last included) in order, then
    `TEMPLATES["video"]` (1-5 after `Final Score:`, divided by 5) or `TEMPLATES["video_yes_no"]`; `{frames}` in a
    template is the number of frames. Arguments: `frames` (8, as Pref-GRPO) and those of `VlmJudge`.
    """

    video = True
    default_template = {"score": "video", "yes_no": "video_yes_no"}

    def __init__(self, url: str, model: str, frames: int = 8, **kwargs: Any):
        if frames < 1:
            raise ValueError(f"reward 'vlm_video': frames must be >= 1, got {frames}")
        super().__init__(url, model, **kwargs)
        self.frames = int(frames)

    def questions(self, images, prompts, **metadata) -> list[Question]:
        index = frame_indices(images.shape[2], self.frames)
        return [
            Question(
                tuple(self.pixels(video[:, f]) for f in index.tolist()),
                _fill(self.template, prompt=p, frames=len(index)),
                self.system,
            )
            for video, p in zip(images, prompts)
        ]


# ----- pairwise -----


@register("vlm_pairwise")
class VlmPairwise(PairwiseWinRate):
    """Pref-GRPO's in-group win rates from a VLM judging every pair (needs: an OpenAI-compatible multi-image server).

    Samples are grouped by prompt text within one call (as `pairwise_winrate`; keep `sampling.reward_overlap: 1`).
    For every pair i < j of a group the judge sees sample i, then sample j (videos: `frames` frames of each), then
    the template, and answers "Image 1 is better" or "Image 2 is better" (`parse_preference`, inside
    `<answer>...</answer>` as Pref-GRPO's UnifiedReward-Think does). `w_i = mean over read verdicts of [i won]`: a
    group of G costs G(G-1)/2 requests (twice that with `both_orders`, which averages both orders to cancel the
    judge's position bias). An unread verdict is left out of both samples' rates (`on_unparsable: nan`; a sample
    with no verdict left scores NaN), or counts as P(first better) = that number (`0.5`: Pref-GRPO's tie), or raises.

    Args:
        url (`str`), model (`str`): the server and the served model, as `VlmJudge`.
        both_orders (`bool`, defaults to `False`): ask every pair in both orders.
        template (`str`, *optional*): a name of `TEMPLATES` or your own text (`{prompt}`; `{item}` / `{item_cap}`
            are `image` / `Image` or `video` / `Video`); default `pairwise`.
        frames (`int`, defaults to 8): frames per video for videos `[B, 3, F, H, W]`.
        system (`str`, *optional*), image_size (`int`, *optional*), on_unparsable (`str` or `float`, defaults to
            `"nan"`), temperature (`float`, defaults to 0): as `VlmJudge`.
        max_tokens (`int`, defaults to 1024): the answer's length limit (room for the reasoning before the verdict).
        **client: `JudgeClient` arguments, as `VlmJudge`.
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        both_orders: bool = False,
        template: str | None = None,
        frames: int = 8,
        system: str | None = None,
        image_size: int | None = None,
        on_unparsable: str | float = "nan",
        max_tokens: int = 1024,
        temperature: float = 0.0,
        **client: Any,
    ):
        if frames < 1 or (image_size is not None and image_size < 1):
            raise ValueError(f"reward 'vlm_pairwise': frames and image_size must be >= 1, got {frames}, {image_size}")
        self.both_orders, self.scorer, self.tie_margin = both_orders, None, 0.0
        self.template, _ = _template(template, "pairwise")
        self.frames, self.system, self.image_size = int(frames), system, image_size
        self.fields = {"temperature": float(temperature), "max_tokens": int(max_tokens)}
        self.client = _client(self.name, url, model, client)
        self.unparsable = _Unparsable(on_unparsable, self.client)
        self.judge = None

    def pop_metrics(self) -> dict[str, float]:
        """The client's counters since the last call, as `VlmJudge.pop_metrics`."""
        return self.client.pop_metrics()

    def close(self) -> None:
        """Close the client's connections and threads."""
        self.client.close()

    def _sample_pixels(self, sample: torch.Tensor) -> tuple:
        if sample.ndim == 4:  # a video [3, F, H, W]
            return tuple(
                to_pixels(sample[:, f], self.image_size) for f in frame_indices(sample.shape[1], self.frames).tolist()
            )
        return (to_pixels(sample, self.image_size),)

    def __call__(self, images: torch.Tensor, prompts, **metadata) -> torch.Tensor:
        prompts = [str(p) for p in prompts]
        if images.ndim not in (4, 5) or images.shape[1] != 3:
            raise ValueError(
                f"reward {self.name!r} needs images [B, 3, H, W] or videos [B, 3, F, H, W] in [0, 1]; "
                f"got {tuple(images.shape)}"
            )
        if len(prompts) != images.shape[0]:
            raise ValueError(f"reward {self.name!r} got {images.shape[0]} images but {len(prompts)} prompts")
        first, second, sizes = self.pairs(prompts)
        pairs = list(zip(first.tolist(), second.tolist()))
        if self.both_orders:
            pairs += [(j, i) for i, j in pairs]
        video = images.ndim == 5
        pixels = {i: self._sample_pixels(images[i]) for i in sorted({k for pair in pairs for k in pair})}
        n_frames = len(pixels[first[0].item()]) if video and pairs else 1
        note = f" Each video is {n_frames} frames in order: those of Video 1, then those of Video 2." if video else ""
        item = "video" if video else "image"
        text = _fill(
            self.template,
            item=item,
            item_cap=item.capitalize(),
            frames=n_frames,
            frames_note=note,
            video_note="; temporal coherence" if video else "",
        )
        questions = [Question(pixels[i] + pixels[j], _fill(text, prompt=prompts[i]), self.system) for i, j in pairs]
        answers = self.client.ask(questions, self.fields)
        p = torch.tensor(
            [self.unparsable(parse_preference(a.text), a, prompts[i]) for a, (i, _) in zip(answers, pairs)],
            dtype=torch.float64,
        )
        if self.both_orders:
            n = first.numel()
            p = torch.stack([p[:n], 1 - p[n:]]).nanmean(0)  # NaN only when neither order was read
        return win_rates_of_read(first, second, p, sizes)


__all__ = [
    "ANSWERS",
    "FINAL_SCORE",
    "SCALES",
    "TEMPLATES",
    "VlmEdit",
    "VlmJudge",
    "VlmPairwise",
    "VlmScore",
    "VlmVideo",
    "VlmYesNo",
    "parse_preference",
    "parse_score",
    "scale_score",
    "win_rates_of_read",
    "yes_no_text",
    "yes_probability",
]
