"""A math verifier that cannot hang training: ``math-verify`` in worker processes.

``math_accuracy`` is a TRL reward function (as TRL's ``accuracy_reward``): 1.0 when the
completion's ``\\boxed{...}`` answer equals the ``solution`` column, 0.0 when it does not,
``None`` (skipped) when the solution cannot be parsed. Some answers make sympy work for
ever (``\\boxed{9^{9^{9^{9}}}}`` computes a power tower inside big-integer C code, where
math-verify's own ``signal.alarm`` timeouts cannot interrupt it, and they only work in
the main thread anyway). So the function runs one completion at a time in a process
pool with a per-completion ``timeout``: a stuck worker is killed and replaced, and that
completion gets ``failure_reward`` (default: ``None``, excluded like TRL's ``None``).

The same function, isolated the same way, in both directions::

    in_processes = RewardExecutor("process", timeout=5)
    # TRL: GRPOTrainer(reward_funcs=[as_trl_reward_func(math_accuracy, executor=in_processes)])
    # TorchRL: env.append_transform(RewardFunctionWrapper(math_accuracy, executor=in_processes).as_transform())

Run (``pip install 'torchrl-trl[examples]'`` for math-verify)::

    python examples/math_verifier.py
"""

from __future__ import annotations

import logging
import time

from latex2sympy2_extended import NormalizationConfig
from math_verify import LatexExtractionConfig, parse, verify

# math-verify logs "Timeout is disabled" on every call with its own timeouts off
logging.getLogger("math_verify").setLevel(logging.ERROR)

ANSWER_CONFIG = [
    LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True),
        boxed_match_priority=0,  # the boxed answer first
        try_extract_without_anchor=False,
    )
]


def _content(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def math_accuracy(completions, solution, **kwargs) -> list[float | None]:
    """1.0 / 0.0 per completion: does its boxed answer equal ``solution``? ``None`` when
    the solution does not parse. Works on text or chat completions. Its own timeouts are
    off: the process executor's per-completion ``timeout`` bounds it."""
    rewards: list[float | None] = []
    for completion, sol in zip(completions, solution, strict=True):
        gold = parse(sol, parsing_timeout=None)
        if not gold:
            rewards.append(None)
            continue
        answer = parse(_content(completion), extraction_config=ANSWER_CONFIG,
                       extraction_mode="first_match", parsing_timeout=None)
        rewards.append(float(verify(gold, answer, timeout_seconds=None)))
    return rewards


EXAMPLES = [
    ("What is 2 + 2?", r"The sum is \boxed{4}.", "$4$"),
    ("Simplify 2/6.", r"We get \boxed{\frac{1}{3}}", r"$\frac{1}{3}$"),
    ("What is 3 * 3?", r"It is \boxed{6}.", "$9$"),
    ("How big is 9^9^9^9?", r"Exactly \boxed{9^{9^{9^{9}}}}", "$1$"),  # sympy never returns
    ("What is 1 + 1?", r"\boxed{2}", "not math"),  # unparseable solution: None
]


def run(timeout: float = 5.0, max_workers: int = 2) -> dict:
    """Score :data:`EXAMPLES` as ``GRPOTrainer`` would call the reward function; return
    the rewards, the failure counts and the wall time."""
    import warnings

    from torchrl_trl import RewardExecutor, as_trl_reward_func

    executor = RewardExecutor("process", max_workers=max_workers, timeout=timeout)
    reward_func = as_trl_reward_func(math_accuracy, executor=executor)
    prompts = [[{"role": "user", "content": q}] for q, _, _ in EXAMPLES]
    completions = [[{"role": "assistant", "content": c}] for _, c, _ in EXAMPLES]
    try:
        reward_func(prompts[:1], completions[:1], solution=["$4$"])  # start the workers
        start = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the timeout is expected here; it is counted
            rewards = reward_func(prompts, completions, solution=[s for _, _, s in EXAMPLES])
        wall = time.monotonic() - start
    finally:
        reward_func.shutdown()
    return {"rewards": rewards, "failure_counts": dict(reward_func.failure_counts), "wall_s": wall}


if __name__ == "__main__":  # for the tests, which import run(); workers never import __main__
    result = run()
    for (question, completion, solution), reward in zip(EXAMPLES, result["rewards"]):
        print(f"{reward!s:>5}  {completion!r} (solution {solution!r})")
    print(f"failures: {result['failure_counts']}; wall time {result['wall_s']:.1f}s")
