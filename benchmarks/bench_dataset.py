"""TorchRLBufferDataset throughput against upstream and hand-written baselines.

    python benchmarks/bench_dataset.py            # quick (a couple of minutes on 2 cores)
    python benchmarks/bench_dataset.py --scale 200000   # the full 200,000 x 512 scale run

Prints samples/s and ratios, all measured in this process:
1. fixed length (T=256, 4096 rows, batch 256): upstream
   ``torchrl.modules.llm.trl_interop.TorchRLBufferDataset`` vs ours, each through
   ``as_hf_dataset()`` into a trainer-style DataLoader with TRL's collator (target >= 1x),
   and ours through ``datasets``' public ``IterableDataset.from_generator`` instead of our
   typed examples iterable (what ``torchrl_trl._compat`` keeps the private path for);
   next to the ceiling of that path: the same DataLoader + collator over a Python list of
   ready rows of each row type (a dataset costing nothing); then through
   ``SFTTrainer.get_train_dataloader()`` (target >= 3x);
2. ragged rollouts (LazyStackStorage, per-sample lengths): ours vs a hand-written generator
   (upstream raises on these rows);
3. an SFT step fed from the buffer vs from the same rows in an in-memory ``datasets.Dataset``
   (target within 5%);
4. scale: an epoch (and a map-style snapshot) over a LazyMemmapStorage of ``--scale`` rows x
   512 tokens, printing peak RSS against the storage size.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack
from torch.utils.data import DataLoader
from torchrl.data import LazyMemmapStorage, LazyStackStorage, LazyTensorStorage, ReplayBuffer

from torchrl_trl.data import EpochPass, RowColumns, TorchRLBufferDataset


# Token ids drawn from a real vocabulary's range: Python keeps one shared object for each int
# below 257 only, so ids below that would hide what Python-list rows cost to build.
VOCAB = 32_000
#: one raw column, read as token rows (as upstream's tokenized format)
IDS = RowColumns(columns={"input_ids": "input_ids"})


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def collator():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=0)


def drain(hf, batch_size=16, limit=None):
    """Rows/s through a trainer-style DataLoader + TRL's collator (no trainer preprocessing)."""
    loader = DataLoader(hf, batch_size=batch_size, collate_fn=collator())
    return _rate(loader, limit)


def _rate(loader, limit=None):
    n, t = 0, time.perf_counter()
    for batch in loader:
        n += batch["input_ids"].shape[0]
        if limit and n >= limit:
            break
    return n / (time.perf_counter() - t)


def sft_loader(hf, tmp, batch_size=16):
    """The DataLoader ``SFTTrainer`` itself builds from ``hf``: its dataset preparation
    (labels, truncation to ``max_length``, filtering), accelerate's loader, its collator."""
    from trl import SFTConfig, SFTTrainer

    from torchrl_trl import testing

    tok = testing.make_tokenizer()
    args = SFTConfig(
        output_dir=tmp, max_steps=1, per_device_train_batch_size=batch_size, use_cpu=True,
        bf16=False, report_to=[], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    model = testing.make_policy(tok)
    trainer = SFTTrainer(model=model, args=args, train_dataset=hf, processing_class=tok)
    return trainer.get_train_dataloader()


def compare(named_fns, repeats):
    """Run each ``fn() -> rate`` once as warm-up, then ``repeats`` times interleaved (so
    the machine's load hits every side alike). Returns ``{name: median rate}`` and, for
    each name, the median of its per-round ratio against the first one."""
    for fn in named_fns.values():
        fn()
    rates = {name: [] for name in named_fns}
    for _ in range(repeats):
        for name, fn in named_fns.items():
            rates[name].append(fn())
    base = next(iter(rates))
    med = {name: statistics.median(r) for name, r in rates.items()}
    ratio = {
        name: statistics.median([a / b for a, b in zip(r, rates[base])])
        for name, r in rates.items()
    }
    return med, ratio


def _line(title, med, ratio, target=None):
    base = next(iter(med))
    parts = [f"{name} {rate:,.0f} rows/s" for name, rate in med.items()]
    ratios = " | ".join(f"{name}/{base} {ratio[name]:.2f}x" for name in list(med)[1:])
    goal = f" (target {target})" if target else ""
    print(f"[{title}] " + " | ".join(parts) + f" | {ratios}" + goal)


def from_generator(ds):
    """``ds``'s Hugging Face rows through ``IterableDataset.from_generator`` (the public
    path: ``datasets`` encodes every row against the features), one shard."""
    from datasets import IterableDataset

    from torchrl_trl.data.arrow import _rows
    from torchrl_trl.data.arrow import HFBatches

    source = HFBatches(ds._reader, ds._reading, ds._columns, 1)

    def rows(shard_ids):
        for _, cols in source(shard_ids):
            yield from _rows(cols)

    return IterableDataset.from_generator(rows, features=ds.features, gen_kwargs={"shard_ids": [0]})


def fixed_length(rows=4096, t=256, batch=256, repeats=5):
    import warnings

    from datasets import IterableDataset
    from torchrl.modules.llm.trl_interop import TorchRLBufferDataset as Upstream

    warnings.filterwarnings("ignore", message="To copy construct from a tensor")
    rb = ReplayBuffer(storage=LazyTensorStorage(rows))
    rb.extend(TensorDict({"input_ids": torch.randint(1, VOCAB, (rows, t))}, [rows]))
    nb = rows // batch
    up = Upstream(rb, batch, keys=["input_ids"], num_batches=nb).as_hf_dataset()
    ds = TorchRLBufferDataset(rb, batch, keys=["input_ids"], num_batches=nb)
    ours, ours_t, public = ds.as_hf_dataset(), ds.as_hf_dataset(tensors=True), from_generator(ds)
    assert isinstance(ours, IterableDataset) and ours.column_names == ["input_ids"]
    med, ratio = compare({
        "upstream": lambda: drain(up), "ours": lambda: drain(ours),
        "ours(tensors=True)": lambda: drain(ours_t),
        "ours via from_generator": lambda: drain(public),
    }, repeats)  # fmt: skip
    _line(f"fixed T={t} rows={rows} batch={batch}, DataLoader + TRL collator", med, ratio, ">= 1x")
    collator_floor(rows, t, up, repeats)
    with tempfile.TemporaryDirectory() as tmp:
        up_dl, ours_dl = sft_loader(up, tmp), sft_loader(ours, tmp)
        med, ratio = compare(
            {"upstream": lambda: _rate(up_dl, 1024), "ours": lambda: _rate(ours_dl, 1024)}, repeats
        )
    title = f"fixed T={t}, SFTTrainer.get_train_dataloader() (its dataset preparation + collator)"
    _line(title, med, ratio, ">= 3x")


def collator_floor(rows, t, up, repeats):
    """The DataLoader + TRL collator path on a dataset that costs nothing: a Python list of
    ready rows (``rows`` x ``t`` ids) of each row type, against upstream. Its ratio is
    the most any dataset yielding that row type can reach on this path."""
    from torchrl_trl.data.features import array_rows

    ids = torch.randint(1, VOCAB, (rows, t))
    kinds = {"tensor rows": list(ids.unbind(0)), "numpy rows": list(ids.numpy()),
             "ArrayRow lists": array_rows(ids), "plain lists": ids.tolist()}
    fns = {"upstream": lambda: drain(up)}
    for name, values in kinds.items():
        ready = [{"input_ids": v} for v in values]
        fns[f"free {name}"] = lambda ready=ready: drain(ready)
    med, ratio = compare(fns, repeats)
    title = f"ceiling: DataLoader + TRL collator on ready rows (a dataset costing nothing), T={t}"
    _line(title, med, ratio)


def ragged(rows=4096, batch=256, repeats=5):
    set_list_to_stack(True).set()
    g = torch.Generator().manual_seed(0)
    rb = ReplayBuffer(storage=LazyStackStorage(rows))
    lengths = torch.randint(32, 256, (rows,), generator=g)
    tds = []
    for n in lengths.tolist():
        p = int(n) // 3
        tokens = {
            "prompt": torch.randint(1, VOCAB, (p,)), "response": torch.randint(1, VOCAB, (int(n) - p,)),
            "full": torch.randint(1, VOCAB, (int(n),)),
        }  # fmt: skip
        tds.append(TensorDict({"tokens": tokens}, []))
    rb.extend(lazy_stack(tds))

    def hand_written():  # what a user writes: index sample by sample
        for start in range(0, rows, batch):
            b = rb[torch.arange(start, min(start + batch, rows))]
            for i in range(b.batch_size[0]):
                s = b[i]
                p, r = s.get(("tokens", "prompt")), s.get(("tokens", "response"))
                mask = [0] * len(p) + [1] * len(r)
                yield {"input_ids": torch.cat([p, r]).tolist(), "completion_mask": mask}

    from datasets import Features, IterableDataset, List, Value

    feats = Features({"input_ids": List(Value("int64")), "completion_mask": List(Value("int64"))})
    base = IterableDataset.from_generator(hand_written, features=feats)
    ours = TorchRLBufferDataset(rb, batch, format="sft_tokenized", reading="epoch").as_hf_dataset()
    assert next(iter(ours)) == next(iter(base))
    fns = {"hand-written": lambda: drain(base), "ours": lambda: drain(ours)}
    med, ratio = compare(fns, repeats)
    _line(f"ragged rollouts rows={rows}, DataLoader + TRL collator", med, ratio, ">= 2x")
    from torchrl.modules.llm.trl_interop import TorchRLBufferDataset as Upstream

    try:  # no upstream number to compare with: it cannot read these rows
        next(iter(Upstream(rb, batch, keys=[("tokens", "prompt")]).as_hf_dataset()))
        print("    upstream reads ragged rollouts now: compare against it here")
    except RuntimeError as err:
        print(f"    upstream on the same buffer: RuntimeError ({str(err).split('.')[0]})")


def sft_step(rows=512, t=64, steps=16, repeats=3):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from torchrl_trl import testing

    tok = testing.make_tokenizer()
    rb = ReplayBuffer(storage=LazyTensorStorage(rows))
    ids = torch.randint(5, 100, (rows, t))
    rb.extend(TensorDict({"input_ids": ids}, [rows]))
    with tempfile.TemporaryDirectory() as tmp:

        def run(kind):
            if kind == "buffer":
                ds = TorchRLBufferDataset(rb, 64, reading="epoch", format=IDS).as_hf_dataset()
            else:
                ds = Dataset.from_dict({"input_ids": ids.tolist()})
            args = SFTConfig(
                output_dir=tmp, max_steps=steps, per_device_train_batch_size=8, use_cpu=True,
                bf16=False, report_to=[], save_strategy="no", logging_steps=10_000,
                disable_tqdm=True, seed=0,
            )  # fmt: skip
            torch.manual_seed(0)
            model = testing.make_policy(tok)
            trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
            t0 = time.perf_counter()
            trainer.train()
            return steps / (time.perf_counter() - t0)

        fns = {"in-memory Dataset": lambda: run("memory"), "buffer (epoch)": lambda: run("buffer")}
        med, ratio = compare(fns, repeats)
    print(
        f"[SFT step, tiny model, T={t}, {steps} steps of 8] in-memory Dataset "
        f"{med['in-memory Dataset']:.1f} steps/s | buffer {med['buffer (epoch)']:.1f} steps/s | "
        f"ratio {ratio['buffer (epoch)']:.3f} (target >= 0.95)"
    )


def scale(rows, t=512, batch=1024):
    with tempfile.TemporaryDirectory() as tmp:
        rb = ReplayBuffer(storage=LazyMemmapStorage(rows, scratch_dir=tmp))
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            ids = torch.randint(1, VOCAB, (n, t), dtype=torch.int32)
            rb.extend(TensorDict({"input_ids": ids}, [n]))
        storage_mb = rows * t * 4 / 2**20
        rss0 = rss_mb()
        ds = TorchRLBufferDataset(
            rb, batch, reading=EpochPass(shuffle=True), format=IDS
        )
        t0 = time.perf_counter()
        n = sum(1 for _ in ds.as_hf_dataset())
        dt = time.perf_counter() - t0
        assert n == rows
        rss1 = rss_mb()
        t0 = time.perf_counter()
        snap = ds.to_hf_dataset(cache_dir=os.path.join(tmp, "hf"))
        dts = time.perf_counter() - t0
        assert len(snap) == rows
        print(f"[scale {rows:,} x {t} memmap, storage {storage_mb:,.0f} MiB] epoch "
              f"{rows / dt:,.0f} rows/s, map snapshot {rows / dts:,.0f} rows/s | peak RSS before "
              f"{rss0:,.0f} MiB, after epoch {rss1:,.0f} MiB, "
              f"after snapshot {rss_mb():,.0f} MiB")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=int, default=20_000,
                        help="rows of the 512-token memmap epoch (full: 200000)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["fixed", "ragged", "sft", "scale"])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: on a shared 2-core machine, more threads "
                             "oversubscribe the cores and small tensor ops get 10-30x slower; "
                             "DataLoader workers also use 1)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved repeats per comparison (median reported)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "fixed" not in args.skip:
        fixed_length(repeats=args.repeats)
    if "ragged" not in args.skip:
        ragged(repeats=args.repeats)
    if "sft" not in args.skip:
        sft_step(repeats=max(1, args.repeats // 2 + 1))
    if "scale" not in args.skip:
        scale(args.scale)


if __name__ == "__main__":
    main()
