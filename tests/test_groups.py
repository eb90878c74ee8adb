"""Grouping scored rollouts (as MCAdvantage does) and the offline builders, on small
hand-made rollouts whose right answer is known: pairs, KTO labels, best-of-n, skip counts,
errors."""

import warnings

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from torchrl.data import LazyStackStorage, ReplayBuffer

from torchrl_trl import layouts
from torchrl_trl.data import TorchRLBufferDataset
from torchrl_trl.data.groups import SkippedRolloutsWarning, find_groups
from torchrl_trl.data.preference import best_of_n, kto_rows, preference_pairs


def _rollout(i, query, reward):
    return TensorDict(
        {
            "idx": torch.tensor(i),
            "query": query,
            "text": {"prompt": f"<p>{query}</p>", "response": f"resp{i}"},
            ("next", "reward"): torch.tensor([[float(reward)]]),
            ("next", "done"): torch.tensor([True]),
        },
        batch_size=[],
    )


def _buffer(queries, rewards):
    """A LazyStackStorage buffer of single-turn rollouts, written in batches of 2 like a collector."""
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    rows = [_rollout(i, q, r) for i, (q, r) in enumerate(zip(queries, rewards))]
    for j in range(0, len(rows), 2):
        rb.extend(lazy_stack(rows[j : j + 2]))
    return rb


def _idx(rb_or_td, key=None):
    td = rb_or_td[:] if isinstance(rb_or_td, ReplayBuffer) else rb_or_td
    if key is not None:
        td = td.get(key)
    return [int(v) for v in layouts.read_column(td, "idx")]


# interleaved groups: "a" spans 3 collector batches, "b" 2, "c" is a singleton
QUERIES = ["a", "b", "a", "b", "c", "a", "b", "a"]
REWARDS = [1.0, 5.0, 3.0, 2.0, 9.0, 0.0, 5.0, 2.0]


def test_find_groups_across_batches_and_singletons():
    groups = find_groups(_buffer(QUERIES, REWARDS))
    assert groups.ids == ["a", "b"]
    assert [m.tolist() for m in groups.members] == [[0, 2, 5, 7], [1, 3, 6]]
    torch.testing.assert_close(groups.rewards, torch.tensor(REWARDS))
    assert groups.stats.skipped == {"singleton_group": 1}
    assert groups.stats.groups == 2 and groups.stats.rollouts == 8


def test_find_groups_matches_mcadvantage_queues():
    """With group_size, the groups are the ones MCAdvantage(grpo_size=...) completes."""
    from torchrl.objectives.llm import MCAdvantage

    queries = ["a", "b", "a", "a", "b", "a", "a", "b", "b", "b"]
    rewards = [float(i % 3) for i in range(len(queries))]
    rb = _buffer(queries, rewards)
    mc_rb = ReplayBuffer(storage=LazyStackStorage(64))
    mc_rb.append_transform(MCAdvantage(grpo_size=2, prompt_key="query", rewards_key=("next", "reward"),
                                       done_key=("next", "done")))
    for j in range(0, len(queries), 2):  # the same collector batches
        mc_rb.extend(rb[j : j + 2])
    written = _idx(mc_rb)
    groups = find_groups(rb, group_size=2)
    ours = [i for m in groups.members for i in m.tolist()]
    assert sorted(ours) == sorted(written)
    # MCAdvantage wrote groups as contiguous blocks of 2: the same member sets as ours
    assert sorted(tuple(sorted(written[k : k + 2])) for k in range(0, len(written), 2)) == sorted(
        tuple(sorted(m.tolist())) for m in groups.members
    )
    # a: 5 rollouts -> 2 groups + 1 left over; b: 5 -> 2 groups + 1 left over
    assert groups.stats.skipped == {"incomplete_group": 2, "incomplete_group_rollouts": 2}


def test_tensor_group_ids_and_nonfinite_rewards():
    rows = [_rollout(i, "same", r) for i, r in enumerate([1.0, float("nan"), 2.0, 3.0])]
    for i, gid in enumerate([7, 7, 8, 8]):
        rows[i].set("gid", torch.tensor([gid]))
    groups = find_groups(lazy_stack(rows), group_key="gid")
    assert groups.ids == [8]
    assert [m.tolist() for m in groups.members] == [[2, 3]]  # 7 lost its NaN row -> a singleton
    assert groups.stats.skipped == {"nonfinite_reward": 1, "singleton_group": 1}


@pytest.mark.parametrize("strategy", ["best_vs_worst", "all"])
def test_preference_pairs_never_choose_on_a_nan_reward(strategy):
    """A NaN reward would win or lose every comparison by accident (argmax/argmin, ``>``):
    its rollout is left out, counted and warned about."""
    nan = float("nan")
    rb = _buffer(["a", "a", "a", "b", "b"], [1.0, nan, 0.0, nan, 2.0])
    with pytest.warns(SkippedRolloutsWarning, match=r"nonfinite_reward=2"):
        pairs = preference_pairs(rb, strategy=strategy)
    assert pairs.build_stats.skipped["nonfinite_reward"] == 2
    assert pairs.build_stats.skipped["singleton_group"] == 1  # b is left with one rollout
    assert _idx(pairs, "chosen") == [0] and _idx(pairs, "rejected") == [2]
    assert torch.isfinite(pairs[:].get("margin")).all()
    with pytest.raises(ValueError, match=r"nonfinite_reward=2; expected rows to train on, none left"):
        preference_pairs(_buffer(["a", "a"], [nan, nan]), strategy=strategy)


def test_preference_pairs_best_vs_worst_and_margin():
    with pytest.warns(SkippedRolloutsWarning, match="singleton_group=1"):
        pairs = preference_pairs(_buffer(QUERIES, REWARDS))
    # a: best idx 2 (3.0), worst idx 5 (0.0); b: best idx 1 (5.0, first of the tie), worst 3
    assert _idx(pairs, "chosen") == [2, 1] and _idx(pairs, "rejected") == [5, 3]
    torch.testing.assert_close(pairs[:].get("margin"), torch.tensor([3.0, 3.0]))
    stats = pairs.build_stats
    assert (stats.rows, stats.used_groups) == (2, 2)


def test_preference_pairs_margin_leaves_nothing():
    with pytest.raises(ValueError, match=r"below_margin=2.*expected rows to train on, none left"):
        preference_pairs(_buffer(QUERIES, REWARDS), margin=3.0)


def test_preference_pairs_all_strategy():
    with pytest.warns(SkippedRolloutsWarning, match="tied_pair=1"):
        pairs = preference_pairs(_buffer(QUERIES, REWARDS), strategy="all", margin=0.5)
    got = set(zip(_idx(pairs, "chosen"), _idx(pairs, "rejected"), pairs[:].get("margin").tolist()))
    # a: idx 0,2,5,7 with rewards 1,3,0,2 -> all 6 pairs; b: idx 1,3,6 with 5,2,5 -> 2 pairs + a tie
    expected = {(2, 0, 2.0), (2, 5, 3.0), (2, 7, 1.0), (0, 5, 1.0), (7, 0, 1.0), (7, 5, 2.0), (1, 3, 3.0), (6, 3, 3.0)}
    assert got == expected
    assert pairs.build_stats.skipped == {"singleton_group": 1, "tied_pair": 1}
    with pytest.warns(SkippedRolloutsWarning, match="below_margin=3"):
        wide = preference_pairs(_buffer(QUERIES, REWARDS), strategy="all", margin=1.5)
    assert set(zip(_idx(wide, "chosen"), _idx(wide, "rejected"))) == {(2, 0), (2, 5), (7, 5), (1, 3), (6, 3)}


def test_kto_rows_rank_and_threshold():
    with pytest.warns(SkippedRolloutsWarning, match="middle_rollout=1, singleton_group=1"):
        rows = kto_rows(_buffer(QUERIES, REWARDS))
    td = rows[:]
    # a (idx 0,2,5,7 -> 1,3,0,2): top-2 desirable, bottom-2 undesirable; b (idx 1,3,6 -> 5,2,5):
    # k=1, idx 1 desirable (first of the tied 5s), idx 3 undesirable, the middle idx 6 left out
    assert list(zip(_idx(td), td.get("label").tolist())) == [
        (2, True), (7, True), (0, False), (5, False), (1, True), (3, False)
    ]
    with pytest.warns(SkippedRolloutsWarning, match="tied_at_cut=2"):
        tied = kto_rows(_buffer(["a"] * 4, [1.0, 2.0, 2.0, 3.0]))
    assert _idx(tied) == [3, 0] and tied.build_stats.skipped == {"tied_at_cut": 2}
    by_threshold = kto_rows(_buffer(QUERIES, REWARDS), threshold=3.0)
    td = by_threshold[:]
    assert td.get("label").tolist() == [r >= 3.0 for r in REWARDS]


def test_kto_rows_do_not_touch_the_source():
    rb = _buffer(QUERIES, REWARDS)
    with pytest.warns(SkippedRolloutsWarning):
        kto_rows(rb)
    assert "label" not in rb[:].keys()


def test_best_of_n_top_k_and_min_reward():
    with pytest.warns(SkippedRolloutsWarning, match="singleton_group=1"):
        best = best_of_n(_buffer(QUERIES, REWARDS), k=2)
    assert _idx(best) == [2, 7, 1, 6]
    with pytest.warns(SkippedRolloutsWarning, match="below_min_reward=1"):
        best = best_of_n(_buffer(QUERIES, REWARDS), k=2, min_reward=2.5)
    assert _idx(best) == [2, 1, 6]
    ds = TorchRLBufferDataset(best, 3, format="sft", reading="epoch")
    assert [r["completion"] for r in ds] == ["resp2", "resp1", "resp6"]


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------


def test_no_reward_key_names_key_and_available():
    rb = ReplayBuffer(storage=LazyStackStorage(8))
    rb.extend(lazy_stack([TensorDict({"query": "a", "text": {"response": "x"}}, []) for _ in range(2)]))
    for build in (best_of_n, preference_pairs, kto_rows):
        with pytest.raises(KeyError, match=r"\('next', 'reward'\).*Available keys: \['query', 'text.response'\]"):
            build(rb)
    with pytest.raises(KeyError, match="no group id at key 'prompt'"):
        best_of_n(_buffer(QUERIES, REWARDS), group_key="prompt")


def test_all_tied_and_singleton_groups_raise_with_counts():
    with pytest.raises(ValueError, match=r"tied_group=2.*expected rows to train on, none left"):
        preference_pairs(_buffer(["a", "a", "b", "b"], [1.0, 1.0, 2.0, 2.0]))
    with pytest.raises(ValueError, match=r"tied_group=2.*expected rows to train on, none left"):
        best_of_n(_buffer(["a", "a", "b", "b"], [1.0, 1.0, 2.0, 2.0]))
    with pytest.raises(ValueError, match=r"singleton_group=3.*expected rows to train on, none left"):
        kto_rows(_buffer(["a", "b", "c"], [1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"incomplete_group=1.*expected rows to train on, none left"):
        preference_pairs(_buffer(["a", "a", "a"], [1.0, 2.0, 3.0]), group_size=4)
    with pytest.raises(ValueError, match=r"best_of_n: expected k < group_size, got k=2"):
        best_of_n(_buffer(QUERIES, REWARDS), k=2, group_size=2)
    with pytest.raises(ValueError, match="one reward per rollout"):
        rows = [_rollout(i, "a", 0.0) for i in range(2)]
        for r in rows:
            r.set(("next", "reward"), torch.zeros(3, 1))
        best_of_n(lazy_stack(rows))


def test_format_on_rollouts_lacking_its_fields():
    rb = _buffer(QUERIES, REWARDS)
    with pytest.raises(KeyError, match=r"format 'dpo' needs keys \['chosen.text.prompt'.*Available keys"):
        TorchRLBufferDataset(rb, 2, format="dpo")
    with pytest.raises(KeyError, match=r"format 'kto' needs keys \['label'\]"):
        TorchRLBufferDataset(rb, 2, format="kto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedRolloutsWarning)
        pairs = preference_pairs(rb)
    # text-only rollouts: no history, no tokens
    with pytest.raises(KeyError, match=r"format 'dpo_conversational' needs keys \['chosen.history.prompt'"):
        TorchRLBufferDataset(pairs, 2, format="dpo_conversational")
    with pytest.raises(KeyError, match=r"'reward_tokenized' needs keys \['chosen.tokens.prompt'"):
        TorchRLBufferDataset(pairs, 2, format="reward_tokenized")
    rows = list(TorchRLBufferDataset(pairs, 2, format="reward", reading="epoch"))
    assert rows == [
        {"prompt": "<p>a</p>", "chosen": "resp2", "rejected": "resp5", "margin": 3.0},
        {"prompt": "<p>b</p>", "chosen": "resp1", "rejected": "resp3", "margin": 3.0},
    ]
