"""What a Megatron token file records about the tokenizer that made it, and the run's check against it.

``python -m kdexp.data.preprocess`` writes ``<prefix>.kdexp.json`` beside ``<prefix>.bin/.idx``: the tokenizer's
identity (``tokenizer_id``: a sha256 of its files), its directory, vocabulary size and end-of-document id, and the
largest token id written (counted while tokenizing, so reading it back costs one small JSON file per prefix whatever
the corpus size). ``check_prefixes`` (kdexp.config.validate, before any model is built) refuses a prefix whose largest
id is outside the model's vocabulary, or one made by another tokenizer than the run's, naming both. A prefix made by
another tool (Megatron-LM's preprocess_data.py) has no record: it is checked for its files only, and ``unrecorded``
names it so the run can say so.

Stdlib only: the torch-free config checks read it, and kdexp.data.preprocess writes through ``write``.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from kdexp.rules import fail

SUFFIX = ".kdexp.json"
FORMAT = 1
# The files that decide a tokenizer's ids: tokenizer.json holds them all (model, added tokens, normalizer); without it
# transformers builds the tokenizer from the others.
_ID_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "tokenizer_config.json")


def meta_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{Path(prefix).expanduser()}{SUFFIX}")


def tokenizer_id(directory: str | os.PathLike) -> str:
    """sha256 of the files that decide the tokenizer's ids: tokenizer.json alone when there is one (so a copy of the
    checkpoint, or its tokenizer next to another model, is the same tokenizer), else the slow tokenizer's files."""
    directory = Path(directory).expanduser()
    names = ("tokenizer.json",) if (directory / "tokenizer.json").is_file() else _ID_FILES
    h = hashlib.sha256()
    for name in names:
        file = directory / name
        if file.is_file():
            h.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    return h.hexdigest()


def write(prefix: str | os.PathLike, record: dict) -> None:
    """<prefix>.kdexp.json, atomically (temp file + os.replace)."""
    path = meta_path(prefix)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"format": FORMAT, **record}, indent=2) + "\n")
    os.replace(tmp, path)


def read(prefix: str | os.PathLike) -> Optional[dict]:
    path = meta_path(prefix)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        int(record["max_token_id"]), str(record["tokenizer"]["id"]), int(record["tokenizer"]["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a token-file record kdexp.data.preprocess wrote "
                         f"({type(err).__name__}: {err}); delete it or tokenize again") from None
    return record


def unrecorded(prefixes: list[str]) -> list[str]:
    return [p for p in prefixes if not meta_path(p).is_file()]


def check_prefixes(key: str, items: Any, prefixes: list[str], *, vocab: int, vocab_key: str, tokenizer_key: str,
                   tokenizer_dir: Optional[str]) -> None:
    """Refuse a prefix whose recorded largest token id is >= `vocab` (the smaller of the models' vocabularies, named
    by `vocab_key`), or whose recorded tokenizer is not the run's (`tokenizer_key`=`tokenizer_dir`)."""
    run_id = tokenizer_id(tokenizer_dir) if tokenizer_dir is not None else None
    for p in prefixes:
        record = read(p)
        if record is None:
            continue
        tok = record["tokenizer"]
        if int(record["max_token_id"]) >= vocab:
            fail(key, list(items), f"{p} holds token id {record['max_token_id']} (recorded in {meta_path(p)}) but "
                 f"{vocab_key} has a vocabulary of {vocab}: every id must be < {vocab}; it was tokenized by "
                 f"{tok.get('directory')!r} ({tok['vocab_size']} ids)")
        if run_id is not None and tok["id"] != run_id:
            fail(key, list(items), f"{p} was tokenized by {tok.get('directory')!r} (tokenizer sha256 "
                 f"{tok['id'][:12]}, {tok['vocab_size']} ids) but this run's tokenizer is {tokenizer_key}="
                 f"{tokenizer_dir!r} (sha256 {run_id[:12]}): its ids would mean other tokens; tokenize the corpus "
                 f"again with `python -m kdexp.data.preprocess --tokenizer {tokenizer_dir} ...` or set "
                 f"{tokenizer_key} to the tokenizer that made it")
