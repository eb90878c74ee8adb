"""The demo's two tasks: what the policy is asked, how a reply is truly scored (by a rule the
reward model never sees) and the preference pairs ``trl.RewardTrainer`` learns from.

* ``vowels`` (tiny random models): an answer is better the larger its fraction of vowels.
* ``arithmetic`` (SmolLM2-135M-Instruct): ``"What is 3 + 5?"`` for single-digit pairs; the model
  knows the sums but rarely says them plainly (greedy answers are right about a third of the time).
  The true score is ``math_verify``'s check of the reply against the sum, on held-out pairs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

__all__ = ["TASKS", "DemoTask", "arithmetic_task", "vowels_task"]


@dataclass(frozen=True)
class DemoTask:
    """One task of the demo.

    Args:
        name (str): the task's name in ``results.json``.
        train_prompts (list of str): the user turns GRPO samples from.
        heldout_prompts (list of str): the user turns the true score is measured on (may be ``train_prompts``).
        true_score (callable): ``true_score(prompt, reply) -> float`` in ``[0, 1]``.
        preference_pairs (callable): ``preference_pairs(tokenizer, n, seed, heldout) -> rows``, conversational
            ``RewardTrainer`` rows, of the held-out prompts when ``heldout``.
        score_label (str): what the true score measures, for the printed table.
    """

    name: str
    train_prompts: list[str]
    heldout_prompts: list[str]
    true_score: Callable[[str, str], float]
    preference_pairs: Callable[..., list[dict]]
    score_label: str


def _chat_pair(prompt: str, chosen: str, rejected: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


# --- vowels, for the tiny random models ------------------------------------------------------

VOWEL_PROMPTS = [f"say something nice about {thing}" for thing in (
    "cats", "dogs", "the sea", "trees", "music", "bread", "rain", "books",
    "the moon", "coffee", "bikes", "snow", "friends", "tea", "maps", "clocks",
)]


def vowel_fraction(prompt: str, reply: str) -> float:
    """The hidden rule: the fraction of ``reply``'s characters that are vowels (0 if empty)."""
    return sum(c in "aeiouAEIOU" for c in reply) / len(reply) if reply else 0.0


def vowel_pairs(tokenizer, n: int, seed: int, heldout: bool = False, max_tokens: int = 12) -> list[dict]:
    """``n`` pairs of random non-special tokens, as the untrained tiny policy writes, ranked by the rule."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]

    def answer() -> str:
        while True:
            text = tokenizer.decode([rng.choice(vocab) for _ in range(rng.randint(3, max_tokens))])
            if text.strip():
                return text

    pairs = []
    while len(pairs) < n:
        a, b = answer(), answer()
        sa, sb = vowel_fraction("", a), vowel_fraction("", b)
        if abs(sa - sb) < 0.05:
            continue
        chosen, rejected = (a, b) if sa > sb else (b, a)
        pairs.append(_chat_pair(rng.choice(VOWEL_PROMPTS), chosen, rejected))
    return pairs


def vowels_task() -> DemoTask:
    return DemoTask("vowels", VOWEL_PROMPTS, VOWEL_PROMPTS, vowel_fraction, vowel_pairs, "hidden rule")


# --- arithmetic, for SmolLM2-135M-Instruct ----------------------------------------------------

#: every single-digit pair; every third one (after a fixed shuffle) is held out of training
_PAIRS = [(a, b) for a in range(1, 10) for b in range(1, 10)]
random.Random(1234).shuffle(_PAIRS)
_TRAIN_PAIRS = [p for i, p in enumerate(_PAIRS) if i % 3]
_HELDOUT_PAIRS = _PAIRS[::3]


def _question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


_ANSWERS = {_question(a, b): a + b for a, b in _PAIRS}


def sum_is_right(prompt: str, reply: str) -> float:
    """1.0 when ``math_verify`` reads the sum asked in ``prompt`` as ``reply``'s answer, else 0.0."""
    from math_verify import parse, verify

    return float(verify(parse(str(_ANSWERS[prompt])), parse(reply)))


#: the answers the rule prefers: the sum written out as an equation (the model states the sum
#: right 85% of the time in this form, far less often as a bare number)
_EQUATIONS = ("{a} + {b} = {s}", "{a} + {b} = {s}.", "{a} plus {b} equals {s}.")
#: answers the rule rejects: a bare or worded number, right or wrong
_SHORT_ANSWERS = ("The answer is {s}.", "{s}", "It is {s}.")
#: ways not to answer, as the untrained model often writes (cut where the demo cuts replies)
_NON_ANSWERS = (
    "To find the sum of {a} and {b}, we need to",
    "A good question. Addition is one of the",
    "Let's solve this step by step. First, we",
    "To solve this, we need to add the",
    "The sum of two numbers is the number",
)


def arithmetic_pairs(tokenizer, n: int, seed: int, heldout: bool = False) -> list[dict]:
    """``n`` pairs by a rule: the chosen reply states the right sum as an equation; the rejected one a wrong
    sum as an equation, a bare or worded number, or talk around the question (a third each)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a, b = rng.choice(_HELDOUT_PAIRS if heldout else _TRAIN_PAIRS)
        s = a + b
        wrong = rng.choice([x for x in range(2, 19) if x != s])
        chosen = rng.choice(_EQUATIONS).format(a=a, b=b, s=s)
        kind = rng.randrange(3)
        if kind == 0:
            rejected = rng.choice(_EQUATIONS).format(a=a, b=b, s=wrong)
        elif kind == 1:
            rejected = rng.choice(_SHORT_ANSWERS).format(s=rng.choice([s, wrong]))
        else:
            rejected = rng.choice(_NON_ANSWERS).format(a=a, b=b)
        pairs.append(_chat_pair(_question(a, b), chosen, rejected))
    return pairs


def arithmetic_task() -> DemoTask:
    return DemoTask(
        "arithmetic", [_question(a, b) for a, b in _TRAIN_PAIRS], [_question(a, b) for a, b in _HELDOUT_PAIRS],
        sum_is_right, arithmetic_pairs, "sum right, math-verify",
    )


TASKS = {"vowels": vowels_task, "arithmetic": arithmetic_task}
