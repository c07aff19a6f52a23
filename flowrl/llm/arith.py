"""The toy arithmetic task: a verifiable text world for the LLM adapter (exact-match reward, no judge).

The grammar is small and fixed, so every build, trainer and test sees the same problems:

    prompt  := A "+" B "="     A, B uniform in [0, 29]            answer A + B   (probability 0.55)
             | A "-" B "="     A, B in [0, 29] with A >= B         answer A - B   (probability 0.45)
    numbers := decimal, no sign, no leading zeros ("0", "7", "42")

so "23+15=" has answer "38". There are 900 + 465 distinct problems. A problem is in the test split when the
first byte of `sha256(prompt)` is below `TEST_FRACTION * 256` (about 1 problem in 5: 272 of them), else in the
train split: the split is a function of the problem text alone, so the two splits are disjoint whatever the seed
or the number of problems drawn. (There is no multiplication: a times-table fact of the test split is never
seen in training and cannot be inferred from the others, so the test split could not measure it.)

A model answers with the digits of the result and then an end-of-answer marker: the tokenizer's end-of-sequence
token (`EOS`, text `"<eos>"`) or a newline. `flowrl.rewards.text.parse_answer` documents how a completion is read
(the exact-match reward lives with the rewards: this module imports nothing of flowrl).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass


ALPHABET = "0123456789+-= \n"
"""Every character a prompt or completion may hold (the tokenizer has one token per character)."""
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
"""The tokenizer's special tokens: padding, start of sequence, end of sequence (ends an answer), unknown."""
OPERATORS = {"+": 0.55, "-": 0.45}
"""Each operator's probability in `make_problems`."""
MAX_OPERAND = 29
"""The largest operand: operands are drawn uniformly from [0, MAX_OPERAND] (sorted for "-")."""
TEST_FRACTION = 0.2
"""The (approximate) share of all problems in the test split."""
SPLITS = ("train", "test")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem: `prompt` ("23+45=") and its exact `answer` ("68")."""

    prompt: str
    """The question, ending with "="; the model continues it."""
    answer: str
    """The result in decimal, with no marker ("68")."""


def split_of(prompt: str) -> str:
    """`"test"` or `"train"`: a hash of the prompt text (so the split never depends on a seed)."""
    return "test" if hashlib.sha256(prompt.encode()).digest()[0] < TEST_FRACTION * 256 else "train"


def solve(a: int, op: str, b: int) -> Problem:
    """The problem `a op b =` and its answer; raises ValueError outside the grammar."""
    if op not in OPERATORS:
        raise ValueError(f"operator {op!r} is not one of {sorted(OPERATORS)}")
    if not (0 <= a <= MAX_OPERAND and 0 <= b <= MAX_OPERAND) or (op == "-" and a < b):
        raise ValueError(f"{a}{op}{b} is outside the grammar (operands in [0, {MAX_OPERAND}], no negative results)")
    result = a + b if op == "+" else a - b
    return Problem(f"{a}{op}{b}=", str(result))


def all_problems(split: str) -> list[Problem]:
    """Every distinct problem of `split`, in a fixed order ("+" before "-", then by operands)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    top = range(MAX_OPERAND + 1)
    problems = [solve(a, "+", b) for a in top for b in top] + [solve(a, "-", b) for a in top for b in range(a + 1)]
    return [p for p in problems if split_of(p.prompt) == split]


def make_problems(n: int, seed: int, split: str = "train") -> list[Problem]:
    """`n` problems of `split`, drawn (with replacement) from the grammar by a generator seeded with `seed`.

    Draws that fall in the other split are skipped, so the same `(seed, split)` always gives the same list and
    a longer list starts with the shorter one.
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    if n < 0:
        raise ValueError(f"cannot make {n} problems")
    rng = random.Random(f"flowrl.llm.arith:{seed}")  # a string seed: stable across Python versions
    ops, weights = list(OPERATORS), list(OPERATORS.values())
    problems = []
    while len(problems) < n:
        op = rng.choices(ops, weights)[0]
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        if op == "-" and a < b:
            a, b = b, a
        problem = solve(a, op, b)
        if split_of(problem.prompt) == split:
            problems.append(problem)
    return problems
