"""Checks of what a run reads: the model names and checkpoint dirs (their config.json), the data options and the
Megatron prefixes and tokenizer on disk. ``shapes`` tells the cross-key checks the vocabulary and head counts."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Optional

from kdexp import assets
from kdexp.config.qwen3 import QWEN3_SIZES, size_key
from kdexp.config import tokens
from kdexp.rules import choice, fail, integer, is_int, number

_DTYPES = ("float32", "bfloat16")
EMBEDDED_TEACHERS = ("shipped", "pretrain")
ATTENTION = ("sdpa", "megatron")  # kdexp.models.build.ATTENTION (no torch import here)


def _model_shape(name: str, key: str):
    if size_key(name) is None:
        fail(key, name, f"must be one of {sorted(QWEN3_SIZES)} (any case, 'Qwen3-1.7B' and 'Qwen/Qwen3-1.7B' too), "
             f"or null with {key}_path (the checkpoint names itself)")
    return QWEN3_SIZES[size_key(name)]


def _is_tiny(name: Any) -> bool:
    return (size_key(name) or "").startswith("tiny")


def _role_shape(cfg: Any, role: str):
    """The size model.<role> names (None when it is null and a checkpoint path gives the shape)."""
    name = getattr(cfg.model, role)
    if name is None:
        if _checkpoint(cfg, role)[1] is None:
            fail(f"model.{role}", None, f"must name a size when model.{role}_path is not set")
        return None
    return _model_shape(name, f"model.{role}")


# config.json field -> Qwen3Spec field: the layer shape a size name promises
_HF_SHAPE = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
             "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim"}


def _check_name_matches(cfg: Any, role: str) -> None:
    """A size name given beside model.<role>_path must be the checkpoint's shape: a name that disagrees is refused
    rather than printed as a label of the wrong model."""
    spec, (key, path) = _role_shape(cfg, role), _checkpoint(cfg, role)
    if spec is None or path is None or key == "model.embedded_teacher":
        return
    hf = _hf_config(key, path)
    diff = [f"{field_} {hf[field_]} vs {getattr(spec, ours)}" for field_, ours in _HF_SHAPE.items()
            if is_int(hf.get(field_)) and hf[field_] != getattr(spec, ours)]
    if diff:
        name = getattr(cfg.model, role)
        fail(f"model.{role}", name, f"{key}={path} is a checkpoint of another shape ({', '.join(diff)} of {name}): "
             f"set model.{role}=null to take the checkpoint's own shape and label, or name its size")


_HF_NEEDS = ("vocab_size", "num_attention_heads")  # what validate reads from a checkpoint's config.json


def _hf_config(key: str, path: str) -> dict:
    """The checkpoint's config.json, with the fields validate needs checked (a message naming ``key`` otherwise)."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        fail(key, path, "must be a local Hugging Face checkpoint directory with config.json")
    try:
        hf = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        fail(key, path, f"its config.json is not readable JSON ({type(err).__name__}: {err})")
    if not isinstance(hf, dict):
        fail(key, path, "its config.json must hold a JSON object")
    for field_ in _HF_NEEDS + ("num_key_value_heads", "max_position_embeddings"):
        value = hf.get(field_)
        if value is None and field_ not in _HF_NEEDS:
            continue
        if not is_int(value) or value < 1:
            fail(key, path, f"its config.json has no {field_!r}" if value is None else
                  f"its config.json has {field_}={value!r} (must be a positive integer)")
    return hf


def _checkpoint(cfg: Any, role: str) -> tuple[str, Optional[str]]:
    """(the key that names it, the checkpoint dir or None) of a role: model.<role>_path, or for the teacher the shipped
    checkpoint (model.embedded_teacher=shipped)."""
    if role == "teacher" and assets.uses_shipped_teacher(cfg.model):
        return "model.embedded_teacher", assets.teacher_checkpoint(cfg.model)
    return f"model.{role}_path", getattr(cfg.model, f"{role}_path")


def shapes(cfg: Any) -> dict:
    """Per role: (vocabulary or None when the tokenizer decides it, heads, kv heads, max positions)."""
    out = {}
    for role in ("teacher", "student"):
        key, path = _checkpoint(cfg, role)
        spec = _role_shape(cfg, role)
        if path is not None:
            hf = _hf_config(key, path)
            heads = hf["num_attention_heads"]
            out[role] = (hf["vocab_size"], heads, hf.get("num_key_value_heads") or heads,
                         hf.get("max_position_embeddings") or (spec.max_position_embeddings if spec else 40960))
            continue
        if _is_tiny(getattr(cfg.model, role)):  # tiny presets take the tokenizer's vocabulary
            trained = cfg.data.name == "stdlib" and assets.tokenizer_source(cfg)[1] is None
            vocab = cfg.data.vocab_size if trained else None  # the BPE trained here has data.vocab_size entries
        else:
            vocab = spec.vocab_size
        out[role] = (vocab, spec.num_heads, spec.num_kv_heads, spec.max_position_embeddings)
    return out


def layer_counts(cfg: Any) -> dict:
    """Per role: the number of decoder layers (config.json's num_hidden_layers for a checkpoint; None if it lacks it)."""
    out = {}
    for role in ("teacher", "student"):
        key, path = _checkpoint(cfg, role)
        spec = _role_shape(cfg, role)
        n = spec.num_layers if spec is not None else None
        if path is not None:
            n = _hf_config(key, path).get("num_hidden_layers")
            n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
        out[role] = n
    return out


def check_model(cfg: Any) -> None:
    m = cfg.model
    for role in ("teacher", "student"):
        _check_name_matches(cfg, role)
    choice("model.params_dtype", m.params_dtype, _DTYPES)
    choice("model.attention", m.attention, ATTENTION)
    choice("model.embedded_teacher", m.embedded_teacher, EMBEDDED_TEACHERS)
    if m.teacher_path is None and not _is_tiny(m.teacher):
        fail("model.teacher_path", None,
              f"is required for the real teacher model.teacher={m.teacher!r} (only tiny teachers are pretrained here)")
    if assets.uses_shipped_teacher(m):
        if _model_shape(m.teacher, "model.teacher") is not _model_shape(assets.SHIPPED_SHAPE, "model.teacher"):
            fail("model.teacher", m.teacher, f"must be {assets.SHIPPED_SHAPE!r} with model.embedded_teacher=shipped "
                                             "(the shipped checkpoint's shape); set model.embedded_teacher=pretrain "
                                             "to pretrain this shape here")
        d = cfg.data
        if d.name == "stdlib" and d.tokenizer is None and d.vocab_size != assets.shipped_vocab_size():
            fail("data.vocab_size", d.vocab_size, f"must be {assets.shipped_vocab_size()} with "
                 "model.embedded_teacher=shipped (the shipped teacher's tokenizer); set model.embedded_teacher="
                 "pretrain to train a BPE of this size and pretrain a teacher on it")
    integer("model.teacher_pretrain_steps", m.teacher_pretrain_steps, ge=1)
    number("model.teacher_pretrain_lr", m.teacher_pretrain_lr, gt=0)
    number("model.teacher_pretrain_min_lr", m.teacher_pretrain_min_lr, ge=0)
    if m.teacher_pretrain_min_lr > m.teacher_pretrain_lr:
        fail("model.teacher_pretrain_min_lr", m.teacher_pretrain_min_lr,
             f"must be <= model.teacher_pretrain_lr={m.teacher_pretrain_lr}")
    number("model.teacher_pretrain_warmup_fraction", m.teacher_pretrain_warmup_fraction, ge=0, lt=1)
    integer("model.teacher_pretrain_micro_batch_size", m.teacher_pretrain_micro_batch_size, ge=1)
    number("model.teacher_pretrain_weight_decay", m.teacher_pretrain_weight_decay, ge=0)
    integer("model.teacher_pretrain_seed", m.teacher_pretrain_seed, ge=0, lt=2**32)
    integer("model.teacher_pretrain_seq_length", m.teacher_pretrain_seq_length, ge=1)


# ----------------------------------------------------------------------------------------------------------------------
# data


def _check_prefixes(key: str, items: Any) -> list[str]:
    """Megatron prefixes [p, ...] or a weighted blend [w, p, w, p, ...]: each with its .bin and .idx; returns the
    prefixes."""
    items = [str(x) for x in items]
    weights = items[0::2] if len(items) % 2 == 0 else []

    def as_weight(text: str) -> Optional[float]:
        try:
            return float(text)
        except ValueError:
            return None

    parsed = [as_weight(w) for w in weights]
    if parsed and all(w is not None for w in parsed):
        for w in parsed:
            if not (math.isfinite(w) and w > 0):
                fail(key, items, f"blend weight {w:g} must be a finite number > 0")
        prefixes = items[1::2]
    elif any(w is not None for w in parsed):
        fail(key, items, "must be prefixes [p, ...] or a weighted blend [w, p, w, p, ...], not a mix")
    else:
        prefixes = items
    for p in prefixes:
        base = Path(p).expanduser()
        lacking = [ext for ext in (".bin", ".idx") if not Path(f"{base}{ext}").is_file()]
        if lacking:
            fail(key, items, f"no indexed dataset at {p!r} (missing {' and '.join(f'{p}{e}' for e in lacking)})")
    return prefixes


_SPLIT = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*,\s*([0-9]+(?:\.[0-9]*)?)\s*,\s*([0-9]+(?:\.[0-9]*)?)\s*")


def check_data(cfg: Any) -> None:
    d = cfg.data
    choice("data.name", d.name, ("stdlib", "indexed"))
    # the bounds of the builders (kdexp.data.tokenizer.train_bpe, kdexp.data.corpus._check), checked before any work
    integer("data.vocab_size", d.vocab_size, ge=512, lt=262_145)
    integer("data.max_chars", d.max_chars, ge=1000)
    integer("data.max_documents", d.max_documents, ge=2, none_ok=True)
    number("data.val_fraction", d.val_fraction, gt=0, lt=0.5)
    integer("data.seed", d.seed, ge=0, lt=2**32)  # numpy's RandomState, which megatron's shuffle uses
    m = _SPLIT.fullmatch(str(d.split))
    parts = [float(x) for x in m.groups()] if m else None
    if parts is None or not sum(parts) > 0:
        fail("data.split", d.split, "must be 'train,valid,test': three non-negative numbers with a positive sum")
    if d.name == "stdlib":
        for key in ("prefixes", "valid_prefixes"):
            if list(getattr(d, key)):
                fail(f"data.{key}", list(getattr(d, key)), "data=stdlib ignores it (only data=indexed reads it)")
    else:
        if not d.prefixes:
            fail("data.prefixes", list(d.prefixes), "must list at least one Megatron .bin/.idx prefix")
        _check_prefixes("data.prefixes", d.prefixes)
        if d.valid_prefixes:
            _check_prefixes("data.valid_prefixes", d.valid_prefixes)
        elif not (parts[0] > 0 and parts[1] > 0):
            fail("data.split", d.split, "must give train > 0 and valid > 0 (or set data.valid_prefixes)")
        if d.max_documents is not None:
            fail("data.max_documents", d.max_documents, "data=indexed ignores it (only data=stdlib reads it)")


def check_tokenizer(cfg: Any) -> None:
    """The tokenizer: data.tokenizer, else the teacher checkpoint's (with data=stdlib it replaces the trained BPE)."""
    d = cfg.data
    key, tok = assets.tokenizer_source(cfg)
    if tok is None:
        if d.name == "indexed":
            fail("data.tokenizer", None, "must be a directory with tokenizer.json for data=indexed "
                  "(or set model.teacher_path to a checkpoint that holds one)")
        return
    tok = Path(tok).expanduser()
    if not ((tok / "tokenizer.json").is_file() or (tok / "tokenizer_config.json").is_file()):
        fail(key, str(tok), "must be a directory with tokenizer.json (the tokenizer of the data)")


def check_token_files(cfg: Any, sizes: dict) -> None:
    """data=indexed: each prefix's recorded largest token id within both models' vocabularies, and its recorded
    tokenizer the run's (kdexp.config.tokens; reads one small JSON file per prefix, never the tokens)."""
    d = cfg.data
    if d.name != "indexed":
        return
    tokenizer_key, tokenizer_dir = assets.tokenizer_source(cfg)
    groups = [(f"data.{k}", list(getattr(d, k))) for k in ("prefixes", "valid_prefixes") if list(getattr(d, k))]
    groups = [(k, items, _check_prefixes(k, items)) for k, items in groups]
    if not any(tokens.meta_path(p).is_file() for _, _, prefixes in groups for p in prefixes):
        return  # nothing recorded (made by another tool): kdexp.data says so when it opens them
    vocab, role = min((v if v is not None else tokenizer_vocab(cfg), role) for role, (v, *_) in sizes.items())
    key, path = _checkpoint(cfg, role)
    vocab_key = f"{key}={path}" if path is not None else f"model.{role}={getattr(cfg.model, role)}"
    for k, items, prefixes in groups:
        tokens.check_prefixes(k, items, prefixes, vocab=vocab, vocab_key=vocab_key, tokenizer_key=tokenizer_key,
                              tokenizer_dir=tokenizer_dir)


ALIGNMENTS = ("exact", "tokenizer")  # model.vocab_alignment (kdexp.models.vocab)


def check_alignment(alignment: str, teacher_vocab: int, student_vocab: int, real_vocab: int) -> None:
    """ValueError unless the two vocabularies may be distilled between: equal (alignment "exact"), or both at least
    the tokenizer's `real_vocab` ids ("tokenizer": they differ only by padding rows)."""
    if teacher_vocab == student_vocab and alignment == "exact":
        return
    if alignment == "exact":
        raise ValueError(f"model.teacher vocabulary ({teacher_vocab}) and model.student vocabulary ({student_vocab}) "
                         "differ: logit distillation needs one shared vocabulary; if they differ only by padding rows "
                         f"beyond the tokenizer's{'' if real_vocab is None else f' {real_vocab}'} ids, set "
                         "model.vocab_alignment=tokenizer")
    if min(teacher_vocab, student_vocab) < real_vocab:
        raise ValueError(f"model.vocab_alignment=tokenizer is invalid: the tokenizer has {real_vocab} ids but "
                         f"model.teacher has {teacher_vocab} vocabulary rows and model.student {student_vocab}; "
                         "both must cover every id (they may differ only by padding rows beyond the tokenizer)")


def tokenizer_vocab(cfg: Any) -> int:
    """The number of ids the run's tokenizer emits (added tokens included): its tokenizer.json's, or data.vocab_size
    for the BPE data=stdlib trains."""
    key, tok = assets.tokenizer_source(cfg)
    if tok is None:
        return int(cfg.data.vocab_size)
    import tokenizers  # only here: a plain config check needs no tokenizer library

    path = Path(tok).expanduser() / "tokenizer.json"
    try:
        return tokenizers.Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # a corrupt or foreign file: name it, one line
        fail(key, str(tok), f"must hold a readable tokenizer.json (model.vocab_alignment=tokenizer counts its ids): {e}")
