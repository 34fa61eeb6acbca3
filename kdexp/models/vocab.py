"""Padded vocabularies: teacher and student whose output layers differ only by rows beyond the tokenizer's real ids.

Checkpoints pad their embedding and LM head past the tokenizer (Qwen2.5 to 152,064 rows, Qwen3 to 151,936, both over
the same 151,665-id tokenizer; ModelOpt issue #2489). Those rows are never a token, but their logits sit in each
model's softmax, and the two vocabularies do not even have the same width. With `model.vocab_alignment=tokenizer`:
- the teacher is loaded with the student's number of rows (rows past its checkpoint's are zeros, rows past the
  student's are dropped: both beyond the tokenizer), so the two logit tensors line up id for id, under TP too;
- both models' logits at ids >= the tokenizer's size are -inf (`mask_padded_vocab`): both softmaxes run over the real
  ids only, so every divergence compares the two distributions exactly on the shared ids (the losses take -inf
  logits exactly: 0 log 0 = 0), and no mass is lost to, or learnt on, a row that is not a token.
Any other mismatch (a model with fewer rows than the tokenizer has ids) is a config error (kdexp.config.sources
.check_alignment, before anything is built).
"""
from __future__ import annotations

import math

import torch

def _inner(model):
    while hasattr(model, "module") and not hasattr(model, "output_layer"):
        model = model.module  # DDP / Float16Module wrappers
    return model


def _padded_columns(real_vocab: int, local: int, device) -> torch.Tensor | None:
    """This TP rank's columns of the [.., V/tp] logits that are not a token (ids >= real_vocab; rank r holds ids
    [r*local, (r+1)*local)), or None when it has none: the one rule for the hook and the fused head."""
    from megatron.core import parallel_state as ps

    start = max(0, real_vocab - ps.get_tensor_model_parallel_rank() * local)  # first padded column of this rank
    if start >= local:
        return None
    return torch.arange(local, device=device) >= start


def mask_padded_vocab(model, real_vocab: int):
    """Make `model`'s logits -inf at every id >= real_vocab (this TP rank's slice of them), from a forward hook on its
    output layer; `model.kdexp_real_vocab` records it for code that forms logits from the output weight itself
    (`padded_vocab_mask`). A model whose vocabulary is exactly `real_vocab` is left as it is. Returns the model."""
    from megatron.core import parallel_state as ps

    layer = _inner(model).output_layer
    local = layer.output_size_per_partition
    if local * ps.get_tensor_model_parallel_world_size() <= real_vocab:
        return model
    model.kdexp_real_vocab = real_vocab
    masks: dict = {}

    def hook(module, args, output):
        logits, bias = output
        if logits.device not in masks:
            masks[logits.device] = _padded_columns(real_vocab, local, logits.device)
        mask = masks[logits.device]
        return (logits if mask is None else logits.masked_fill(mask, -math.inf)), bias

    layer.register_forward_hook(hook)
    return model


def padded_vocab_mask(model, local_vocab: int, device) -> torch.Tensor | None:
    """The [local_vocab] bool mask of this TP rank's padded columns of `model` (mask_padded_vocab's rule: True where
    the logit must be -inf), for callers that form the logits from the output weight (the fused head); None when
    the model has no padded rows on this rank or was not masked."""
    real = None
    while model is not None and real is None:
        real = getattr(model, "kdexp_real_vocab", None)
        model = getattr(model, "module", None)  # the attribute sits on the model mask_padded_vocab was given
    return None if real is None else _padded_columns(int(real), local_vocab, device)


def vocab_alignment(cfg, data=None) -> dict:
    """What model.vocab_alignment asks of a model load (load_hf's keywords): {} for "exact"; for "tokenizer" the
    tokenizer's ids (`real_vocab`) and, given the run's data, the student's vocabulary rows (`vocab_size`, the
    teacher is loaded with them). The same counts the config checks used (kdexp.config.sources)."""
    if cfg.model.vocab_alignment != "tokenizer":
        return {}
    from kdexp.config.sources import shapes, tokenizer_vocab

    out = {"real_vocab": tokenizer_vocab(cfg)}
    if data is not None:
        out["vocab_size"] = shapes(cfg)["student"][0] or data.vocab_size
    return out
