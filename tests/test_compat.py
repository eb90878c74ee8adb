"""The private uses of other libraries, each wrapped once in ``torchrl_trl._compat``: an
upgrade that changes them fails here first."""

import threading
import uuid

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ListStorage, ReplayBuffer

from torchrl_trl import _compat


class _RecordingLock:
    """A re-entrant lock that records which calls took it."""

    def __init__(self):
        self._lock, self.taken = threading.RLock(), 0

    def acquire(self, *args, **kwargs):
        got = self._lock.acquire(*args, **kwargs)
        self.taken += bool(got)
        return got

    def release(self):
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


def test_replay_lock_holds_writers_and_samplers_back():
    """The lock _compat hands out is the one TorchRL's writes and samples take: holding it
    holds them back."""
    rb = ReplayBuffer(storage=ListStorage(8), batch_size=1)
    rb.add(torch.tensor(0))
    lock = rb._replay_lock = _RecordingLock()  # the private attribute _compat reads
    assert _compat.replay_lock(rb) is lock
    rb.add(torch.tensor(1))
    assert lock.taken >= 1
    taken = lock.taken
    rb.sample()
    assert lock.taken > taken and len(rb) == 2
    with _compat.replay_lock(rb):  # held here: another thread cannot take it
        other = []
        probe = threading.Thread(target=lambda: other.append(lock.acquire(blocking=False)))
        probe.start(), probe.join()
        assert other == [False]


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.distributed  # starts Ray: a buffer actor
@pytest.mark.timeout(120)
def test_bind_ray_replay_buffer_reads_and_writes_the_owners_actor(ray_session):
    from torchrl.data import RayReplayBuffer

    from torchrl_trl.online.ray import make_ray_replay_buffer

    ray = ray_session
    name, namespace = "compat_rb", f"compat_{uuid.uuid4().hex[:8]}"
    owner = make_ray_replay_buffer(16, storage=LazyTensorStorage, name=name, namespace=namespace)

    class View(RayReplayBuffer):
        def __init__(self, actor):
            _compat.bind_ray_replay_buffer(self, actor)

    try:
        owner.extend(TensorDict({"x": torch.arange(3)}, [3]))
        view = View(ray.get_actor(name, namespace=namespace))
        assert view.is_alive and len(view) == 3 and view[:]["x"].tolist() == [0, 1, 2]
        view.extend(TensorDict({"x": torch.arange(3, 5)}, [2]))  # writes reach the owner's actor
        assert len(owner) == 5 and owner.write_count == view.write_count == 5
        assert view.client()[4]["x"].item() == 4
        _compat.bind_ray_replay_buffer(view, None)  # unbinding never kills the actor
        assert not view.is_alive
        with pytest.raises(AttributeError):
            len(view)
        assert len(owner) == 5
    finally:
        owner.close()


@pytest.mark.distributed  # starts Ray (ray_session)
def test_ray_runtime_lease_shares_an_initialised_runtime(ray_session):
    ray = ray_session
    lease = _compat.ray_runtime_lease({"num_cpus": 1})
    assert ray.is_initialized()
    lease.release()
    lease.release()  # idempotent
    assert ray.is_initialized()  # it did not start Ray, so it does not shut it down


# -- the buffer dataset's uses (_buffers.py, data/arrow.py) -----------------------------------


def test_reset_replay_lock_frees_a_lock_held_by_a_gone_thread():
    rb = ReplayBuffer(storage=ListStorage(8))
    held = _compat.replay_lock(rb)
    assert held.acquire()  # as a writer thread that does not exist in a forked child
    _compat.reset_replay_lock(rb)
    assert _compat.replay_lock(rb) is not held and _compat.replay_lock(rb).acquire(blocking=False)
    rb.add(torch.tensor(1))  # writes take the new lock
    assert len(rb) == 1


def test_pin_storage_length_bounds_what_the_sampler_draws():
    rb = ReplayBuffer(storage=LazyTensorStorage(16), batch_size=64)
    rb.extend(TensorDict({"x": torch.arange(10)}, [10]))
    _compat.pin_storage_length(rb.storage, 4)
    assert len(rb) == 4 and int(rb.sample()["x"].max()) <= 3
    rb.extend(TensorDict({"x": torch.arange(10, 12)}, [2]))  # writes still advance the pinned length
    assert len(rb) == 6


def test_datasets_examples_iterable_protocol():
    """The protocol ``data/arrow.py`` implements: the names datasets 5.2 calls on it."""
    pytest.importorskip("datasets")
    from datasets import Features, IterableDataset, Value

    base = _compat.datasets_examples_iterable_base()
    for name in ("shard_data_sources", "shuffle_data_sources", "reshard_data_sources", "split_shard_indices_by_worker",
                 "_init_state_dict", "state_dict", "load_state_dict", "is_typed", "features", "iter_arrow", "num_shards"):
        assert hasattr(base, name), name

    class Rows(base):
        def __init__(self, shards):
            super().__init__()
            self.shards = shards

        is_typed = True
        features = Features({"x": Value("int64")})
        iter_arrow = None
        num_shards = property(lambda self: len(self.shards))

        def __iter__(self):
            for s in self.shards:
                yield str(s), {"x": s}

        def _init_state_dict(self):
            self._state_dict = {}
            return self._state_dict

        def shard_data_sources(self, num_shards, index, contiguous=True):
            return Rows([self.shards[i] for i in self.split_shard_indices_by_worker(num_shards, index, contiguous)])

    ds = _compat.iterable_dataset_from_examples(Rows([0, 1, 2, 3]), Rows.features)
    assert isinstance(ds, IterableDataset) and ds.features == Rows.features
    assert list(ds) == [{"x": i} for i in range(4)]
    assert list(ds.shard(2, 1)) == [{"x": 2}, {"x": 3}]


def test_attn_implementation_reads_what_transformers_selected():
    """The packed reward scorer picks its kernel arguments by this value."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    model = LlamaForSequenceClassification(config)
    model.set_attn_implementation("eager")
    assert _compat.attn_implementation(model.config) == "eager"
    model.set_attn_implementation("sdpa")
    assert _compat.attn_implementation(model.config.get_text_config()) == "sdpa"
    assert _compat.attn_implementation(object()) is None
