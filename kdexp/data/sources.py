"""Where the token files come from: the embedded corpus (tokenizer trained and token shards built once, cached) or
existing megatron <prefix>.bin/.idx files named by the config. Each source returns what kdexp.data.dataset.prepare
hands to megatron's GPTDataset builder: (tokenizer, blend, blend_per_split, model vocabulary, info).

Both read the ``data`` node of the schema directly (kdexp.config.DataConfig holds every default).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from kdexp import distributed
from kdexp.config import tokens
from kdexp.data import cache as _cache
from kdexp.data.corpus import corpus_fingerprint, embedded_corpus
from kdexp.data.indexed import indexed_exists, read_indexed, tokenize_to_indexed
from kdexp.data.tokenizer import Tokenizer, train_bpe

__all__ = ["stdlib_sources", "indexed_sources", "train_valid_split", "file_id"]

log = logging.getLogger(__name__)

_FORMAT = 1  # bump when the layout of cached artefacts changes


def _plain(value: Any) -> Any:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    return value


def stdlib_sources(data_cfg, root: Path, tokenizer_path) -> tuple[Tokenizer, list, list, int, dict]:
    vocab_size = data_cfg.vocab_size
    train_docs, val_docs = embedded_corpus(data_cfg.max_chars, data_cfg.val_fraction, data_cfg.max_documents)

    tok_dir = None
    if tokenizer_path is None:
        import tokenizers

        tok_dir = _cache.cached_path("tokenizer", {
            "format": _FORMAT, "type": "bytelevel-bpe", "vocab_size": vocab_size, "min_frequency": 2,
            "corpus": corpus_fingerprint(train_docs), "tokenizers": tokenizers.__version__}, root)
    if _cache.is_node_builder() and tok_dir is not None:
        def build_tokenizer(tmp: Path) -> None:
            log.info("training a %d-token byte-level BPE on %d documents", vocab_size, len(train_docs))
            train_bpe([d.text for d in train_docs], vocab_size).save(tmp)
        _cache.build_cached(tok_dir, build_tokenizer)  # verified, rebuilt if corrupt, one builder per cache
    distributed.barrier()  # (1) tokenizer visible everywhere
    tokenizer = Tokenizer.from_dir(tok_dir if tok_dir is not None else tokenizer_path)

    tokens_dir = _cache.cached_path("stdlib_tokens", {
        "format": _FORMAT, "corpus": corpus_fingerprint(train_docs + val_docs), "tokenizer": tokenizer.sha256,
        "eod": tokenizer.eod, "train": [d.name for d in train_docs], "val": [d.name for d in val_docs]}, root)
    if _cache.is_node_builder():
        def build(tmp: Path) -> None:
            log.info("tokenizing %d + %d documents into indexed datasets", len(train_docs), len(val_docs))
            tokenize_to_indexed(tmp / "train", [d.text for d in train_docs], tokenizer)
            tokenize_to_indexed(tmp / "val", [d.text for d in val_docs], tokenizer)
        _cache.build_cached(tokens_dir, build)
    distributed.barrier()  # (2) token files visible everywhere

    # The model's embedding covers the configured vocabulary even if a tiny corpus gave BPE fewer merges.
    model_vocab = max(tokenizer.vocab_size, vocab_size if tok_dir is not None else 0)
    info = {"source": "stdlib", "tokenizer": str(tok_dir or tokenizer_path), "tokens": str(tokens_dir),
            "train_documents": len(train_docs), "val_documents": len(val_docs),
            "train_chars": sum(len(d.text) for d in train_docs), "val_chars": sum(len(d.text) for d in val_docs)}
    blend_per_split = [([str(tokens_dir / "train")], None), ([str(tokens_dir / "val")], None), None]
    return tokenizer, None, blend_per_split, model_vocab, info


# --------------------------------------------------------------------------------------------- indexed source

def _prefix_list(key: str, value: Any) -> list[str]:
    value = _plain(value)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"data.{key} must be a non-empty list of dataset prefixes, got {value!r}")
    return [str(v) for v in value]


def _blend(key: str, items: list[str]):
    """megatron blend from a list of prefixes or ["w1", "prefix1", "w2", "prefix2", ...]; checks the files."""
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes, weights = get_blend_from_list(items)
    for p in prefixes:
        if not indexed_exists(p):
            raise ValueError(f"data.{key}: no indexed dataset at {p!r} (need {p}.bin and {p}.idx)")
    if weights is not None and any(w <= 0 for w in weights):
        raise ValueError(f"data.{key}: blend weights must be > 0, got {weights}")
    return [os.path.abspath(os.path.expanduser(p)) for p in prefixes], weights


def file_id(prefix: str) -> list:
    """Cheap identity of an indexed dataset (its .idx size and mtime; .bin size) without reading it."""
    idx, bin_ = os.stat(f"{prefix}.idx"), os.stat(f"{prefix}.bin")
    return [idx.st_size, idx.st_mtime_ns, bin_.st_size]


def train_valid_split(split: Any, blend) -> str:
    """data.split ("969,30,1") -> megatron split string without the test share, checked against the data.

    kdexp has no test stage, so the test share is dropped (train and validation keep their ratio) rather than
    built. Every used share must hold at least one document of every prefix: megatron-core 0.16 loops forever
    on a split with no tokens (GPTDataset._get_num_epochs).
    """
    text = ",".join(str(v) for v in _plain(split)) if isinstance(_plain(split), (list, tuple)) else str(split)
    parts = re.findall(r"[.0-9]+", text)
    weights = [float(v) for v in parts] + [0.0] * (3 - len(parts))
    if len(parts) == 0 or len(weights) > 3 or weights[0] <= 0 or weights[1] <= 0:
        raise ValueError(f"data.split must be 'train,valid[,test]' with train > 0 and valid > 0, got {split!r}")
    train, valid = weights[0] / (weights[0] + weights[1]), weights[1] / (weights[0] + weights[1])
    for prefix in blend[0]:
        n = len(read_indexed(prefix))
        n_train = int(round(train * n))
        if n_train < 1 or n - n_train < 1:
            raise ValueError(f"data.split={split!r} leaves no document of {prefix!r} ({n} documents) for "
                             f"{'training' if n_train < 1 else 'validation'}; use a larger share or "
                             f"data.valid_prefixes")
    return f"{train!r},{valid!r},0"


def indexed_sources(data_cfg, tokenizer_path) -> tuple[Tokenizer, Any, Any, int, dict]:
    tok_path = data_cfg.tokenizer or tokenizer_path
    if tok_path is None:
        raise ValueError("data.tokenizer (a directory with tokenizer.json) is required for data.name=indexed")
    tokenizer = Tokenizer.from_dir(tok_path)
    blend = _blend("prefixes", _prefix_list("prefixes", data_cfg.prefixes))
    info = {"source": "indexed", "tokenizer": str(tok_path), "prefixes": blend[0]}
    valid = _blend("valid_prefixes", _prefix_list("valid_prefixes", data_cfg.valid_prefixes)) \
        if data_cfg.valid_prefixes else None
    unchecked = tokens.unrecorded(blend[0] + (valid[0] if valid else []))
    if unchecked and distributed.is_rank0():
        log.warning("data: %s %s no %s record (not made by kdexp.data.preprocess): %s tokenizer and largest token id "
                    "are not checked against the run's", ", ".join(unchecked), "has" if len(unchecked) == 1 else
                    "have", tokens.SUFFIX, "its" if len(unchecked) == 1 else "their")
    if valid:  # separate validation data: megatron's blend_per_split
        return tokenizer, None, [blend, valid, None], tokenizer.vocab_size, info
    return tokenizer, blend, None, tokenizer.vocab_size, info
