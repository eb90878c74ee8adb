"""Resume after the first pass: with ``num_passes=None`` a trainer's whole run is one
Transformers epoch over successive buffer passes, so a checkpoint taken in a later pass
resumes with exactly the samples the uninterrupted run read next."""

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

from torchrl_trl import testing
from torchrl_trl.data import EpochPass, RowColumns, TorchRLBufferDataset
from torchrl_trl.online import BufferCheckpointCallback, load_buffer

N = 10  # items; batches of 4 rows: a pass is 2.5 steps


def _collate(rows):
    ids = torch.stack([torch.as_tensor(r["input_ids"]) for r in rows])
    return {"input_ids": ids, "labels": ids.clone(), "index": torch.as_tensor([r["index"] for r in rows])}


def _run(out, max_steps, resume=None, num_passes=None):
    from transformers import Trainer, TrainingArguments

    tok = testing.make_tokenizer()
    model = testing.make_policy(tok)
    rb = ReplayBuffer(storage=LazyTensorStorage(16))
    if resume is None:
        i = torch.arange(N)
        rb.extend(TensorDict({"input_ids": torch.stack([1 + i, torch.full_like(i, 5), torch.full_like(i, 6)], -1)}, [N]))
    else:
        load_buffer(rb, out / f"checkpoint-{resume}" / "torchrl_buffer")
    ds = TorchRLBufferDataset(rb, 4, keys=["input_ids"], format=RowColumns(index_column="index"),
                              reading=EpochPass(shuffle=True, seed=5, num_passes=num_passes))
    seen = []

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            seen.append(inputs.pop("index").tolist())
            return model(**inputs).loss

    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, use_cpu=True,
                             bf16=False, report_to=[], save_strategy="steps", save_steps=4,
                             remove_unused_columns=False, dataloader_num_workers=0, logging_steps=1)
    trainer = Recording(model=model, args=args, train_dataset=ds.as_hf_dataset(), data_collator=_collate,
                        callbacks=[BufferCheckpointCallback(rb)])
    trainer.train(resume_from_checkpoint=None if resume is None else str(out / f"checkpoint-{resume}"))
    return seen


@pytest.mark.timeout(120)
def test_resume_after_the_first_pass_gives_same_next_samples(tmp_path):
    # 6 steps = 24 rows: pass 0, pass 1, 4 rows of pass 2; checkpoint at step 4 lies in pass 1
    full = _run(tmp_path / "full", 6)
    rows = [i for b in full for i in b]
    assert len(rows) == 24
    assert sorted(rows[:N]) == sorted(rows[N : 2 * N]) == list(range(N))  # each pass reads every item once
    assert rows[:N] != rows[N : 2 * N]  # pass k is shuffled with epoch k
    assert _run(tmp_path / "cut", 4) == full[:4]
    resumed = _run(tmp_path / "cut", 6, resume=4)  # a fresh buffer, loaded from the checkpoint
    assert resumed == full[4:6]


def test_num_passes_bounds_an_iterator():
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend(TensorDict({"id": torch.arange(5)}, [5]))
    ds = TorchRLBufferDataset(rb, 2, keys=["id"], reading=EpochPass(shuffle=True, seed=1, num_passes=3))
    ids = [int(r["id"]) for r in ds]
    assert len(ds) == len(ids) == 15 and all(sorted(ids[k * 5 : k * 5 + 5]) == list(range(5)) for k in range(3))
    with pytest.raises(TypeError, match="num_passes=None"):
        len(TorchRLBufferDataset(rb, 2, keys=["id"], reading=EpochPass(num_passes=None)))
    with pytest.raises(ValueError, match="num_passes"):
        EpochPass(num_passes=0)
    # the map-style snapshot is one pass, whatever num_passes says
    snap = TorchRLBufferDataset(rb, 2, keys=["id"], reading=EpochPass(num_passes=None)).to_hf_dataset()
    assert sorted(snap["id"]) == list(range(5))
