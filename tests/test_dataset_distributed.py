"""Exactly-once epoch reads across processes: 2 ranks (gloo) through a real SFTTrainer
dataloader, and spawned DataLoader workers beside a live writer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from torchrl_trl.data import EpochPass, RowColumns, TorchRLBufferDataset
from test_dataset_inputs import _Writer, _assert_one_pass, _ids_buffer, _slow, _xs

# torchrun ranks and spawned DataLoader worker processes
pytestmark = pytest.mark.distributed


def test_two_processes_read_each_item_once(tmp_path):
    script = Path(__file__).with_name("dist_sft_epoch.py")
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == 2
    stored = sorted(map(tuple, ranks[0]["stored"]))
    # the HF iterable's shards split over ranks: every item once, nothing twice
    seen = sorted(tuple(r) for rank in ranks for r in rank["sharded"])
    assert seen == stored
    assert all(rank["sharded"] for rank in ranks)  # both ranks got data
    # one shard -> accelerate's IterableDatasetShard slices each global batch (24 = 3 x 8)
    seen = sorted(tuple(r) for rank in ranks for r in rank["iterable_shard"])
    assert seen == stored[:24] and len(set(seen)) == 24
    # rank 1's buffer holds 3 items more (written after rank 0 began): both read rank 0's 26
    seen = sorted(tuple(r) for rank in ranks for r in rank["live"])
    assert seen == stored


@pytest.mark.timeout(120)
def test_epoch_pass_beside_writer_with_spawned_workers():
    """TorchRL makes ``spawn`` the default start method: workers get the buffer pickled
    while no write is in progress (torch moves its storage to shared memory then)."""
    rb = _ids_buffer(40, capacity=1_000_000)  # never full: no item is overwritten
    ds = TorchRLBufferDataset(
        rb, 2, reading=EpochPass(shuffle=True), keys=["x"], format=RowColumns(columns={"slow": _slow})
    )
    with _Writer(rb, pause=0.001):
        loader = DataLoader(ds.as_hf_dataset(), batch_size=None, num_workers=2, multiprocessing_context="spawn")
        before = len(rb)
        _assert_one_pass(_xs(loader), before, len(rb))
