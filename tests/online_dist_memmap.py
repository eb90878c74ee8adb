"""Run under ``torchrun --nproc_per_node 2`` with ``argv[1]`` a buffer saved by
``torchrl_trl.online.save_buffer`` from a ``LazyMemmapStorage``: every rank maps the same
files, trains a real SFTTrainer for one epoch pass from it, and writes what it received
to ``argv[2].rank<r>.json``."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torchrl.data import LazyMemmapStorage, ReplayBuffer  # noqa: E402

from online_dist_common import train_one_pass  # noqa: E402
from torchrl_trl.online import load_buffer  # noqa: E402

if __name__ == "__main__":
    src, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    rb = ReplayBuffer(storage=LazyMemmapStorage(64))
    load_buffer(rb, src)  # copies the saved items into its own memmap storage
    result = train_one_pass(rb, out)
    result.update({"memmap": bool(rb.storage._storage.is_memmap())})
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
