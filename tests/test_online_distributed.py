"""Two trainer processes (torchrun, gloo) read one buffer on disk (LazyMemmapStorage files
written by a producer) through real SFTTrainers: every item once, nothing twice."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, ReplayBuffer

from torchrl_trl.online import save_buffer

# a torchrun launch of two trainer processes
pytestmark = pytest.mark.distributed


@pytest.mark.timeout(300)
def test_two_trainer_processes_share_a_memmap_buffer(tmp_path):
    # the producer (a collector in real use) writes, then the buffer is saved to disk
    n = 22
    rb = ReplayBuffer(storage=LazyMemmapStorage(64, scratch_dir=tmp_path / "scratch"))
    i = torch.arange(n)
    ids = torch.stack([1 + i // 10, 1 + i % 10, torch.full_like(i, 5), torch.full_like(i, 6)], -1)
    rb.extend(TensorDict({"input_ids": ids}, [n]))
    save_buffer(rb, tmp_path / "buffer")

    script = Path(__file__).with_name("online_dist_memmap.py")
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path / "buffer"),
         str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world_size"] == 2 and r["steps"] == 3 and r["len"] == n and r["memmap"] for r in ranks)
    assert ranks[0]["stored"] == ranks[1]["stored"] == ids.tolist()
    seen = sorted(tuple(row) for r in ranks for row in r["seen"])
    assert seen == sorted(map(tuple, ids.tolist()))  # each item once across the two trainers
    assert all(r["seen"] for r in ranks)
