"""Run under ``torchrun --nproc_per_node 2``: read one epoch through a real SFTTrainer's
dataloader (accelerate-prepared) and write what this rank received to ``argv[1]``."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

from torchrl_trl import testing
from torchrl_trl.data import EpochPass, Sharding, TorchRLBufferDataset


def buffer(n):
    rb = ReplayBuffer(storage=LazyTensorStorage(n))
    i = torch.arange(n)
    ids = torch.stack([1 + i // 10, 1 + i % 10, torch.full_like(i, 5), torch.full_like(i, 6)], -1)
    rb.extend(TensorDict({"input_ids": ids}, [n]))
    return rb


def received(n, num_shards, tmp):
    from trl import SFTConfig, SFTTrainer

    tok = testing.make_tokenizer()
    model = testing.make_policy(tok)
    ds = TorchRLBufferDataset(buffer(n), 4, reading=EpochPass(shuffle=True, seed=1),
                              keys=["input_ids"], sharding=Sharding(num_shards=num_shards))
    args = SFTConfig(output_dir=tmp, max_steps=1, per_device_train_batch_size=4, use_cpu=True, bf16=False,
                     report_to=[], save_strategy="no", ddp_backend="gloo", dataloader_num_workers=0)
    assert torch.distributed.is_initialized()  # as_hf_dataset() below agrees the pass length over ranks
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    rows = []
    for batch in trainer.get_train_dataloader():
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            rows.append(ids[mask.bool()].tolist())
    return rows


if __name__ == "__main__":
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    result = {
        "world_size": int(os.environ["WORLD_SIZE"]),
        "sharded": received(26, None, out + f".tmp{rank}"),  # accelerate shards the HF iterable
        "iterable_shard": received(24, 1, out + f".tmp{rank}"),  # one shard: IterableDatasetShard
        # a collector wrote 3 more items before rank 1 started: the pass is what rank 0 saw
        "live": received(26 + 3 * rank, None, out + f".tmp{rank}"),
        "stored": buffer(26)[:]["input_ids"].tolist(),
    }
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
