"""The demo's verifiable task: two-number addition asked in a chat prompt.

A completion is correct when the last integer in it is the sum. The model tends to restate
the question ("17 + 25 = 42"), so the first number is an operand; the last one is its answer.
A small term rewards stopping right after a correct answer (the prompt asks for just the
number; the model tends to chat on, "17 + 25 = 42\n\nYou can ...", until the length cap).
It pays only for a correct answer: an unconditional format term was hacked (at lr 5e-5 the
model learned to answer a bare, wrong number within 20 steps). An earlier version paid only for
the bare number, which SmolLM2 never wrote: the bonus never fired.
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


_ENDS_WITH_NUMBER = re.compile(r"-?\d+[.!]?\s*$")


def stops_after_answer(text: str, answer: int) -> bool:
    """The completion is correct and ends with its number (at most a full stop after it)."""
    return bool(_ENDS_WITH_NUMBER.search(text)) and correct(text, answer)


def format_reward(completions: list, answer: list[int], **_: Any) -> list[float]:
    """1.0 when the completion stops right after its correct answer ("42", "17 + 25 = 42",
    "The answer is 42."), else 0.0 (TRL reward function)."""
    return [float(stops_after_answer(_text(c), a)) for c, a in zip(completions, answer, strict=True)]


def prompt(p: Problem) -> list[dict[str, str]]:
    return [{"role": "user", "content": p.question}]


def dataset(problems: list[Problem]):
    """A ``datasets.Dataset`` with TRL's conversational ``prompt`` and the ``answer`` column the
    reward function receives."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [prompt(p) for p in problems], "answer": [p.answer for p in problems]})


class _TokenProgress:
    """A ``LogitsProcessor`` that only advances a progress bar by one generated token per call
    (one bar over the whole evaluation, without splitting it into smaller, slower batches)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.bar.update(1)
        return scores


@torch.no_grad()
def evaluate(model: Any, tokenizer: Any, problems: list[Problem], max_new_tokens: int,
             batch_size: int = 64, progress: bool = False) -> tuple[float, list[str]]:
    """Greedy accuracy on ``problems`` and the completions, with the chat template TRL uses;
    ``progress``: a tqdm bar over the generated tokens."""
    from tqdm.auto import tqdm
    from transformers import LogitsProcessorList

    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    texts: list[str] = []
    batches = range(0, len(problems), batch_size)
    bar = tqdm(total=len(batches) * max_new_tokens, unit="token", desc="greedy decoding", disable=not progress,
               leave=False)
    try:
        for i in batches:
            chats = [tokenizer.apply_chat_template(prompt(p), tokenize=False, add_generation_prompt=True)
                     for p in problems[i:i + batch_size]]
            enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            start = bar.n
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                                 top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id,
                                 logits_processor=LogitsProcessorList([_TokenProgress(bar)]))
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            bar.update(start + max_new_tokens - bar.n)  # a batch that stopped early at EOS
    finally:
        bar.close()
        model.train(was_training)
        tokenizer.padding_side = side
    acc = sum(correct(t, p.answer) for t, p in zip(texts, problems, strict=True)) / len(problems)
    return acc, texts
