"""Run under ``torchrun --nproc_per_node 2`` with ``argv[1:4]`` the Ray cluster's address,
a namespace and the name of a ``RayReplayBuffer`` actor another process made: every rank
attaches to that one actor, trains a real SFTTrainer for one epoch pass from it, and
writes what it received to ``argv[4].rank<r>.json``."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from torchrl_trl import testing  # noqa: E402
from torchrl_trl.data import TorchRLBufferDataset  # noqa: E402
from torchrl_trl.online.ray import connect_ray_replay_buffer  # noqa: E402

if __name__ == "__main__":
    import ray
    from trl import SFTConfig, SFTTrainer

    address, namespace, name, out = sys.argv[1:5]
    rank = int(os.environ["RANK"])
    rb = connect_ray_replay_buffer(name, address=address, namespace=namespace, timeout=30,
                                   ray_init_config={"log_to_driver": False})
    tok = testing.make_tokenizer()
    model = testing.make_policy(tok)
    ds = TorchRLBufferDataset(rb, 4, mode="epoch", shuffle=True, seed=1, columns={"input_ids": "input_ids"})
    seen = []

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, *a, **k):
            for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"]):
                seen.append(ids[mask.bool()].tolist())
            return super().compute_loss(model, inputs, *a, **k)

    steps = 3  # 22 items, 8 shards: ranks get 11 each -> 3 batches of <= 4
    args = SFTConfig(output_dir=out + f".tmp{rank}", max_steps=steps, per_device_train_batch_size=4, use_cpu=True,
                     bf16=False, report_to=[], save_strategy="no", ddp_backend="gloo", dataloader_num_workers=0,
                     logging_steps=1)
    trainer = Recording(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    trainer.train()
    result = {"world_size": int(os.environ["WORLD_SIZE"]), "seen": seen, "steps": trainer.state.global_step,
              "stored": rb[:]["input_ids"].tolist(), "len": len(rb), "type": type(rb).__name__,
              "ray_connected": ray.is_initialized()}
    rb.close()  # detaches; this process started its Ray connection, so it leaves Ray too
    result["ray_left"] = not ray.is_initialized()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
