"""TorchRLBufferDataset throughput against upstream and hand-written baselines.

    python benchmarks/bench_dataset.py            # quick (a couple of minutes on 2 cores)
    python benchmarks/bench_dataset.py --scale 200000   # the full 200,000 x 512 scale run

Prints samples/s and ratios, all measured in this process:
1. fixed length (T=256, 4096 rows, batch 256): upstream
   ``torchrl.modules.llm.trl_interop.TorchRLBufferDataset`` vs ours, each through
   ``as_hf_dataset()`` into a trainer-style DataLoader with TRL's collator (target >= 2x);
2. ragged rollouts (LazyStackStorage, per-sample lengths): ours vs a hand-written generator;
3. an SFT step fed from the buffer vs from the same rows in an in-memory ``datasets.Dataset``
   (target within 5%);
4. scale: an epoch (and a map-style snapshot) over a LazyMemmapStorage of ``--scale`` rows x
   512 tokens, printing peak RSS against the storage size.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack
from torch.utils.data import DataLoader
from torchrl.data import LazyMemmapStorage, LazyStackStorage, LazyTensorStorage, ReplayBuffer

from torchrl_trl.data import TorchRLBufferDataset


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def collator():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=0)


def drain(hf, batch_size=16, limit=None):
    """Rows/s through a trainer-style DataLoader + TRL's collator."""
    loader = DataLoader(hf, batch_size=batch_size, collate_fn=collator())
    n, t = 0, time.perf_counter()
    for batch in loader:
        n += batch["input_ids"].shape[0]
        if limit and n >= limit:
            break
    return n / (time.perf_counter() - t)


def fixed_length(rows=4096, t=256, batch=256):
    from datasets import IterableDataset
    from torchrl.modules.llm.trl_interop import TorchRLBufferDataset as Upstream

    rb = ReplayBuffer(storage=LazyTensorStorage(rows))
    rb.extend(TensorDict({"input_ids": torch.randint(1, 100, (rows, t))}, [rows]))
    nb = rows // batch
    up = Upstream(rb, batch, keys=["input_ids"], num_batches=nb).as_hf_dataset()
    ours = TorchRLBufferDataset(rb, batch, keys=["input_ids"], num_batches=nb).as_hf_dataset()
    assert isinstance(ours, IterableDataset)
    drain(up, limit=512), drain(ours, limit=512)  # warm-up
    r_up, r_ours = drain(up), drain(ours)
    print(f"[fixed T={t} rows={rows} batch={batch}] upstream {r_up:,.0f} rows/s | ours {r_ours:,.0f} rows/s "
          f"| ratio {r_ours / r_up:.2f}x (target >= 2x)")


def ragged(rows=4096, batch=256):
    set_list_to_stack(True).set()
    g = torch.Generator().manual_seed(0)
    rb = ReplayBuffer(storage=LazyStackStorage(rows))
    lengths = torch.randint(32, 256, (rows,), generator=g)
    tds = []
    for n in lengths.tolist():
        p = int(n) // 3
        tds.append(TensorDict({"tokens": {"prompt": torch.randint(1, 100, (p,)), "response": torch.randint(1, 100, (int(n) - p,)),
                                          "full": torch.randint(1, 100, (int(n),))}}, []))
    rb.extend(lazy_stack(tds))

    def hand_written():  # what a user writes: index sample by sample
        for start in range(0, rows, batch):
            b = rb[torch.arange(start, min(start + batch, rows))]
            for i in range(b.batch_size[0]):
                s = b[i]
                p, r = s.get(("tokens", "prompt")), s.get(("tokens", "response"))
                yield {"input_ids": torch.cat([p, r]).tolist(), "completion_mask": [0] * len(p) + [1] * len(r)}

    from datasets import Features, IterableDataset, List, Value

    feats = Features({"input_ids": List(Value("int64")), "completion_mask": List(Value("int64"))})
    base = IterableDataset.from_generator(hand_written, features=feats)
    ours = TorchRLBufferDataset(rb, batch, format="sft_tokenized", mode="epoch").as_hf_dataset()
    r_base, r_ours = drain(base), drain(ours)
    print(f"[ragged rollouts rows={rows}] hand-written {r_base:,.0f} rows/s | ours {r_ours:,.0f} rows/s "
          f"| ratio {r_ours / r_base:.2f}x")


def sft_step(rows=512, t=64, steps=16):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from torchrl_trl import testing

    tok = testing.make_tokenizer()
    rb = ReplayBuffer(storage=LazyTensorStorage(rows))
    ids = torch.randint(5, 100, (rows, t))
    rb.extend(TensorDict({"input_ids": ids}, [rows]))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["in-memory Dataset", "buffer (epoch)", "in-memory Dataset ", "buffer (epoch) "]:
            if name.startswith("buffer"):
                ds = TorchRLBufferDataset(rb, 64, mode="epoch", columns={"input_ids": "input_ids"}).as_hf_dataset()
            else:
                ds = Dataset.from_dict({"input_ids": ids.tolist()})
            args = SFTConfig(output_dir=tmp, max_steps=steps, per_device_train_batch_size=8, use_cpu=True, bf16=False,
                             report_to=[], save_strategy="no", logging_steps=10_000, disable_tqdm=True)
            trainer = SFTTrainer(model=testing.make_policy(tok), args=args, train_dataset=ds, processing_class=tok)
            t0 = time.perf_counter()
            trainer.train()
            results.setdefault(name.strip(), []).append(steps / (time.perf_counter() - t0))
    base, ours = max(results["in-memory Dataset"]), max(results["buffer (epoch)"])
    print(f"[SFT step, tiny model, T={t}] in-memory Dataset {base:.1f} steps/s | buffer {ours:.1f} steps/s "
          f"| ratio {ours / base:.3f} (target >= 0.95)")


def scale(rows, t=512, batch=1024):
    with tempfile.TemporaryDirectory() as tmp:
        rb = ReplayBuffer(storage=LazyMemmapStorage(rows, scratch_dir=tmp))
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            rb.extend(TensorDict({"input_ids": torch.randint(1, 30_000, (n, t), dtype=torch.int32)}, [n]))
        storage_mb = rows * t * 4 / 2**20
        rss0 = rss_mb()
        ds = TorchRLBufferDataset(rb, batch, mode="epoch", shuffle=True, columns={"input_ids": "input_ids"})
        t0 = time.perf_counter()
        n = sum(1 for _ in ds.as_hf_dataset())
        dt = time.perf_counter() - t0
        assert n == rows
        rss1 = rss_mb()
        t0 = time.perf_counter()
        snap = ds.to_hf_dataset(cache_dir=os.path.join(tmp, "hf"))
        dts = time.perf_counter() - t0
        assert len(snap) == rows
        print(f"[scale {rows:,} x {t} memmap, storage {storage_mb:,.0f} MiB] epoch {rows / dt:,.0f} rows/s, "
              f"map snapshot {rows / dts:,.0f} rows/s | peak RSS before {rss0:,.0f} MiB, after epoch {rss1:,.0f} MiB, "
              f"after snapshot {rss_mb():,.0f} MiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=20_000, help="rows of the 512-token memmap epoch (full: 200000)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["fixed", "ragged", "sft", "scale"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    if "fixed" not in args.skip:
        fixed_length()
    if "ragged" not in args.skip:
        ragged()
    if "sft" not in args.skip:
        sft_step()
    if "scale" not in args.skip:
        scale(args.scale)


if __name__ == "__main__":
    main()
