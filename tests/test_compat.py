"""The private uses of other libraries, each wrapped once in ``torchrl_trl._compat``: an
upgrade that changes them fails here first."""

import threading
import uuid

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ListStorage, ReplayBuffer

from torchrl_trl import _compat


def test_replay_lock_holds_writers_and_samplers_back():
    rb = ReplayBuffer(storage=ListStorage(8), batch_size=1)
    rb.add(torch.tensor(0))
    done = []
    with _compat.replay_lock(rb):
        writer = threading.Thread(target=lambda: done.append(rb.add(torch.tensor(1))))
        sampler = threading.Thread(target=lambda: done.append(rb.sample()))
        writer.start(), sampler.start()
        writer.join(0.3), sampler.join(0.3)
        assert writer.is_alive() and sampler.is_alive() and not done and len(rb) == 1
    writer.join(5), sampler.join(5)
    assert len(done) == 2 and len(rb) == 2


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


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


def test_ray_runtime_lease_shares_an_initialised_runtime(ray_session):
    ray = ray_session
    lease = _compat.ray_runtime_lease({"num_cpus": 1})
    assert ray.is_initialized()
    lease.release()
    lease.release()  # idempotent
    assert ray.is_initialized()  # it did not start Ray, so it does not shut it down
