"""Qwen3 as a megatron-core GPTModel: build, logits, generation with a KV cache, and Hugging Face checkpoint
import/export. The shapes (Qwen3Spec, QWEN3_SIZES) live in kdexp.config.qwen3, where the config checks read them
without torch; re-exported here.

Trainer use::

    spec = get_spec(cfg.model.size, vocab_size=bundle.vocab_size)      # or spec_from_hf(read_config(path))
    model = build(spec, params_dtype=torch.bfloat16)                    # random init, sharded for current TP
    model = load_hf("/ckpts/Qwen3-1.7B", params_dtype=torch.bfloat16)   # real weights, sharded for current TP
    shard = vocab_parallel_logits(model, tokens)                        # [b, s, V/tp] -> KD loss / LM loss
    hidden, weight = final_hidden(model, tokens)                       # [s, b, h] after the final norm, [V/tp, h]
    full = forward_logits(model, tokens)                                # [b, s, V]
    save_hf(model, out_dir, spec)                                       # every rank calls; rank 0 writes
    rollout = generate(model, prompts, max_new_tokens=64, seeds=rollout_seeds(seed, step, sample_ids))  # KV cache

Padded vocabularies (model.vocab_alignment=tokenizer): load_hf(..., vocab_size=, real_vocab=) and
mask_padded_vocab (kdexp.models.vocab; padded_vocab_mask: its columns, for the fused head).
"""

import torch

from kdexp.models.build import (build, capture_hidden, cast, check_tp, final_hidden, forward_logits, output_weight,
                                sequence_parallel, transformer_config, vocab_parallel_logits)
from kdexp.models.generation import Rollout, generate, rollout_seeds
from kdexp.models.hf import load_hf, read_config, save_hf
from kdexp.config.qwen3 import QWEN3_SIZES, Qwen3Spec, get_spec, label, shape_of, size_key, spec_from_hf, spec_to_hf
from kdexp.models.vocab import mask_padded_vocab, padded_vocab_mask, vocab_alignment

# model.params_dtype names -> torch dtypes (config.validate allows exactly these names)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

__all__ = ["DTYPES", "Qwen3Spec", "QWEN3_SIZES", "get_spec", "size_key", "label", "shape_of", "spec_from_hf", "spec_to_hf", "build", "capture_hidden",
           "cast", "check_tp", "final_hidden", "output_weight", "sequence_parallel", "transformer_config",
           "forward_logits", "vocab_parallel_logits", "load_hf", "save_hf", "read_config", "mask_padded_vocab",
           "padded_vocab_mask", "generate", "Rollout", "rollout_seeds",
           "vocab_alignment"]
