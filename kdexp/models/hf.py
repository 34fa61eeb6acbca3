"""Hugging Face Qwen3 checkpoints <-> megatron GPTModel, sharded for tensor parallelism.

Layout facts this file encodes (megatron-core 0.16.1, local spec):
- linear_qkv (column parallel) stores, per query group g, [q heads of g | k_g | v_g] rows; TP rank r holds the
  contiguous block of groups [r*G/tp, (r+1)*G/tp).
- linear_fc1 (column parallel, stride 2) holds on rank r [gate rows of r | up rows of r]; the MLP chunks its output
  in two halves and applies silu to the first.
- linear_proj and linear_fc2 (row parallel) are split along the input dim; embeddings and the LM head along vocab.
- Norm weights (input/pre-MLP/final RMSNorm, per-head q/k RMSNorm) are replicated. With a Transformer Engine spec
  the input/pre-MLP norms live in linear_qkv/linear_fc1 as `layer_norm_weight`; both spellings are mapped.

load_hf reads only this rank's slices (safetensors get_slice). save_hf gathers full tensors over the TP group and
global rank 0 writes config.json + model.safetensors into a temp dir, then renames it into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch

from kdexp.models.build import build
from kdexp.config.qwen3 import Qwen3Spec, spec_from_hf, spec_to_hf

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# megatron name inside a layer -> HF name inside model.layers.{i} (for the 1:1 replicated tensors)
_REPLICATED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
}


class _Checkpoint:
    """Lazy tensor slices from a directory of safetensors files (single file or index-sharded)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").exists():
            weight_map = None
        else:
            raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {f: safe_open(str(path / f), framework="pt", device="cpu") for f in files}
        if weight_map is None:
            weight_map = {k: "model.safetensors" for k in self._handles["model.safetensors"].keys()}
        self.weight_map = weight_map

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def rows(self, name: str, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        sl = self._handles[self.weight_map[name]].get_slice(name)
        return sl[start:stop] if start is not None else sl[:]

    def num_rows(self, name: str) -> int:
        return int(self._handles[self.weight_map[name]].get_slice(name).get_shape()[0])

    def vocab_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of an embedding / LM head; rows past the checkpoint's own are zeros (a vocabulary
        aligned to a wider one: kdexp.models.vocab)."""
        have = self.num_rows(name)
        part = self.rows(name, min(start, have), min(stop, have))
        if part.shape[0] == stop - start:
            return part
        return torch.cat([part, part.new_zeros(stop - start - part.shape[0], *part.shape[1:])])

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._handles[self.weight_map[name]].get_slice(name)[:, start:stop]


def _prefix(ckpt: _Checkpoint) -> str:
    # Qwen3ForCausalLM stores "model.layers...", a bare Qwen3Model "layers...".
    return "model." if ckpt.has("model.embed_tokens.weight") else ""


def _load_tensor(name: str, spec: Qwen3Spec, ckpt: _Checkpoint, rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of megatron parameter `name`, read from the HF checkpoint."""
    p = _prefix(ckpt)
    hd = spec.head_dim
    if name == "embedding.word_embeddings.weight":
        n = spec.vocab_size // tp
        return ckpt.vocab_rows(f"{p}embed_tokens.weight", rank * n, (rank + 1) * n)
    if name == "output_layer.weight":
        n = spec.vocab_size // tp
        src = "lm_head.weight" if ckpt.has("lm_head.weight") else f"{p}embed_tokens.weight"
        return ckpt.vocab_rows(src, rank * n, (rank + 1) * n)
    if name == "decoder.final_layernorm.weight":
        return ckpt.rows(f"{p}norm.weight")
    m = _LAYER.fullmatch(name)
    if not m:
        raise KeyError(f"no Hugging Face source for megatron parameter {name!r}")
    i, rest = m.groups()
    hf = f"{p}layers.{i}."
    if rest in _REPLICATED:
        return ckpt.rows(hf + _REPLICATED[rest])
    if rest == "self_attention.linear_qkv.weight":
        groups = spec.num_kv_heads // tp
        qpg = spec.num_heads // spec.num_kv_heads  # query heads per group
        g0 = rank * groups
        q = ckpt.rows(hf + "self_attn.q_proj.weight", g0 * qpg * hd, (g0 + groups) * qpg * hd)
        k = ckpt.rows(hf + "self_attn.k_proj.weight", g0 * hd, (g0 + groups) * hd)
        v = ckpt.rows(hf + "self_attn.v_proj.weight", g0 * hd, (g0 + groups) * hd)
        h = q.shape[-1]
        qkv = torch.cat([q.view(groups, qpg * hd, h), k.view(groups, hd, h), v.view(groups, hd, h)], dim=1)
        return qkv.reshape(-1, h)
    if rest == "self_attention.linear_proj.weight":
        n = spec.num_heads * hd // tp
        return ckpt.cols(hf + "self_attn.o_proj.weight", rank * n, (rank + 1) * n)
    if rest == "mlp.linear_fc1.weight":
        n = spec.intermediate_size // tp
        gate = ckpt.rows(hf + "mlp.gate_proj.weight", rank * n, (rank + 1) * n)
        up = ckpt.rows(hf + "mlp.up_proj.weight", rank * n, (rank + 1) * n)
        return torch.cat([gate, up], dim=0)
    if rest == "mlp.linear_fc2.weight":
        n = spec.intermediate_size // tp
        return ckpt.cols(hf + "mlp.down_proj.weight", rank * n, (rank + 1) * n)
    raise KeyError(f"no Hugging Face source for megatron parameter {name!r}")


def read_config(path) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    return json.loads(cfg_path.read_text())


def load_hf(path, *, params_dtype=torch.float32, vocab_size: Optional[int] = None, real_vocab: Optional[int] = None,
            **build_kwargs):
    """Build a GPTModel from a local HF Qwen3 checkpoint dir, sharded for the current TP size (reads only its shard).

    `vocab_size`: build it with that many vocabulary rows instead of the checkpoint's (its own rows first, then
    zeros; kdexp.models.vocab); `real_vocab`: the tokenizer's ids, logits beyond them -inf (mask_padded_vocab).
    `build_kwargs` (recompute, sequence_parallel, attention) go to kdexp.models.build."""
    from megatron.core import parallel_state as ps

    from kdexp.models.vocab import mask_padded_vocab

    path = Path(path)
    spec = spec_from_hf(read_config(path))
    if vocab_size is not None:
        spec = dataclasses.replace(spec, vocab_size=int(vocab_size))
    model = build(spec, params_dtype=params_dtype, init=False, **build_kwargs)
    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    ckpt = _Checkpoint(path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            t = _load_tensor(name, spec, ckpt, rank, tp)
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(f"{path}: {name} has shape {tuple(t.shape)} for this rank, model expects "
                                 f"{tuple(param.shape)}")
            param.copy_(t.to(dtype=param.dtype))
    return model if real_vocab is None else mask_padded_vocab(model, int(real_vocab))


def gather_tp(param: torch.Tensor, tp_group, tp: int, values: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Full tensor of a (possibly) TP-sharded megatron parameter, on every TP rank; of `values` (e.g. its gradient,
    same shard shape) sharded as the parameter is, when given."""
    t = (param if values is None else values).detach()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return t.cpu()
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, dim=param.partition_dim).cpu()


def hf_tensors(name: str, full: torch.Tensor, spec: Qwen3Spec, tp: int) -> dict:
    """HF name -> tensor for one gathered megatron parameter (inverse of _load_tensor at TP=1)."""
    hd = spec.head_dim
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": full}
    if name == "output_layer.weight":
        return {"lm_head.weight": full}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": full}
    m = _LAYER.fullmatch(name)
    if not m:
        raise KeyError(f"no Hugging Face name for megatron parameter {name!r}")
    i, rest = m.groups()
    hf = f"model.layers.{i}."
    if rest in _REPLICATED:
        return {hf + _REPLICATED[rest]: full}
    if rest == "self_attention.linear_qkv.weight":
        qpg = spec.num_heads // spec.num_kv_heads
        g = full.view(spec.num_kv_heads, qpg + 2, hd, -1)
        h = g.shape[-1]
        return {hf + "self_attn.q_proj.weight": g[:, :qpg].reshape(spec.num_heads * hd, h),
                hf + "self_attn.k_proj.weight": g[:, qpg].reshape(spec.num_kv_heads * hd, h),
                hf + "self_attn.v_proj.weight": g[:, qpg + 1].reshape(spec.num_kv_heads * hd, h)}
    if rest == "self_attention.linear_proj.weight":
        return {hf + "self_attn.o_proj.weight": full}
    if rest == "mlp.linear_fc1.weight":
        # Gathered rows are [gate_0 | up_0 | gate_1 | up_1 | ...] (one pair per TP rank).
        per = full.view(tp, 2, spec.intermediate_size // tp, -1)
        h = per.shape[-1]
        return {hf + "mlp.gate_proj.weight": per[:, 0].reshape(spec.intermediate_size, h),
                hf + "mlp.up_proj.weight": per[:, 1].reshape(spec.intermediate_size, h)}
    if rest == "mlp.linear_fc2.weight":
        return {hf + "mlp.down_proj.weight": full}
    raise KeyError(f"no Hugging Face name for megatron parameter {name!r}")


# Submodules the trainer attaches to the student (kdexp.objective.attach_intermediate) that are trained and
# checkpointed with it but are no part of the exported Hugging Face model.
TRAINING_ONLY_PREFIX = "kdexp_"


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module  # DDP / Float16Module wrappers
    return model


def save_hf(model, path, spec: Optional[Qwen3Spec] = None, *, dtype: Optional[torch.dtype] = None,
            files: Optional[dict[str, bytes]] = None) -> None:
    """Write `model` as a HF Qwen3 checkpoint dir (config.json + model.safetensors) that transformers loads.

    Collective over the TP group (call it on every rank); global rank 0 writes, atomically (temp dir, rename).
    `dtype` converts the written tensors (default: the parameters' dtype). `files`: more files of the checkpoint by
    name (the tokenizer's and generation_config.json: kdexp.data.tokenizer.Tokenizer.hf_files), written in the same
    temp dir, so the directory appears whole or not at all.
    """
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    model = _unwrap(model)
    spec = spec or getattr(model, "kdexp_spec", None)
    if spec is None:
        raise ValueError("save_hf: spec is required (the model carries none)")
    for name in files or {}:
        if name in ("config.json", "model.safetensors") or Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"save_hf: {name!r} is not a file name the checkpoint may take")
    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    tensors = {}
    for name, param in model.named_parameters():
        if name.startswith(TRAINING_ONLY_PREFIX):  # e.g. the hidden-state projections: not part of the HF model
            continue
        full = gather_tp(param, group, tp)
        for k, v in hf_tensors(name, full, spec, tp).items():
            tensors[k] = v.to(dtype or v.dtype).contiguous().clone()
    is_writer = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if is_writer:
        out_dtype = next(iter(tensors.values())).dtype
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        cfg = spec_to_hf(spec, dtype=str(out_dtype).removeprefix("torch."))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        if path.exists():
            os.replace(path, old)  # a directory cannot be replaced while non-empty: move it aside first
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
