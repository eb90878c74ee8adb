"""What each torchrun rank of the online distributed tests does with its buffer: train a
real SFTTrainer for one epoch pass from it and report what the trainer received."""

import os


def train_one_pass(rb, out: str, steps: int = 3) -> dict:
    """Train ``steps`` SFT steps (22 items, 8 shards: 11 per rank -> 3 batches of <= 4) from
    ``rb`` and return ``{"world_size", "seen", "steps", "stored", "len"}``."""
    from trl import SFTConfig, SFTTrainer

    from torchrl_trl import testing
    from torchrl_trl.data import EpochPass, TorchRLBufferDataset

    rank = int(os.environ["RANK"])
    tok = testing.make_tokenizer()
    model = testing.make_policy(tok)
    ds = TorchRLBufferDataset(rb, 4, reading=EpochPass(shuffle=True, seed=1), keys=["input_ids"])
    seen = []

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, *a, **k):
            for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"]):
                seen.append(ids[mask.bool()].tolist())
            return super().compute_loss(model, inputs, *a, **k)

    args = SFTConfig(output_dir=out + f".tmp{rank}", max_steps=steps, per_device_train_batch_size=4, use_cpu=True,
                     bf16=False, report_to=[], save_strategy="no", ddp_backend="gloo", dataloader_num_workers=0,
                     logging_steps=1)
    trainer = Recording(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    trainer.train()
    return {"world_size": int(os.environ["WORLD_SIZE"]), "seen": seen, "steps": trainer.state.global_step,
            "stored": rb[:]["input_ids"].tolist(), "len": len(rb)}
