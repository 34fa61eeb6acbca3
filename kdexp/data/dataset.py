"""`prepare()`: config -> tokenizer + megatron GPTDatasets (train, validation); `batches()`: data-parallel,
resumable micro-batches from one of them.

Two sources of token files (``data.name``; kdexp.data.sources):
  * ``stdlib`` -- the embedded corpus (kdexp.data.corpus): a byte-level BPE is trained on its train split
    (unless a checkpoint tokenizer is given), both splits are tokenized into indexed datasets, all cached;
  * ``indexed`` -- existing megatron <prefix>.bin/.idx files (``data.prefixes``: prefixes, or megatron's
    ["weight", "prefix", ...] list) with the checkpoint's tokenizer (``data.tokenizer``); train/validation
    come from ``data.split`` or from separate ``data.valid_prefixes``.

`data_cfg` is the ``data`` node of the schema (kdexp.config.DataConfig, or its OmegaConf form): its values are
read as they are, the schema holds every default.

Samples and read order: ``data.seed`` alone fixes the samples (megatron's document shuffle and the windows cut from
it: one epoch of the training split, whatever the run's length), so an offline teacher cache indexed by sample serves
every replicate; the trainer's seed only picks the order they are read in (`ReadOrder`: each epoch a permutation of
the fixed windows), as its initialisation, dropout and draws.

Caches: one process per node builds the tokenizer and token files (kdexp.data.cache: verified manifests,
one builder under a lock, atomic directories), everyone waits at a barrier and reads. megatron-core's
GPTDataset then builds its own document/sample/shuffle index cache under <cache>/gpt_index: global rank 0
builds it (holding a file lock so that concurrent jobs never read half-written .npy files) and the other ranks
read it, which, as in Megatron-LM, needs the cache directory on a filesystem all nodes share for multi-node runs.

megatron's sample index comes from its C++ `helpers_cpp` extension, which the megatron-core wheel ships
compiled (megatron/core/datasets/helpers_cpp.*.so), so nothing is compiled at run time; `_check_helpers`
fails early with the fix if an install lacks it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kdexp.data import cache as _cache
from kdexp.rules import ConfigError, is_int
from kdexp.data.sources import file_id, indexed_sources, stdlib_sources, train_valid_split
from kdexp.data.tokenizer import Tokenizer

__all__ = ["DataBundle", "ReadOrder", "prepare", "batches"]



@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train_ds: Any            # megatron GPTDataset (or BlendedDataset for weighted blends)
    val_ds: Any
    vocab_size: int          # embedding rows the models need (>= tokenizer.vocab_size)
    seq_length: int
    info: dict = field(default_factory=dict)   # paths and sizes, for logs
    fingerprint: str = ""    # sha256 naming the samples (tokenizer, token data, seq length, data.seed): cache keys
    source: str = ""         # sha256 naming the tokenizer + token data alone (any seq length or data.seed)
    seed: int = 0            # data.seed: the document shuffle and the windows

    def windows(self, positions: int) -> int:
        """How many training windows a stream of `positions` samples reads: the first min(positions, epoch) ones
        (`ReadOrder`), so a run's samples grow with its length and never depend on its read order."""
        return min(int(positions), len(self.train_ds))

    def read_order(self, positions: int, seed: int) -> "ReadOrder":
        """The training stream of a run reading `positions` samples in the order trainer.seed `seed` draws."""
        return ReadOrder(self.train_ds, windows=self.windows(positions), seed=seed, positions=positions)


class ReadOrder:
    """A training stream over fixed windows: position p reads window ``order(p)`` of the first `windows` windows of
    `ds` (megatron's, fixed by data.seed); epoch e = p // windows reads them in the permutation drawn from (seed, e).
    Indexable like a dataset (``len`` = positions); each item carries ``sample_index``, the window read, which keys an
    offline teacher cache. The permutation of an epoch is drawn once and kept (int64, 8 bytes per window)."""

    def __init__(self, ds, *, windows: int, seed: int, positions: int):
        _check_positive("windows", windows)
        if windows > len(ds):
            raise ValueError(f"windows={windows} exceeds the dataset's {len(ds)} samples")
        self.ds, self.n, self.seed, self.positions = ds, int(windows), int(seed), int(positions)
        self._perm: dict[int, "np.ndarray"] = {}

    def __len__(self) -> int:
        return self.positions

    def order(self, p: int) -> int:
        epoch = p // self.n
        if epoch not in self._perm:
            if len(self._perm) > 1:  # a stream moves forward: keep the current and the next epoch only
                self._perm.pop(min(self._perm))
            self._perm[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return int(self._perm[epoch][p % self.n])

    def __getitem__(self, p: int) -> dict:
        w = self.order(int(p))
        return {**self.ds[w], "sample_index": w}



def _check_helpers() -> None:
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            "megatron-core's compiled dataset helpers (megatron.core.datasets.helpers_cpp) are missing; "
            "reinstall megatron-core from a wheel, or build them with "
            "`python -c 'from megatron.core.datasets.utils import compile_helpers; compile_helpers()'` "
            "(needs g++, python headers and pybind11)") from err


def _check_positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


# ---------------------------------------------------------------------------------------------------- size check

def _passes(ds) -> list:
    """(megatron dataset, tokens in one pass over it) for a split's GPTDataset, or each of a blend's."""
    parts = getattr(ds, "datasets", None) or [ds]
    return [(p, int(p.dataset.sequence_lengths[p.indices].sum())) for p in parts]


def _fix(data_cfg, split: str) -> str:
    """Which data keys make a split bigger, with their values."""
    if data_cfg.name == "stdlib":
        share = "data.val_fraction" if split == "validation" else "data.max_chars"
        return (f"raise {share}={getattr(data_cfg, share.split('.')[1])!r}" +
                (f" or data.max_chars={data_cfg.max_chars!r}" if split == "validation" else "") +
                (f" or lift data.max_documents={data_cfg.max_documents!r}" if data_cfg.max_documents else ""))
    keys = "data.valid_prefixes" if split == "validation" and data_cfg.valid_prefixes else "data.prefixes"
    return f"give more data in {keys}" + ("" if data_cfg.valid_prefixes else f" or change data.split={data_cfg.split!r}")


def _check_enough(train_ds, val_ds, seq_length: int, data_cfg) -> None:
    """ConfigError (exit 2, one line) when a split cannot fill one sample of `seq_length` + 1 tokens from one pass
    over its documents: megatron would repeat the same text inside every sample (a silent wrong job), or give no
    sample at all. Known only once the corpus is tokenized, so checked here, before any model is built. (A run
    longer than the training split's epoch reads it again, in another order: `ReadOrder`.)"""
    need = seq_length + 1  # a sample: seq_length inputs and the label of the last one
    splits = (("training", train_ds), ("validation", val_ds))
    passes = [(split, part, tokens) for split, ds in splits if ds is not None for part, tokens in _passes(ds)]
    if passes:
        split, part, tokens = min(passes, key=lambda p: p[2])
        if tokens < need:
            where = "" if data_cfg.name == "stdlib" else f" ({part.dataset_path})"
            raise ConfigError(f"data too small for trainer.seq_length={seq_length}: the {split} split{where} holds "
                              f"{tokens} tokens, fewer than one sample ({need} tokens), so every sample would repeat "
                              f"the same text; {_fix(data_cfg, split)}, or lower trainer.seq_length to at most "
                              f"{max(tokens - 1, 1)}")
    for split, ds in splits:
        if ds is None or len(ds) == 0:
            raise ConfigError(f"data too small for trainer.seq_length={seq_length}: the {split} data gives 0 "
                              f"samples (needs 1); {_fix(data_cfg, split)}, or lower trainer.seq_length")


# ---------------------------------------------------------------------------------------------------- prepare

@contextlib.contextmanager
def _single_process_group(needed: bool):
    """A throw-away 1-process gloo group while megatron builds a weighted blend outside a distributed run.

    megatron-core 0.16's BlendedDataset calls torch.distributed.get_rank() on a cache miss even when no
    process group exists (GPTDataset checks is_initialized() first); the trainer always has a group, this
    covers standalone use. An in-memory HashStore needs no port.
    """
    if not needed:
        yield
        return
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        tdist.destroy_process_group()


def prepare(data_cfg, *, seq_length: int, cache_dir=None, seed: int, train_samples: int,
            val_samples: int | None, tokenizer_path=None) -> DataBundle:
    """Build (or load from cache) the tokenizer and the train/validation GPTDatasets; see module doc.

    The training split is one epoch of windows, fixed by `seed` (data.seed) and `seq_length` alone; a run reads
    `train_samples` positions of it through `DataBundle.read_order` (a weighted blend, which megatron cannot size
    otherwise, is built for `train_samples`). `val_samples` is the minimum number of validation samples (megatron
    repeats the data in shuffled epochs to reach it; ``None`` = exactly one epoch). `tokenizer_path` is the checkpoint directory whose tokenizer to use (for data.name=stdlib it
    replaces the trained BPE; for indexed, data.tokenizer wins when both are set). Call it on every rank.
    """
    _check_positive("seq_length", seq_length)
    _check_positive("train_samples", train_samples)
    _check_positive("val_samples", val_samples, allow_none=True)
    name = data_cfg.name
    root = Path(cache_dir).expanduser() if cache_dir is not None else _cache.cache_dir()
    _check_helpers()
    if name == "stdlib":
        tokenizer, blend, blend_per_split, vocab, info = stdlib_sources(data_cfg, root, tokenizer_path)
        split = None
        data_id = Path(info["tokens"]).name  # itself a hash of corpus, tokenizer and split
    elif name == "indexed":
        tokenizer, blend, blend_per_split, vocab, info = indexed_sources(data_cfg, tokenizer_path)
        split = train_valid_split(data_cfg.split, blend) if blend is not None else None
        data_id = [split, [(p, w, file_id(p)) for b in ([blend] if blend else blend_per_split[:2])
                           for p, w in zip(b[0], b[1] or [None] * len(b[0]))]]
    else:
        raise ValueError(f"data.name must be 'stdlib' or 'indexed', got {name!r}")

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    index_cache = root / "gpt_index"
    config = GPTDatasetConfig(
        random_seed=int(seed),
        sequence_length=int(seq_length),
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache=str(index_cache),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # The trainer builds one causal mask for the batch; a [1, s, s] mask per sample is wasted memory.
        create_attention_mask=False,
    )
    weighted = any(b is not None and b[1] is not None for b in ([blend] if blend else blend_per_split or []))
    if weighted and val_samples is None:  # megatron cannot size a weighted blend without a sample count
        raise ValueError("val_samples must be set (not None) when data.prefixes has weights")
    # No test split is used: size 0 keeps megatron's weighted-blend bookkeeping happy. The training split is one epoch
    # (None): its windows then do not move with the run's length (megatron shuffles the documents of all its epochs
    # together, so two epochs cut other windows than one).
    sizes = [int(train_samples) if weighted else None, None if val_samples is None else int(val_samples), 0]
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
    dist = _cache._dist()
    if dist is not None and dist.get_rank() != 0:
        train_ds, val_ds, _ = builder.build()
    else:
        with _cache.file_lock(index_cache / ".lock"), _single_process_group(weighted and dist is None):
            train_ds, val_ds, _ = builder.build()
    _check_enough(train_ds, val_ds, seq_length, data_cfg)
    info.update(train_samples=len(train_ds), val_samples=len(val_ds), gpt_index=str(index_cache))
    source = _cache.cache_key({"tokenizer": tokenizer.sha256, "eod": tokenizer.eod, "data": data_id})
    fingerprint = _cache.cache_key({"source": source, "seq_length": int(seq_length), "seed": int(seed),
                                    "train_samples": len(train_ds)})  # a weighted blend's size moves its windows
    return DataBundle(tokenizer, train_ds, val_ds, int(vocab), int(seq_length), info, fingerprint, source, int(seed))


# ---------------------------------------------------------------------------------------------------- batches

def batches(ds, *, micro_batch_size: int, dp_rank: int, dp_size: int, start_sample: int = 0,
            ) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of `ds` for data-parallel rank `dp_rank` of `dp_size`, from global sample `start_sample`.

    The global stream is ds[start_sample], ds[start_sample + 1], ... (a `ReadOrder` for the training stream, or a
    megatron dataset read in its own order). Step t's global batch is the next micro_batch_size * dp_size samples; rank r takes the r-th
    contiguous slice of micro_batch_size. So resuming after `k` consumed samples is ``start_sample=k``, and
    every rank yields the same number of batches (the last incomplete global batch is dropped).
    Each batch: tokens, labels (tokens shifted by one), position_ids [b, s] long, loss_mask [b, s] float and
    sample_index [b] long (the samples read: the window a `ReadOrder` item names, else the index itself).
    """
    _check_positive("micro_batch_size", micro_batch_size)
    _check_positive("dp_size", dp_size)
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be an int in [0, {dp_size}), got {dp_rank!r}")
    if not isinstance(start_sample, int) or start_sample < 0:
        raise ValueError(f"start_sample must be an int >= 0, got {start_sample!r}")
    global_batch = micro_batch_size * dp_size
    total = len(ds)
    first = start_sample + dp_rank * micro_batch_size
    while first - dp_rank * micro_batch_size + global_batch <= total:
        items = [ds[i] for i in range(first, first + micro_batch_size)]
        yield {
            "tokens": torch.stack([it["tokens"] for it in items]).long(),
            "labels": torch.stack([it["labels"] for it in items]).long(),
            "loss_mask": torch.stack([it["loss_mask"] for it in items]).float(),
            "position_ids": torch.stack([it["position_ids"] for it in items]).long(),
            # the samples' ids: where an offline teacher cache (kdexp.teacher) keeps their records
            "sample_index": torch.tensor([it.get("sample_index", i) for i, it in zip(range(first, first +
                                                                                           micro_batch_size), items)],
                                         dtype=torch.long),
        }
        first += global_batch
