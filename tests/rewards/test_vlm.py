"""VLM judges over an OpenAI-compatible API (`rewards/vlm.py`, `rewards/vlm_judges.py`).

The parsing, the win rates, the retry policy and the message layout are checked at unit level (strings and in-process
transports, fast). The `distributed` tests start a real server, `transformers serve`, on loopback serving tiny random
LLaVA models built offline in the fixture; their answers are random text (and, for a second model whose logits are
all zero, always "yes"), which exercises the unparsable path, the cache, the concurrency limit and the 5xx / 4xx
paths against the real thing. `transformers serve` ignores `logprobs`, so the log-probability yes/no score is checked
on OpenAI-format answers at unit level.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from flowrl import rewards
from flowrl.rewards import RewardError
from flowrl.rewards.pairwise import win_rates
from flowrl.rewards.scoring import Rewards
from flowrl.rewards.vlm import Answer, JudgeClient, Question, chat_url, to_pixels
from flowrl.rewards.vlm_judges import (
    FINAL_SCORE,
    TEMPLATES,
    parse_preference,
    parse_score,
    scale_score,
    win_rates_of_read,
    yes_no_text,
    yes_probability,
)
from flowrl.runtime import Processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _images(n: int, size: int = 8) -> torch.Tensor:
    """`n` distinct flat images: image i has value i / 10 (a judge can read the index back from the pixels)."""
    return torch.arange(n, dtype=torch.float32).div(10).view(n, 1, 1, 1).expand(n, 3, size, size).clone()


def _decode(url: str) -> np.ndarray:
    assert url.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))


def _chat(content: str, logprobs: dict | None = None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {"id": "x", "object": "chat.completion", "model": "m", "choices": [choice]}


class Transport(httpx.MockTransport):
    """An in-process transport for the client's unit tests: `answer(request_body) -> httpx.Response`, and a count."""

    def __init__(self, answer):
        self.bodies = []

        def handler(request):
            body = json.loads(request.content)
            self.bodies.append(body)
            return answer(body)

        super().__init__(handler)


# ----- parsing -----


def test_the_unifiedreward_score_is_the_first_final_score_divided_by_five():
    assert parse_score("The image is sharp. Final Score: 4") == 4.0
    assert parse_score("Final Score:3.5\nFinal Score: 5") == 3.5  # the first match, as Flow-GRPO
    assert parse_score("Final Score: 7") is None and parse_score("a score of 4") is None
    assert parse_score("final score: 4") is None  # the peers' regex is case-sensitive
    assert parse_score("Final Score: 9", r"Final Score:\s*(\d+)", (1, 10)) == 9.0
    assert parse_score("Final Score: 11", r"Final Score:\s*(\d+)", (1, 10)) is None  # outside the range
    pattern = TEMPLATES["unifiedreward_coherence"][1]
    text = "Alignment Score (1-5): 4\nCoherence Score (1-5): 2.5\nStyle Score (1-5): 5"
    assert parse_score(text, pattern) == 2.5
    assert scale_score(4.0) == 0.8 and scale_score(1.0) == 0.2  # Flow-GRPO: score / 5
    assert scale_score(4.0, scale="unit") == 0.75 and scale_score(4.0, scale="raw") == 4.0
    with pytest.raises(ValueError, match="scale must be one of"):
        scale_score(4.0, scale="z")


def test_p_yes_is_normalised_over_yes_and_no_and_their_variants():
    lp_yes, lp_no = math.log(0.6), math.log(0.2)
    exact = [("Yes", lp_yes), ("Yes", lp_yes), ("No", lp_no), (" yes", math.log(0.1)), ("Maybe", math.log(0.05))]
    assert yes_probability(exact, canonicalize=False) == pytest.approx(0.6 / 0.8)  # Flow-Factory's default
    assert yes_probability(exact) == pytest.approx(0.7 / 0.9)  # the token itself is not counted twice
    assert yes_probability([("\u2581YES", -0.1), ("NO ", -2.0), ("no", -3.0)]) == pytest.approx(
        math.exp(-0.1) / (math.exp(-0.1) + math.exp(-2.0) + math.exp(-3.0))
    )
    assert yes_probability([("yes", -800.0), ("no", -801.0)]) == pytest.approx(1 / (1 + math.exp(-1)))  # log space
    assert yes_probability([("Yes", -0.5), ("Sure", -1.0)]) == 1.0
    assert yes_probability([("No", -0.5)]) == 0.0
    assert yes_probability([("Sure", -0.1), ("Maybe", -2.0)]) is None
    assert yes_probability([("yes", -0.1)], canonicalize=False) is None
    assert [yes_no_text(t) for t in ["Yes.", " no, it is not", "**YES**", "Maybe yes", ""]] == [
        1.0,
        0.0,
        1.0,
        None,
        None,
    ]


def test_a_pairwise_verdict_is_read_inside_the_answer_tags():
    think = "<think>Image 1 (9/10) ... Image 2 (7/10)</think>\n<answer>Image 1 is better</answer>"
    assert parse_preference(think) == 1.0
    assert parse_preference("<answer> image 2 is better </answer>") == 0.0
    assert parse_preference("I think Video 2 is better.") == 0.0  # no tags: the whole text
    assert parse_preference("Image 1 is better or Image 2 is better") is None  # both: no verdict
    assert parse_preference("<think>Image 2 is better</think><answer>Image 1 is better</answer>") == 1.0
    assert parse_preference("They are equally good.") is None


def test_answers_are_read_from_openai_chat_completions():
    top = [{"token": "Yes", "logprob": -0.2}, {"token": "No", "logprob": -1.8}, {"token": " yes", "logprob": -4.0}]
    data = _chat("Yes", {"content": [{"token": "Yes", "logprob": -0.2, "top_logprobs": top}]})
    answer = Answer.from_response(data)
    assert answer.text == "Yes" and answer.first_token[0] == ("Yes", -0.2) and len(answer.first_token) == 4
    assert Answer.from_json(json.loads(json.dumps(answer.to_json()))) == answer
    assert Answer.from_response(_chat("Final Score: 4")) == Answer("Final Score: 4", None)
    assert Answer.from_response(_chat(None)).text == ""
    with pytest.raises(ValueError, match=r"the answer has no choices\[0\].message: \{\"error\": \"x\"\}"):
        Answer.from_response({"error": "x"})


def test_chat_urls():
    assert chat_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1/chat/completions"
    assert chat_url("localhost:8000/") == "http://localhost:8000/v1/chat/completions"
    assert chat_url("https://api.example.com/v1") == "https://api.example.com/v1/chat/completions"
    assert chat_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError, match="judge URL"):
        chat_url("ftp://h:1")


def test_images_go_first_as_lossless_pngs_then_the_text():
    image = torch.rand(3, 5, 7, generator=torch.Generator().manual_seed(0))
    pixels = to_pixels(image)
    messages = Question((pixels, to_pixels(image, size=4)), "Is it red?", system="Be brief.").messages()
    assert messages[0] == {"role": "system", "content": "Be brief."}
    content = messages[1]["content"]
    assert [c["type"] for c in content] == ["image_url", "image_url", "text"] and content[2]["text"] == "Is it red?"
    assert np.array_equal(_decode(content[0]["image_url"]["url"]), pixels)
    assert np.array_equal(pixels, (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())
    assert _decode(content[1]["image_url"]["url"]).shape == (4, 4, 3)


def test_templates_names_and_own_text():
    judge = rewards.get("vlm_score", url="http://127.0.0.1:1", model="m")
    assert judge.template == TEMPLATES["unifiedreward"][0] and judge.score_pattern == FINAL_SCORE
    assert "<image>" not in judge.template  # the image travels as an image_url part
    question = judge.questions(_images(1), ["a red dog"])[0]
    assert question.text.endswith("Text Caption: [a red dog]") and len(question.images) == 1
    own = rewards.get("vlm_score", url="http://127.0.0.1:1", model="m", template="Rate {prompt} {json: 1}")
    assert own.questions(_images(1), ["x"])[0].text == "Rate x {json: 1}"
    with pytest.raises(ValueError, match="unknown template 'unifiedreward_alignmnt'"):
        rewards.get("vlm_score", url="http://127.0.0.1:1", model="m", template="unifiedreward_alignmnt")
    with pytest.raises(ValueError, match="on_unparsable must be"):
        rewards.get("vlm_score", url="http://127.0.0.1:1", model="m", on_unparsable="zero")
    with pytest.raises(ValueError, match="score_pattern needs a group"):
        rewards.get("vlm_score", url="http://127.0.0.1:1", model="m", score_pattern=r"Score: \d")
    with pytest.raises(TypeError, match="unexpected arguments"):
        rewards.get("vlm_pairwise", url="http://127.0.0.1:1", model="m", retry=3)
    yes_no = rewards.get("vlm_yes_no", url="http://127.0.0.1:1", model="m")
    assert yes_no.fields == {"temperature": 0.0, "max_tokens": 1, "logprobs": True, "top_logprobs": 20}


def test_edit_and_video_judges_send_the_sources_then_the_result_and_evenly_spaced_frames():
    edit = rewards.get("vlm_edit", url="http://127.0.0.1:1", model="m")
    assert edit.needs_source_images
    sources = _images(4).view(2, 2, 3, 8, 8)  # two samples, two source images each
    results = _images(2) + 0.5
    questions = edit.questions(results, ["make it red", "add a hat"], source_images=sources)
    assert [len(q.images) for q in questions] == [3, 3]
    shown = [q.images[k] for q in questions for k in range(3)]
    expected = [sources[0, 0], sources[0, 1], results[0], sources[1, 0], sources[1, 1], results[1]]
    assert all(np.array_equal(a, to_pixels(b)) for a, b in zip(shown, expected))
    assert 'instruction: "add a hat"' in questions[1].text
    with pytest.raises(ValueError, match="source images"):
        edit.questions(results, ["x", "y"])
    video = rewards.get("vlm_video", url="http://127.0.0.1:1", model="m", frames=3, image_size=4)
    clips = _images(10).view(2, 5, 3, 8, 8).transpose(1, 2)  # frame f of video b is image 5 b + f
    question = video.questions(clips, ["a cat runs", "a dog"])[1]
    frames = [to_pixels(clips[1, :, f], size=4) for f in (0, 2, 4)]  # first, middle and last of the second video
    assert all(np.array_equal(a, b) for a, b in zip(question.images, frames))
    assert question.images[0].shape == (4, 4, 3) and question.text.startswith("You are given 3 frames")


def test_unparsable_answers_are_nan_an_error_or_a_number_and_counted():
    for policy, expected in [("nan", math.nan), (0.25, 0.25)]:
        transport = Transport(lambda body: httpx.Response(200, json=_chat("no score here")))
        judge = rewards.get("vlm_score", url="http://h:1", model="m", on_unparsable=policy, transport=transport)
        scores = judge(_images(2), ["a", "b"])
        assert torch.equal(scores.isnan(), torch.tensor([math.isnan(expected)] * 2))
        assert math.isnan(expected) or scores.tolist() == [expected] * 2
        assert judge.pop_metrics()["unparsable"] == 2
    judge = rewards.get(
        "vlm_score",
        url="http://127.0.0.1:1",
        model="m",
        on_unparsable="error",
        transport=Transport(lambda body: httpx.Response(200, json=_chat("I\ncannot"))),
    )
    with pytest.raises(RewardError, match=r"cannot read the answer 'I cannot' \(prompt 'a'\)"):
        judge(_images(1), ["a"])


def test_yes_no_without_logprobs_from_the_server_fails_in_one_line_or_reads_the_text():
    transport = Transport(lambda body: httpx.Response(200, json=_chat("Yes, it is.")))
    judge = rewards.get("vlm_yes_no", url="http://127.0.0.1:1", model="m", transport=transport)
    with pytest.raises(RewardError, match="answered without logprobs .* set logprobs: false"):
        judge(_images(1), ["a"])
    text = rewards.get("vlm_yes_no", url="http://127.0.0.1:1", model="m", logprobs=False, transport=transport)
    assert text(_images(1), ["a"]).tolist() == [1.0]
    assert "logprobs" not in transport.bodies[-1] and transport.bodies[-1]["max_tokens"] == 8


def test_yes_no_reads_the_first_tokens_logprobs():
    def answer(body):
        assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["max_tokens"] == 1
        top = [{"token": "Yes", "logprob": math.log(0.3)}, {"token": "No", "logprob": math.log(0.6)}]
        return httpx.Response(
            200, json=_chat("No", {"content": [{"token": "No", "logprob": math.log(0.6), "top_logprobs": top}]})
        )

    judge = rewards.get("vlm_yes_no", url="http://127.0.0.1:1", model="m", transport=Transport(answer))
    torch.testing.assert_close(judge(_images(2), ["a", "b"]), torch.full((2,), 1 / 3))


# ----- the client: retries, cache, errors -----


def test_429_and_5xx_are_retried_with_backoff_and_other_4xx_are_not():
    statuses = iter([429, 503, 200])
    transport = Transport(
        lambda body: httpx.Response(
            s := next(statuses), json=_chat("Final Score: 5") if s == 200 else {"error": {"message": "busy"}}
        )
    )
    judge = rewards.get("vlm_score", url="http://127.0.0.1:1", model="m", backoff=0.001, transport=transport)
    assert judge(_images(1), ["a"]).tolist() == [1.0]
    assert judge.pop_metrics() == {"requests": 1, "cache_hits": 0, "retries": 2, "unparsable": 0, "failures": 0}

    transport = Transport(lambda body: httpx.Response(404, json={"detail": "The model `m` does not exist."}))
    judge = rewards.get("vlm_score", url="http://127.0.0.1:1", model="m", backoff=0.001, transport=transport)
    with pytest.raises(
        RewardError,
        match=r"at http://127.0.0.1:1/v1/chat/completions refused the request \(404: "
        r"The model `m` does not exist.\)",
    ):
        judge(_images(1), ["a"])
    assert len(transport.bodies) == 1 and judge.pop_metrics()["failures"] == 1

    transport = Transport(lambda body: httpx.Response(200, json={"object": "error", "message": "bad image"}))
    judge = rewards.get("vlm_score", url="http://h:1", model="m", backoff=0, transport=transport)
    with pytest.raises(RewardError, match=r"^VLM judge 'vlm_score' at \S+: the answer has no choices\[0\].message"):
        judge(_images(1), ["a"])
    assert len(transport.bodies) == 1

    transport = Transport(lambda body: httpx.Response(500, text="Internal Server Error"))
    judge = rewards.get("vlm_score", url="http://127.0.0.1:1", model="m", retries=2, backoff=0, transport=transport)
    with pytest.raises(
        RewardError,
        match=r"^VLM judge 'vlm_score' at \S+ answered 500 \(Internal Server Error\) "
        r"after 3 tries; start the server or fix the url$",
    ):
        judge(_images(1), ["a"])


def test_the_api_key_comes_from_the_argument_or_the_environment(monkeypatch):
    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json=_chat("Final Score: 5"))

    monkeypatch.setenv("FLOWRL_JUDGE_API_KEY", "from-env")
    for kwargs in [{}, {"api_key": "given"}]:
        judge = rewards.get("vlm_score", url="http://h:1", model="m", transport=httpx.MockTransport(handler), **kwargs)
        judge(_images(1), ["a"])
    monkeypatch.delenv("FLOWRL_JUDGE_API_KEY")
    rewards.get("vlm_score", url="http://h:1", model="m", transport=httpx.MockTransport(handler))(_images(1), ["a"])
    assert seen == ["Bearer from-env", "Bearer given", None]


def test_backoff_doubles_with_jitter_and_honours_retry_after():
    client = JudgeClient("http://127.0.0.1:1", "m", backoff=1.0, max_backoff=10.0)
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 4.0), (5, 10.0)]:
        delays = [client._delay(attempt, None) for _ in range(200)]
        assert base * 0.5 <= min(delays) and max(delays) < base * 1.5 and len(set(delays)) > 1
    assert client._delay(1, 7.0) == 7.0 and client._delay(1, 60.0) == 10.0


def test_a_dead_server_is_retried_then_fails_in_one_line_within_the_timeout():
    port = free_port()  # nothing listens there
    judge = rewards.get("vlm_score", url=f"http://127.0.0.1:{port}", model="m", retries=2, backoff=0.01, timeout=5)
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        judge(_images(2), ["a", "b"])
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"VLM judge 'vlm_score' at http://127.0.0.1:{port}/v1/chat")
    assert re.search(r"is unreachable \(ConnectError: .*\) after 3 tries", message), message
    metrics = judge.pop_metrics()
    assert metrics["failures"] >= 1 and metrics["retries"] >= 2


def test_answers_are_cached_by_pixels_text_and_model_in_memory_and_on_disk(tmp_path):
    transport = Transport(lambda body: httpx.Response(200, json=_chat("Final Score: 3")))
    kwargs = dict(url="http://127.0.0.1:1", model="m", transport=transport, cache_dir=str(tmp_path))
    judge = rewards.get("vlm_score", **kwargs)
    images = torch.cat([_images(3), _images(1)])  # the last image repeats the first
    assert judge(images, ["a", "b", "c", "a"]).tolist() == pytest.approx([0.6] * 4)
    assert len(transport.bodies) == 3 and judge.pop_metrics()["cache_hits"] == 1  # asked once within the call
    judge(images, ["a", "b", "c", "a"])
    assert len(transport.bodies) == 3 and judge.pop_metrics() == {
        "requests": 0,
        "cache_hits": 4,
        "retries": 0,
        "unparsable": 0,
        "failures": 0,
    }
    judge(images[:1], ["another prompt"])
    assert len(transport.bodies) == 4  # a new prompt is a new question
    again = rewards.get("vlm_score", **kwargs)  # a fresh process: the answers on disk
    again(images, ["a", "b", "c", "a"])
    assert len(transport.bodies) == 4 and len(list(tmp_path.glob("*/*.json"))) == 4
    other = rewards.get("vlm_score", **{**kwargs, "model": "another-model"})
    other(images[:1], ["a"])
    assert len(transport.bodies) == 5  # another model is another question


def test_pairwise_win_rates_from_verdicts_and_both_orders():
    def brighter(body):  # the judge prefers the brighter image, as an honest judge reading the pixels
        urls = [c["image_url"]["url"] for c in body["messages"][-1]["content"] if c["type"] == "image_url"]
        half = len(urls) // 2  # videos: the frames of the first, then of the second
        first, second = (np.mean([_decode(u).mean() for u in part]) for part in (urls[:half], urls[half:]))
        return httpx.Response(200, json=_chat(f"<answer>Image {1 if first > second else 2} is better</answer>"))

    transport = Transport(brighter)
    judge = rewards.get("vlm_pairwise", url="http://127.0.0.1:1", model="m", transport=transport)
    prompts = ["a"] * 4 + ["b"] * 3 + ["c"]
    w = judge(_images(8), prompts)
    torch.testing.assert_close(w, torch.tensor([0.0, 1 / 3, 2 / 3, 1.0, 0.0, 0.5, 1.0, 0.5]))
    assert len(transport.bodies) == 6 + 3
    assert "\u300ca\u300d" in transport.bodies[0]["messages"][-1]["content"][-1]["text"]
    both = rewards.get("vlm_pairwise", url="http://127.0.0.1:1", model="m", transport=transport, both_orders=True)
    torch.testing.assert_close(both(_images(8), prompts), w)
    assert len(transport.bodies) == 9 + 18  # each pair in both orders (another judge: its own cache)
    both(_images(8), prompts)
    assert len(transport.bodies) == 27 and both.pop_metrics()["cache_hits"] == 18
    videos = _images(6).view(3, 2, 3, 8, 8).transpose(1, 2)
    torch.testing.assert_close(judge(videos, ["v"] * 3), torch.tensor([0.0, 0.5, 1.0]))
    content = transport.bodies[-1]["messages"][-1]["content"]
    assert sum(c["type"] == "image_url" for c in content) == 4 and "Video 1 is better" in content[-1]["text"]


def test_unread_verdicts_are_left_out_of_the_win_rates():
    first, second = torch.tensor([0, 0, 1, 3]), torch.tensor([1, 2, 2, 4])
    sizes = torch.tensor([3, 3, 3, 2, 2, 1])
    p = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    torch.testing.assert_close(win_rates_of_read(first, second, p, sizes), win_rates(first, second, p, sizes))
    p = torch.tensor([1.0, math.nan, 0.0, math.nan], dtype=torch.float64)
    w = win_rates_of_read(first, second, p, sizes)
    assert w[:3].tolist() == [1.0, 0.0, 1.0] and w[3:5].isnan().all() and w[5] == 0.5


def test_reward_counters_reach_the_epoch_metrics():
    class Counting:
        def __init__(self):
            self.calls = 0

        def __call__(self, images, prompts, **metadata):
            return torch.ones(len(prompts))

        def pop_metrics(self):
            self.calls += 1
            return {"requests": 3, "cache_hits": 1}

    judge = Counting()
    scoring = Rewards(
        {"judge": judge, "plain": lambda images, prompts, **m: torch.zeros(len(prompts))},
        {"judge": 1.0},
        Processes.single(),
    )
    valid, stats = scoring.check({"judge": torch.ones(4), "plain": torch.zeros(4)})
    assert valid.all() and judge.calls == 1
    assert stats == {"bad_rewards": 0, "reward/judge/requests": 3.0, "reward/judge/cache_hits": 1.0}


# ----- against a real server: `transformers serve` with tiny random LLaVA models -----


def save_tiny_llava(path: Path, always_yes: bool = False) -> Path:
    """A tiny random LLaVA (CLIP vision tower 16 px / 8 px patches, one-layer Llama) with a word-level tokenizer and a
    PIL image processor, built offline. Its vocabulary has no `Final` nor `Score`, so its scores never parse;
    `always_yes` zeroes its output layer, so that greedy decoding always picks token 0, `yes`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    words = [
        "yes",
        "<pad>",
        "<unk>",
        "<s>",
        "</s>",
        "<image>",
        "<|im_start|>",
        "<|im_end|>",
        "user",
        "assistant",
        "system",
        "no",
        "Yes",
        "No",
        "Image",
        "image",
        "is",
        "better",
        "the",
        "a",
        "good",
        "bad",
        "cat",
        "dog",
        *"0123456789",
        *".,:;!?[]()'\"-<>/",
    ]
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    backend.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens={"image_token": "<image>"},
    )
    template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> "
        "{% elif c['type'] == 'text' %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|> "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
        projection_dim=16,
    )
    text = LlamaConfig(
        vocab_size=len(words),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=vocab["<image>"],
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    if always_yes:
        torch.nn.init.zeros_(model.lm_head.weight)
    model.generation_config = GenerationConfig(
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"], do_sample=False
    )
    model.save_pretrained(path)
    size = {"height": 16, "width": 16}
    image_processor = LlavaImageProcessorPil(
        size=size, crop_size=size, do_center_crop=False, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        chat_template=template,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(path)
    return path


class TransformersServe:
    """`transformers serve` on a free loopback port, its log in a file, behind a `Relay` that counts the chat
    requests it forwards: `url` is the relay's, `port` the server's own."""

    def __init__(self, folder: Path):
        self.port, self.log = free_port(), folder / "serve.log"
        direct = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--log-level",
            "info",
        ]
        self.process = subprocess.Popen(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{direct}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                pytest.fail(f"transformers serve did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        self.relay = Relay(self.port)
        self.url = self.relay.url

    def posts(self) -> int:
        """The chat requests sent to the server so far. Counted as the relay forwards them, so a request is counted
        before its answer can reach the client (the server's own access log lands later, or not at all for a
        request that fails inside the server)."""
        return self.relay.posts

    def close(self) -> None:
        if hasattr(self, "relay"):
            self.relay.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`(server, random model path, always-yes model path)`: one `transformers serve` for both models (each loaded on
    its first request, named by its path)."""
    pytest.importorskip("openai", reason="transformers serve needs the `openai` package")
    pytest.importorskip("fastapi", reason="transformers serve needs fastapi and uvicorn")
    pytest.importorskip("uvicorn", reason="transformers serve needs fastapi and uvicorn")
    folder = tmp_path_factory.mktemp("vlm")
    random_model = str(save_tiny_llava(folder / "random"))
    yes_model = str(save_tiny_llava(folder / "yes", always_yes=True))
    server = TransformersServe(folder)
    try:
        yield server, random_model, yes_model
    finally:
        server.close()


class Relay:
    """A TCP relay in front of the server that records the most connections open through it at once and counts the
    chat requests it forwards (`posts`)."""

    MARKER = b"POST /v1/chat/completions "

    def __init__(self, port: int):
        self.upstream, self.open, self.peak, self.posts, self.lock = port, 0, 0, 0, threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client):
        server = socket.create_connection(("127.0.0.1", self.upstream))
        with self.lock:
            self.open += 1
            self.peak = max(self.peak, self.open)
        pump = threading.Thread(target=self._pump, args=(server, client), daemon=True)
        pump.start()
        self._pump(client, server, count=True)
        pump.join()
        with self.lock:
            self.open -= 1

    def _pump(self, source, target, count: bool = False):
        tail = b""  # the end of the previous chunk: a request line may be split across two reads
        try:
            while data := source.recv(65536):
                if count:
                    seen = tail + data
                    with self.lock:
                        self.posts += seen.count(self.MARKER)
                    tail = seen[-(len(self.MARKER) - 1) :]
                target.sendall(data)
        except OSError:
            pass
        for sock in (source, target):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.listener.close()


@pytest.mark.distributed
def test_random_answers_are_nan_counted_and_cached(served, tmp_path):
    server, model, _ = served
    judge = rewards.get("vlm_score", url=server.url, model=model, max_tokens=6, cache_dir=str(tmp_path))
    before = server.posts()
    scores = judge(_images(3), ["a red cat", "a dog", "a red cat"])
    assert scores.isnan().all()  # its vocabulary cannot say "Final Score"
    assert judge.pop_metrics() == {"requests": 3, "cache_hits": 0, "retries": 0, "unparsable": 3, "failures": 0}
    assert server.posts() == before + 3
    again = judge(_images(3), ["a red cat", "a dog", "a red cat"])
    assert again.isnan().all() and server.posts() == before + 3  # the server was not asked again
    assert judge.pop_metrics() == {"requests": 0, "cache_hits": 3, "retries": 0, "unparsable": 3, "failures": 0}
    fresh = rewards.get("vlm_score", url=server.url, model=model, max_tokens=6, cache_dir=str(tmp_path))
    fresh(_images(3), ["a red cat", "a dog", "a red cat"])
    assert server.posts() == before + 3 and fresh.pop_metrics()["cache_hits"] == 3  # from the disk cache


@pytest.mark.distributed
def test_yes_no_from_the_server(served):
    server, model, yes_model = served
    text = rewards.get("vlm_yes_no", url=server.url, model=yes_model, logprobs=False)
    assert text(_images(2), ["a cat", "a dog"]).tolist() == [1.0, 1.0]  # its answers are "yes yes ..."
    random_text = rewards.get("vlm_yes_no", url=server.url, model=model, logprobs=False, max_tokens=2)
    scores = random_text(_images(4), ["a cat"] * 4)
    metrics = random_text.pop_metrics()
    assert all(s in (0.0, 1.0) or math.isnan(s) for s in scores.tolist())
    assert metrics["requests"] == 4 and metrics["unparsable"] == int(scores.isnan().sum())
    judge = rewards.get("vlm_yes_no", url=server.url, model=yes_model)
    try:  # transformers serve (5.24) ignores `logprobs` / `top_logprobs`: a one-line error says so
        scores = judge(_images(2), ["a cat", "a dog"])
    except RewardError as err:
        assert "answered without logprobs" in str(err) and "\n" not in str(err)
    else:  # a version that returns them: probabilities
        assert ((scores >= 0) & (scores <= 1)).all()


@pytest.mark.distributed
def test_at_most_max_concurrency_connections_reach_the_server(served):
    server, model, _ = served
    relay = Relay(server.port)
    try:
        judge = rewards.get("vlm_score", url=relay.url, model=model, max_tokens=4, max_concurrency=2)
        assert judge(_images(8), ["p"] * 8).isnan().all()
        assert judge.pop_metrics()["requests"] == 8
        judge.close()
        assert 1 <= relay.peak <= 2, relay.peak
    finally:
        relay.close()


@pytest.mark.distributed
def test_edit_video_and_pairwise_judges_against_the_server(served):
    server, model, _ = served
    edit = rewards.get("vlm_edit", url=server.url, model=model, max_tokens=4)
    assert edit(_images(2), ["make it red", "add a hat"], source_images=_images(2)[:, None]).isnan().all()
    video = rewards.get("vlm_video", url=server.url, model=model, frames=3, max_tokens=4)
    assert video(_images(8).view(2, 4, 3, 8, 8).transpose(1, 2), ["a cat runs", "a dog"]).isnan().all()
    assert edit.pop_metrics()["unparsable"] == 2 and video.pop_metrics()["unparsable"] == 2
    pairwise = rewards.get("vlm_pairwise", url=server.url, model=model, max_tokens=4)
    prompts = ["a"] * 3 + ["b"] * 3
    assert pairwise(_images(6), prompts).isnan().all()  # no verdict read: every sample NaN
    assert pairwise.pop_metrics() == {"requests": 6, "cache_hits": 0, "retries": 0, "unparsable": 6, "failures": 0}
    tie = rewards.get("vlm_pairwise", url=server.url, model=model, max_tokens=4, on_unparsable=0.5)
    assert tie(_images(6), prompts).tolist() == [0.5] * 6  # Pref-GRPO's tie


@pytest.mark.distributed
def test_server_errors_5xx_retried_4xx_not(served):
    server, model, _ = served
    # a literal <image> in the text is a second image token the model has no image for: the server answers 500
    judge = rewards.get(
        "vlm_score", url=server.url, model=model, template="<image> {prompt}", retries=2, backoff=0.01, max_tokens=4
    )
    before = server.posts()
    with pytest.raises(
        RewardError,
        match=r"^VLM judge 'vlm_score' at \S+ answered 500 \(Internal Server Error\) "
        r"after 3 tries",
    ):
        judge(_images(1), ["a cat"])
    assert judge.pop_metrics() == {"requests": 1, "cache_hits": 0, "retries": 2, "unparsable": 0, "failures": 1}
    assert server.posts() == before + 3
    bad_field = rewards.get("vlm_score", url=server.url, model=model, request={"not_a_field": 1}, backoff=0.01)
    with pytest.raises(RewardError, match=r"refused the request \(422: Unexpected fields in the request"):
        bad_field(_images(1), ["a cat"])
    assert bad_field.pop_metrics()["retries"] == 0 and server.posts() == before + 4
