"""Two trainer processes (torchrun, gloo) attach to one named RayReplayBuffer actor that
Ray tasks filled, and read it through real SFTTrainers: every item once, nothing twice."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyTensorStorage  # noqa: E402

from torchrl_trl.online.ray import connect_ray_replay_buffer, make_ray_replay_buffer  # noqa: E402

# Ray actors and a torchrun launch of two trainer processes
pytestmark = pytest.mark.distributed


@pytest.fixture
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    # the writer task below lives in this test module, which Ray workers cannot import
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _write(client, td):
    """A Ray task standing in for a collector actor: writes through the buffer's client."""
    return len(client.extend(td))


@pytest.mark.timeout(240)
def test_two_trainer_ranks_read_one_named_ray_buffer(ray_cluster, tmp_path):
    n, name, namespace = 22, "rollouts", f"torchrl_trl_test_{uuid.uuid4().hex[:8]}"
    i = torch.arange(n)
    ids = torch.stack([1 + i // 10, 1 + i % 10, torch.full_like(i, 5), torch.full_like(i, 6)], -1)
    rb = make_ray_replay_buffer(64, storage=LazyTensorStorage, name=name, namespace=namespace)
    try:
        write = ray.remote(num_cpus=1)(_write)
        td = TensorDict({"input_ids": ids}, [n])
        assert sum(ray.get([write.remote(rb.client(), td[:11]), write.remote(rb.client(), td[11:])])) == n

        # an attached view in this process: same actor; close() detaches, never kills
        view = connect_ray_replay_buffer(name, namespace=namespace)
        assert len(view) == n and isinstance(view, type(rb))
        view.close()
        assert not view.is_alive and rb.is_alive and len(rb) == n
        with pytest.raises(LookupError, match="'nope'.*" + namespace + "/rollouts"):
            connect_ray_replay_buffer("nope", namespace=namespace, timeout=0.3)

        script = Path(__file__).with_name("online_dist_ray.py")
        torchrun = Path(sys.executable).with_name("torchrun")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(
            [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), ray_cluster, namespace, name,
             str(tmp_path / "out")],
            env=env, capture_output=True, text=True, timeout=200,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in range(2)]
        assert all(r["world_size"] == 2 and r["steps"] == 3 and r["len"] == n for r in ranks)
        assert all(r["type"] == "AttachedRayReplayBuffer" and r["ray_connected"] and r["ray_left"] for r in ranks)
        stored = sorted(map(tuple, ids.tolist()))
        assert sorted(map(tuple, ranks[0]["stored"])) == sorted(map(tuple, ranks[1]["stored"])) == stored
        seen = sorted(tuple(row) for r in ranks for row in r["seen"])
        assert seen == stored  # each item once across the two trainers
        assert all(r["seen"] for r in ranks)
        # the ranks detached: the actor still serves its owner
        assert len(rb) == n, "buffer lost items after the ranks left"
    finally:
        rb.close()
