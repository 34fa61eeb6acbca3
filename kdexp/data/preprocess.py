"""Tokenize a real corpus into a megatron indexed dataset for ``data=indexed`` (megatron-core has no
preprocess tool of its own; this is the small part of Megatron-LM's tools/preprocess_data.py we need).

    python -m kdexp.data.preprocess --input shard0.jsonl shard1.jsonl --tokenizer /ckpt/Qwen3-1.7B \\
        --output-prefix /data/corpus_text_document

`.jsonl` inputs give one document per line (``--json-key``, default ``text``); any other file is one
document. Each document is followed by the tokenizer's end-of-document id. The .bin/.idx pair appears
atomically (temp names, then os.replace: .bin first, .idx last), so a crash never leaves a readable half.
Beside them ``<prefix>.kdexp.json`` records the tokenizer (its identity: a sha256 of its files, its directory,
vocabulary size and eod) and the largest token id written: a run checks the corpus against its tokenizer and models
from that record before building anything (kdexp.config.tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence

from kdexp.config import tokens
from kdexp.data.indexed import write_indexed
from kdexp.data.tokenizer import Tokenizer

__all__ = ["iter_documents", "preprocess", "main"]


def iter_documents(paths: Sequence[str | os.PathLike], json_key: str = "text") -> Iterator[str]:
    for path in paths:
        path = Path(path)
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if json_key not in record:
                        raise ValueError(f"{path}:{lineno}: no key {json_key!r} (keys: {sorted(record)})")
                    yield str(record[json_key])
        else:
            yield path.read_text(encoding="utf-8")


def preprocess(inputs: Sequence[str | os.PathLike], tokenizer: Tokenizer, output_prefix: str | os.PathLike,
               *, json_key: str = "text", batch: int = 1024) -> int:
    """Tokenize `inputs` into <output_prefix>.bin/.idx; returns the number of documents written."""
    if not tokenizer.source or not Path(tokenizer.source).expanduser().is_dir():
        raise ValueError("preprocess needs the tokenizer of a directory (Tokenizer.from_dir): its files are the "
                         "identity recorded beside the token files")
    out = Path(output_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"

    seen = {"max": -1, "tokens": 0}

    def counted(batch_ids: list[list[int]]) -> Iterator[list[int]]:
        for ids in batch_ids:
            if ids:
                seen["max"], seen["tokens"] = max(seen["max"], max(ids), tokenizer.eod), seen["tokens"] + len(ids) + 1
                yield ids + [tokenizer.eod]

    def docs() -> Iterator[list[int]]:
        pending: list[str] = []
        for text in iter_documents(inputs, json_key):
            pending.append(text)
            if len(pending) == batch:
                yield from counted(tokenizer.encode_batch(pending))
                pending = []
        if pending:
            yield from counted(tokenizer.encode_batch(pending))

    try:
        count = write_indexed(tmp, docs(), tokenizer.vocab_size)
        os.replace(f"{tmp}.bin", f"{out}.bin")
        source = Path(tokenizer.source).expanduser()
        tokens.write(out, {"tokenizer": {"id": tokens.tokenizer_id(source), "directory": str(source.resolve()),
                                         "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod},
                           "max_token_id": seen["max"], "documents": count, "tokens": seen["tokens"]})
        os.replace(f"{tmp}.idx", f"{out}.idx")
    finally:
        for suffix in (".bin", ".idx"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    return count


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kdexp.data.preprocess", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".jsonl files (one document per line) or text files")
    parser.add_argument("--tokenizer", required=True, help="checkpoint directory with tokenizer.json")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    parser.add_argument("--json-key", default="text")
    args = parser.parse_args(argv)
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    count = preprocess(args.input, tokenizer, args.output_prefix, json_key=args.json_key)
    print(f"wrote {count} documents to {args.output_prefix}.bin/.idx (vocab {tokenizer.vocab_size}, "
          f"eod {tokenizer.eod})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
