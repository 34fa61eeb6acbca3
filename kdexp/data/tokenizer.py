"""The one tokenizer teacher and student share: a byte-level BPE trained on the embedded corpus, or a real
checkpoint's Hugging Face tokenizer.

`Tokenizer` wraps a `tokenizers.Tokenizer` and offers what the rest of kdexp and megatron-core need:
``vocab_size``, ``eod``, ``encode``/``encode_batch``/``decode`` and ``unique_identifiers`` (megatron's
GPTDataset hashes the config, tokenizer included, into its index-cache file names through that attribute).
It deliberately has no ``pad``: megatron then uses -1 as the pad id, which never occurs in token data, instead
of a pad id that collides with the end-of-document token (Qwen3 pads with ``<|endoftext|>``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

__all__ = ["Tokenizer", "train_bpe", "EOD_TOKEN"]

EOD_TOKEN = "<|endoftext|>"
_META = "kdexp_tokenizer.json"
# Names real checkpoints use for the end-of-document token, preferred in this order (Qwen3: <|endoftext|>;
# its chat models' eos <|im_end|> ends a turn, not a document).
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
# A checkpoint's tokenizer files as Hugging Face writes them (tokenizer_config.json and generation_config.json are
# composed by `hf_files`, the others copied as they are).
_HF_FILES = ("tokenizer.json", "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
             "tokenizer.model", "chat_template.jinja", "chat_template.json")


class Tokenizer:
    """Text <-> token ids, plus the end-of-document id; see module doc."""

    def __init__(self, backend: tokenizers.Tokenizer, eod: int, source: str = "") -> None:
        self.backend = backend
        self.eod = int(eod)
        self.source = source
        if not 0 <= self.eod < self.vocab_size:
            raise ValueError(f"eod id {self.eod} outside the vocabulary [0, {self.vocab_size})")
        serial = backend.to_str()
        self.sha256 = hashlib.sha256(serial.encode("utf-8")).hexdigest()
        # Read by megatron's MegatronDataset when it JSON-encodes its config into the index-cache hash.
        self.unique_identifiers = {"class": "kdexp.data.Tokenizer", "sha256": self.sha256, "eod": self.eod}

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit (every id is < vocab_size), added/special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos(self) -> int:
        return self.eod

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Like `encode` on each text, but parallel in Rust (tokenizers' thread pool)."""
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we never use.
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [enc.ids for enc in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def hf_files(self, *, max_length: int | None = None) -> dict[str, bytes]:
        """The files a Hugging Face checkpoint needs to tokenize and generate as this run did, by name: the source
        checkpoint's tokenizer files as they are (its chat template included); tokenizer.json from the backend when
        the source has none (the BPE trained here); tokenizer_config.json from the source's with an eos and pad token
        added where it names none (this tokenizer's end-of-document token); generation_config.json from the source's
        (its sampling defaults) with the bos / eos / pad ids of this tokenizer (eos: every end token the source
        names, plus the end-of-document id)."""
        src = Path(self.source) if self.source and Path(self.source).is_dir() else None
        out = {n: (src / n).read_bytes() for n in _HF_FILES if src is not None and (src / n).is_file()}
        out.setdefault("tokenizer.json", self.backend.to_str().encode("utf-8"))
        config = _read_json(src, "tokenizer_config.json")
        if not _token(config.get("eos_token")):
            config["eos_token"] = self.backend.id_to_token(self.eod)
        if not _token(config.get("pad_token")):
            config["pad_token"] = _token(config["eos_token"])
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config.setdefault("clean_up_tokenization_spaces", False)
        if max_length is not None:
            config.setdefault("model_max_length", int(max_length))
        generation = _read_json(src, "generation_config.json")
        eos = generation.get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        for token in (_token(config["eos_token"]),):
            tid = self.backend.token_to_id(token)
            if tid is not None and tid not in eos:
                eos.append(tid)
        if self.eod not in eos:
            eos.append(self.eod)
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        generation["pad_token_id"] = self.backend.token_to_id(_token(config["pad_token"]))
        bos = _token(config.get("bos_token"))
        if bos and self.backend.token_to_id(bos) is not None:
            generation["bos_token_id"] = self.backend.token_to_id(bos)
        out["tokenizer_config.json"] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        out["generation_config.json"] = (json.dumps(generation, indent=2) + "\n").encode("utf-8")
        return out

    def save(self, directory: str | os.PathLike) -> Path:
        """Write tokenizer.json (loadable by tokenizers/transformers) and our eod choice; returns the dir."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        eod_token = self.backend.id_to_token(self.eod)
        (directory / _META).write_text(json.dumps({"eod_token": eod_token, "eod": self.eod}))
        return directory

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Load the tokenizer of a checkpoint directory (or one written by `save`).

        Uses tokenizer.json through `tokenizers`; without one, transformers' AutoTokenizer (never remote
        code) and its fast backend. The end-of-document id comes from, in order: our own metadata file, a
        known end-of-text token in the vocabulary, tokenizer_config.json's eos_token, config.json's
        eos_token_id.
        """
        directory = Path(directory).expanduser()
        if not directory.is_dir():
            raise ValueError(f"data.tokenizer must be a directory with tokenizer.json, got {str(directory)!r}")
        file = directory / "tokenizer.json"
        if file.is_file():
            backend = tokenizers.Tokenizer.from_file(str(file))
        else:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
            if not getattr(hf, "is_fast", False):
                raise ValueError(f"tokenizer in {directory} has no fast (tokenizers) backend")
            backend = hf.backend_tokenizer
        return cls(backend, _find_eod(directory, backend), source=str(directory))


def _read_json(directory: Path | None, name: str) -> dict:
    file = None if directory is None else directory / name
    return json.loads(file.read_text()) if file is not None and file.is_file() else {}


def _token(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken dict with its content."""
    return value.get("content") if isinstance(value, dict) else value


def _find_eod(directory: Path, backend: tokenizers.Tokenizer) -> int:
    meta = directory / _META
    if meta.is_file():
        return int(json.loads(meta.read_text())["eod"])
    for token in _EOD_CANDIDATES:
        tid = backend.token_to_id(token)
        if tid is not None:
            return tid
    config = directory / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and backend.token_to_id(eos) is not None:
            return backend.token_to_id(eos)
    config = directory / "config.json"
    if config.is_file():
        eos_id = json.loads(config.read_text()).get("eos_token_id")
        if isinstance(eos_id, list) and eos_id:
            eos_id = eos_id[0]
        if isinstance(eos_id, int):
            return eos_id
    raise ValueError(f"cannot tell the end-of-document token of the tokenizer in {directory}: none of "
                     f"{_EOD_CANDIDATES} in its vocabulary and no eos_token in tokenizer_config.json/config.json")


def train_bpe(texts: Sequence[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style: any text round-trips exactly) with `EOD_TOKEN` as id 0.

    `vocab_size` counts the 256 byte symbols and the special token. A corpus too small to find that many
    merges gives a smaller vocabulary (check `.vocab_size`).
    """
    if not isinstance(vocab_size, int) or not 512 <= vocab_size <= 262_144:
        raise ValueError(f"data.vocab_size must be an int in [512, 262144], got {vocab_size!r}")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return Tokenizer(backend, backend.token_to_id(EOD_TOKEN), source="bpe")
