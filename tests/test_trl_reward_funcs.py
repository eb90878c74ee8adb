"""as_trl_reward_func: TorchRL rewards (our HFRewardModelWrapper, GSM8KRewardParser, any
TensorDict module) as TRL reward_funcs, checked against TRL's own reward-model path and
inside GRPOTrainer.train() / RLOOTrainer.train()."""

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from tensordict.nn import TensorDictModule, TensorDictModuleBase

from torchrl_trl import layouts
from torchrl_trl.rewards import HFRewardModelWrapper, RewardBatching, RewardExecutor, RewardRenderer
from torchrl_trl.rewards.trl_funcs import as_trl_reward_func, rollouts_from_trl

QUESTIONS = ["what is two plus two?", "hello world", "a b c", "how are you today? " * 6]
COMPLETIONS = ["the answer is four.", "hi", "d e f g h i j k l m n o p " * 4, "fine, thank you."]


def _chat_batch():
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    return prompts, completions


def _trl_reference(model, tok, prompts, completions):
    """TRL's reward-model steps (GRPOTrainer._calculate_rewards): one right-padded forward."""
    if isinstance(prompts[0], list):
        texts = [tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    inputs = tok(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        return model(**inputs).logits[:, 0]


@pytest.fixture(scope="module")
def reward_models(checkpoints):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = {}
    for name in ("reward_model", "reward_model_other_tokenizer"):
        path = getattr(checkpoints, name)
        out[name] = (
            AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval(),
            AutoTokenizer.from_pretrained(path),
        )
    return out


def test_equals_trl_reward_model_path(checkpoints, reward_models, tmp_path):
    """Build a GRPOTrainer with TRL's own reward_funcs=[model] next to ours and compare
    the columns of its _calculate_rewards on fixed chat and text batches."""
    from trl import GRPOConfig, GRPOTrainer
    from datasets import Dataset

    models = [reward_models[n][0] for n in ("reward_model", "reward_model_other_tokenizer")]
    toks = [reward_models[n][1] for n in ("reward_model", "reward_model_other_tokenizer")]
    # tiny token budget: several micro-batches per call, sorted by length
    ours = [
        as_trl_reward_func(HFRewardModelWrapper(m, renderer=RewardRenderer(tokenizer=t), batching=RewardBatching(max_tokens_per_batch=96)), name=f"ours{i}")
        for i, (m, t) in enumerate(zip(models, toks))
    ]
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, num_generations=2,
        use_cpu=True, bf16=False, report_to=[], save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=str(checkpoints.policy), reward_funcs=[*models, *ours], args=args,
        train_dataset=Dataset.from_dict({"prompt": QUESTIONS}),
        reward_processing_classes=[*toks, None, None],
    )
    for prompts, completions in (_chat_batch(), (QUESTIONS, COMPLETIONS)):
        inputs = [{"prompt": p, "answer": "x"} for p in prompts]
        ids = [[1, 2, 3]] * len(prompts)
        rewards = trainer._calculate_rewards(inputs, prompts, completions, ids)
        torch.testing.assert_close(rewards[:, 2], rewards[:, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rewards[:, 3], rewards[:, 1], atol=1e-5, rtol=1e-5)
        for m, t, col in zip(models, toks, (0, 1)):
            ref = _trl_reference(m, t, prompts, completions)
            torch.testing.assert_close(rewards[:, col], ref, atol=1e-5, rtol=1e-5)
        assert rewards[:, 0].unique().numel() == len(prompts)  # a real, non-constant reward
    assert ours[0].reward.processed_tokens < 96 * 4  # micro-batched, not one padded forward


class RecordingReward:
    """Delegates to a TRL reward func and records its inputs and outputs."""

    def __init__(self, func):
        self.func, self.__name__, self.calls = func, func.__name__, []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        out = self.func(prompts, completions, completion_ids, **kwargs)
        self.calls.append((prompts, completions, out))
        return out


@pytest.mark.parametrize("trainer_kind", ["grpo", "rloo"])
def test_trainer_train_with_reward_model_wrapper(trainer_kind, checkpoints, reward_models, tmp_path):
    from datasets import Dataset

    model, tok = reward_models["reward_model_other_tokenizer"]
    func = RecordingReward(
        as_trl_reward_func(HFRewardModelWrapper(checkpoints.reward_model_other_tokenizer, batching=RewardBatching(max_tokens_per_batch=64)))
    )
    assert not isinstance(func.func, torch.nn.Module) and func.__name__ == "reward_model_other_tokenizer"
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    common = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        logging_steps=1, shuffle_dataset=False,
    )
    if trainer_kind == "grpo":
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer
    else:
        from trl import RLOOConfig as Config, RLOOTrainer as Trainer
    trainer = Trainer(
        model=str(checkpoints.policy), reward_funcs=[func], args=Config(**common),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    trainer.train()
    assert trainer.state.global_step == 2 and len(func.calls) == 2
    logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    for (p, c, out), mean in zip(func.calls, logged):
        assert len(out) == 4
        torch.testing.assert_close(torch.tensor(out), _trl_reference(model, tok, p, c), atol=1e-5, rtol=1e-5)
        assert mean == pytest.approx(sum(out) / len(out), abs=1e-5)


def test_gsm8k_parser_right_wrong_unformatted():
    from torchrl.data.llm import History
    from torchrl.envs.llm import GSM8KRewardParser

    answers = ["Two and two make four. #### 4"] * 3
    texts = ["<think>2+2</think><answer>4</answer>", "<answer>5</answer>", "it is 4"]
    parser = GSM8KRewardParser()
    func = as_trl_reward_func(parser)
    prompts, _ = _chat_batch()
    prompts = prompts[:3]
    chat = func(prompts, [[{"role": "assistant", "content": t}] for t in texts], [[1]] * 3, answer=answers)
    text = func(["2+2?"] * 3, texts, [[1]] * 3, answer=answers, trainer_state=None)
    # TorchRL's own values: the parser on a TorchRL chat rollout
    history = lazy_stack([History.from_chats([p + [{"role": "assistant", "content": t}]])[0] for p, t in zip(prompts, texts)])
    td = TensorDict({"history": TensorDict({"full": history}, [3]), "answer": answers}, [3])
    ref = GSM8KRewardParser(in_keys=[("history", "full"), "answer"])._step(td, td.select("answer").clone())
    expected = ref["reward"].reshape(-1).tolist()
    assert expected == pytest.approx([1.0, 0.1, 0.0])
    assert chat == pytest.approx(expected) and text == pytest.approx(expected)
    assert parser.in_keys == []  # the caller's parser is left as it was
    with pytest.raises(KeyError, match="answer"):
        func(prompts, texts, [[1]] * 3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("executor", [pytest.param("process", marks=pytest.mark.distributed), "thread"])
def test_gsm8k_parser_per_completion_in_an_executor(executor):
    """A TorchRL reward parser through executor=: one completion per call, in worker
    processes (the parser is pickled once per worker) or threads; the same rewards as
    the batch call in this process."""
    from torchrl.envs.llm import GSM8KRewardParser

    answers = ["Two and two make four. #### 4"] * 3
    texts = ["<think>2+2</think><answer>4</answer>", "<answer>5</answer>", "it is 4"]
    prompts = _chat_batch()[0][:3]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    expected = as_trl_reward_func(GSM8KRewardParser())(prompts, completions, [[1]] * 3, answer=answers)
    extra = {"mp_context": "fork"} if executor == "process" else {}
    func = as_trl_reward_func(GSM8KRewardParser(), executor=RewardExecutor(executor, max_workers=2, timeout=30, **extra))
    try:
        assert not func.is_trl_function
        for ids in ([[1]] * 3, None):
            assert func(prompts, completions, ids, answer=answers, trainer_state=None) == pytest.approx(expected)
        assert func.failure_counts == {"error": 0, "timeout": 0, "crash": 0} and func.scored == 6
        with pytest.raises(KeyError, match="answer"):  # checked here, not once per completion
            as_trl_reward_func(GSM8KRewardParser(), executor=RewardExecutor(executor, **extra), columns=["answer"])(
                prompts, completions, [[1]] * 3
            )
    finally:
        func.shutdown()


def test_any_tensordict_module_and_errors():
    lengths = TensorDictModule(
        lambda texts: torch.tensor([[float(len(t))] for t in texts]), in_keys=[("text", "response")], out_keys=["score"]
    )
    func = as_trl_reward_func(lengths, reward_key="score", name="length")
    assert func.__name__ == "length"
    assert func(["p", "q"], ["abc", "de"], [[1, 2], [3]]) == [3.0, 2.0]

    class ReadsIds(TensorDictModuleBase):
        in_keys, out_keys = [("tokens", "response"), "answer"], [("next", "reward")]

        def forward(self, td):
            ids = layouts.read_tokens(td, "response").tolist()
            bonus = [float(a == "yes") for a in layouts.read_column(td, "answer")]
            td.set(("next", "reward"), torch.tensor([len(i) + b for i, b in zip(ids, bonus)]).reshape(-1, 1, 1))
            return td

    ids_func = as_trl_reward_func(ReadsIds())
    assert ids_func(["p", "q"], ["a", "b"], [[1, 2, 3], [4]], answer=["yes", "no"]) == [4.0, 1.0]
    td = rollouts_from_trl(["p"], ["a"], [[7, 8]], columns={"answer": ["yes"]})
    assert layouts.read_tokens(td, "response").tolist() == [[7, 8]]
    assert layouts.read_text(td, "full") == ["pa"]

    silent = TensorDictModule(lambda t: t, in_keys=[("text", "response")], out_keys=["copy"])
    with pytest.raises(KeyError, match="wrote none of the reward keys"):
        as_trl_reward_func(silent)(["p"], ["a"], [[1]])
    with pytest.raises(KeyError, match=r"columns \['solution'\] were not passed.*answer"):
        as_trl_reward_func(ReadsIds(), columns=["solution"])(["p"], ["a"], [[1]], answer=["x"])
    with pytest.raises(ValueError, match="expected one completion per prompt, got 2 prompts and 1 completions"):
        ids_func(["p", "q"], ["a"], [[1]])


@pytest.mark.timeout(60)
def test_nonfinite_errors_and_timeout_name_the_function():
    import threading

    rewards = iter([[float("inf"), 3.0], [float("nan"), 1.0]])
    module = TensorDictModule(lambda texts: torch.tensor(next(rewards)).reshape(-1, 1), in_keys=[("text", "response")],
                              out_keys=["score"])
    func = as_trl_reward_func(module, reward_key="score", name="scorer")
    with pytest.warns(UserWarning, match="'scorer' scored 1 of 2 completions"):
        assert func(["p", "q"], ["a", "b"], [[1], [2]]) == [None, 3.0]  # TRL excludes None
    assert func(["p", "q"], ["a", "b"], [[1], [2]]) == [None, 1.0]
    assert func.nonfinite == 2

    def fails(texts):
        raise RuntimeError("scorer server down")

    broken = as_trl_reward_func(TensorDictModule(fails, in_keys=[("text", "response")], out_keys=["score"]),
                                reward_key="score", name="remote_rm")
    with pytest.raises(RuntimeError, match="'remote_rm' raised RuntimeError: scorer server down") as info:
        broken(["p"], ["a"], [[1]])
    assert str(info.value.__cause__) == "scorer server down"

    release = threading.Event()

    def hangs(texts):
        release.wait()
        return torch.zeros(len(texts), 1)

    stuck = as_trl_reward_func(TensorDictModule(hangs, in_keys=[("text", "response")], out_keys=["score"]),
                               reward_key="score", name="stuck_rm", executor=RewardExecutor(timeout=0.5))
    with pytest.raises(TimeoutError, match="'stuck_rm' did not return within timeout=0.5s"):
        stuck(["p"], ["a"], [[1]])  # only the timeout can end it: the function never returns
    release.set()
