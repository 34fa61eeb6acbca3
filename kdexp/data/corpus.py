"""The embedded corpus: text every CPython install carries, so the default run needs no download.

Documents are
  * the standard library's ``.py`` sources under ``sysconfig.get_paths()["stdlib"]``, one document per file,
    named by the path relative to that directory (``asyncio/tasks.py``), and
  * the pydoc help topics (``pydoc_data.topics.topics``, English prose), one document per topic, named
    ``pydoc_data/topics/<topic>``.

Left out, and why:
  * ``site-packages/`` and ``dist-packages/``: installed third-party code, differs from machine to machine;
  * any ``test``/``tests``/``idle_test`` directory: fixtures with odd encodings, deliberately broken syntax
    and huge generated data (17 MB of the 30 MB stdlib);
  * ``encodings/`` codec modules: generated 256-entry character tables, not language;
  * ``lib2to3/`` grammar fixtures, ``pydoc_data/topics.py`` itself (its text is the topic documents);
  * files that are not UTF-8.
  ``idlelib/`` (ordinary tkinter application code) stays in.

Selection is deterministic for a given Python build: candidates are ranked by sha256 of their name and taken
greedily until `max_chars` (and `max_documents`) is reached, then returned sorted by name. Ranking by hash
rather than by name spreads a small cap over the whole library instead of its first letters. The
train/validation split is by document: a document is validation when the sha256 of its name (with another salt)
is among the lowest, taken until validation holds `val_fraction` of the
characters; at least one document lands on each side.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kdexp.rules import ConfigError

__all__ = ["Document", "embedded_corpus", "embedded_documents", "corpus_fingerprint"]

# No defaults for the sizes here: data.max_chars / data.val_fraction / data.max_documents of the schema
# (kdexp.config.DataConfig) are the one set of them.

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                  "encodings", "lib2to3"}
_EXCLUDED_FILES = {"pydoc_data/topics.py"}


@dataclass(frozen=True)
class Document:
    name: str   # relative path (or pydoc_data/topics/<topic>): stable across machines with the same Python
    text: str


def _unit(name: str, salt: str) -> float:
    """Deterministic uniform number in [0, 1) from a document name."""
    digest = hashlib.sha256(f"{salt}:{name}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@lru_cache(maxsize=1)
def _all_documents() -> tuple[Document, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[Document] = []
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune while walking: site-packages alone can hold more files than the whole standard library.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        paths.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        name = path.relative_to(root).as_posix()
        if name in _EXCLUDED_FILES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document(name, text))
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a stripped-down Python without pydoc_data: the sources alone are enough
        topics = {}
    for topic in sorted(topics):
        if topics[topic].strip():
            docs.append(Document(f"pydoc_data/topics/{topic}", topics[topic]))
    if not docs:
        raise RuntimeError(f"no usable standard-library sources found under {root}")
    return tuple(docs)


def _check(max_chars, val_fraction, max_documents) -> None:
    if not isinstance(max_chars, int) or max_chars < 1000:
        raise ValueError(f"data.max_chars must be an int >= 1000, got {max_chars!r}")
    if not (isinstance(val_fraction, (int, float)) and 0.0 < val_fraction < 0.5):
        raise ValueError(f"data.val_fraction must be in (0, 0.5), got {val_fraction!r}")
    if max_documents is not None and (not isinstance(max_documents, int) or max_documents < 2):
        raise ValueError(f"data.max_documents must be None or an int >= 2, got {max_documents!r}")


def embedded_corpus(max_chars: int, val_fraction: float, max_documents: int | None = None) -> tuple[list[Document], list[Document]]:
    """(train, validation) documents of the embedded corpus, each list sorted by name; see module doc."""
    _check(max_chars, val_fraction, max_documents)
    ranked = sorted(_all_documents(), key=lambda d: (_unit(d.name, "select"), d.name))
    chosen: list[Document] = []
    total = 0
    for doc in ranked:
        if max_documents is not None and len(chosen) >= max_documents:
            break
        if total + len(doc.text) > max_chars:
            continue  # greedy fill: a big file that does not fit leaves room for smaller ones
        chosen.append(doc)
        total += len(doc.text)
    if len(chosen) < 2:
        raise ConfigError(f"data.max_chars={max_chars} leaves fewer than 2 documents; raise it")
    chosen.sort(key=lambda d: d.name)
    # Validation = documents in split-hash order until they hold val_fraction of the characters: by document
    # (no file is cut in two), and sized by text rather than by file count (file sizes vary 1000-fold).
    target = val_fraction * sum(len(d.text) for d in chosen)
    val_names: set[str] = set()
    val_chars = 0
    for doc in sorted(chosen, key=lambda d: (_unit(d.name, "split"), d.name)):
        if val_chars >= target or len(val_names) == len(chosen) - 1:
            break
        val_names.add(doc.name)
        val_chars += len(doc.text)
    is_val = [d.name in val_names for d in chosen]
    train = [d for d, v in zip(chosen, is_val) if not v]
    val = [d for d, v in zip(chosen, is_val) if v]
    return train, val


def embedded_documents(max_chars: int, val_fraction: float, max_documents: int | None = None) -> tuple[list[str], list[str]]:
    """(train_docs, val_docs) as plain strings (the contract's view of `embedded_corpus`)."""
    train, val = embedded_corpus(max_chars, val_fraction, max_documents)
    return [d.text for d in train], [d.text for d in val]


def corpus_fingerprint(docs: list[Document]) -> str:
    """sha256 over names and texts: the cache key of anything built from these documents."""
    h = hashlib.sha256()
    for doc in docs:
        for part in (doc.name, doc.text):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.hexdigest()
