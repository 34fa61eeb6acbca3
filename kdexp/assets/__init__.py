"""What ships with the package: the embedded default's teacher, trained once by this project's own recipe.

``teacher/`` is a Hugging Face Qwen3 checkpoint (config.json, model.safetensors in bfloat16) of the ``tiny-teacher``
shape with the byte-level BPE it was trained with (tokenizer.json), ``recipe.json`` (the command, recipe, data and
measured curve that made it: ``python -m kdexp.bench.teacher --curve N --save DIR ...``) and a sha256 manifest
(kdexp_manifest.json). A run with ``model.embedded_teacher=shipped`` (the default) loads it like a real teacher
checkpoint and tokenizes the embedded corpus with its tokenizer, so the first run pretrains nothing;
``model.embedded_teacher=pretrain`` pretrains a teacher with the model.teacher_pretrain_* recipe instead (cached).
Stdlib only: the torch-free config checks ask it where the checkpoint is.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

SHIPPED_TEACHER = Path(__file__).resolve().parent / "teacher"
SHIPPED_SHAPE = "tiny-teacher"  # the model.teacher shape the shipped checkpoint has

__all__ = ["SHIPPED_TEACHER", "SHIPPED_SHAPE", "shipped_vocab_size", "teacher_checkpoint", "tokenizer_source",
           "uses_shipped_teacher"]


def uses_shipped_teacher(model_cfg: Any) -> bool:
    """True when the run's teacher is the shipped checkpoint: no model.teacher_path, model.embedded_teacher=shipped."""
    return model_cfg.teacher_path is None and model_cfg.embedded_teacher == "shipped"


def teacher_checkpoint(model_cfg: Any) -> Optional[str]:
    """The teacher's HF checkpoint dir (model.teacher_path, else the shipped teacher), or None when the embedded
    teacher is pretrained here. The one place that decides it: the data's tokenizer, the teacher and the teacher
    cache's key all ask."""
    if model_cfg.teacher_path is not None:
        return str(model_cfg.teacher_path)
    return str(SHIPPED_TEACHER) if uses_shipped_teacher(model_cfg) else None


def tokenizer_source(cfg: Any) -> tuple[str, Optional[str]]:
    """(the config key that names it, the directory) of the data's tokenizer: data.tokenizer, else model.teacher_path's,
    else for data=stdlib the shipped teacher's; (key, None) = data=stdlib trains its BPE (data=indexed: an error)."""
    d, m = cfg.data, cfg.model
    if d.tokenizer is not None:
        return "data.tokenizer", str(d.tokenizer)
    if m.teacher_path is not None:
        return "model.teacher_path", str(m.teacher_path)
    if d.name == "stdlib" and uses_shipped_teacher(m):
        return "model.embedded_teacher", str(SHIPPED_TEACHER)
    return "data.tokenizer", None


@lru_cache(maxsize=1)
def shipped_vocab_size() -> int:
    with open(SHIPPED_TEACHER / "config.json") as f:
        return int(json.load(f)["vocab_size"])
