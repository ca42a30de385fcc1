"""The demo's verifiable task: two-number addition asked in a chat prompt.

A completion is correct when the last integer in it is the sum. The model tends to restate
the question ("17 + 25 = 42"), so the first number is an operand; the last one is its answer.
A small format term rewards answering with the number alone, as the prompt asks, but only a
correct one: an unconditional format term was hacked (at lr 5e-5 the model learned to answer a
bare, wrong number within 20 steps).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import torch

_INT = re.compile(r"-?\d+")
QUESTION = "What is {a} + {b}? Answer with just the number."
FORMAT_WEIGHT = 0.2


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def question(self) -> str:
        return QUESTION.format(a=self.a, b=self.b)


def split(max_operand: int, n_eval: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """All ordered pairs of operands in ``1..max_operand``, shuffled by ``seed`` and split into
    ``(train, held-out eval)``; no pair is in both."""
    pairs = [Problem(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    if not 0 < n_eval < len(pairs):
        raise ValueError(f"eval size {n_eval} must be in 1..{len(pairs) - 1} for operands up to {max_operand}")
    return pairs[n_eval:], pairs[:n_eval]


def final_number(text: str) -> int | None:
    """The last integer in ``text``, or None."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def correct(text: str, answer: int) -> bool:
    return final_number(text) == answer


def _text(completion: Any) -> str:
    # TRL passes conversational completions as [{"role": "assistant", "content": ...}].
    return completion[0]["content"] if isinstance(completion, list) else completion


def correctness_reward(completions: list, answer: list[int], **_: Any) -> list[float]:
    """1.0 when the completion's last integer is the sum, else 0.0 (TRL reward function)."""
    return [float(correct(_text(c), a)) for c, a in zip(completions, answer, strict=True)]


def format_reward(completions: list, answer: list[int], **_: Any) -> list[float]:
    """1.0 when the completion is the correct sum alone (what the prompt asks for), else 0.0."""
    return [float(bool(re.fullmatch(r"\s*-?\d+\.?\s*", _text(c))) and correct(_text(c), a))
            for c, a in zip(completions, answer, strict=True)]


def prompt(p: Problem) -> list[dict[str, str]]:
    return [{"role": "user", "content": p.question}]


def dataset(problems: list[Problem]):
    """A ``datasets.Dataset`` with TRL's conversational ``prompt`` and the ``answer`` column the
    reward function receives."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [prompt(p) for p in problems], "answer": [p.answer for p in problems]})


@torch.no_grad()
def evaluate(model: Any, tokenizer: Any, problems: list[Problem], max_new_tokens: int,
             batch_size: int = 64) -> tuple[float, list[str]]:
    """Greedy accuracy on ``problems`` and the completions, with the chat template TRL uses."""
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    texts: list[str] = []
    try:
        for i in range(0, len(problems), batch_size):
            chats = [tokenizer.apply_chat_template(prompt(p), tokenize=False, add_generation_prompt=True)
                     for p in problems[i:i + batch_size]]
            enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                                 top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id)
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        model.train(was_training)
        tokenizer.padding_side = side
    acc = sum(correct(t, p.answer) for t, p in zip(texts, problems, strict=True)) / len(problems)
    return acc, texts
