"""The arithmetic of a plan: parameters per TP rank, activation bytes per layer, logit and KD-loss buffers, FLOPs.

Pure functions of a Qwen3Spec and a few sizes (no torch, no megatron); kdexp.plan assembles them into a table.

Activations follow the method of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), section 4: count, per transformer layer and token, the bytes of every tensor the backward
pass keeps. Their GPT layer keeps sbh(34 + 5as/h) bytes; with tensor parallelism t the layer norms' and the first
linears' inputs stay whole (10sbh) and the rest is divided by t; sequence parallelism divides those too; selective
recompute drops the attention core (the s^2 terms); full recompute keeps only each layer's input. Here the same
bookkeeping is done for the layer kdexp actually builds (megatron's local spec, kdexp.models.build): torch's
RMSNorm (which keeps an fp32 copy of its input and its normalised output, also for bf16 inputs), per-head q/k
norms, the core attention (model.attention: sdpa keeps q, k and v unrepeated and one fp32 log-sum-exp per query and
head, its output being linear_proj's input; megatron's unfused DotProductAttention repeats the GQA key/values to all
heads and keeps its fp32 softmax, plus its 16-bit copy for the bmm), SwiGLU, no dropout (p=0 keeps nothing) and no
biases. Each term is checked against the saved tensors of a built tiny megatron model (tests/test_plan.py).

FLOPs count a multiply-add as 2 (the convention of MFU, Chowdhery et al. 2022 "PaLM", appendix B): a matmul over
N parameters costs 2N per token forward, 6N forward + backward; attention costs 4*s*a*d forward per layer (Q K^T
and P V over the whole s x s score matrix, which the unfused attention computes in full; the causal flash kernels
skip the masked half, so these are model FLOPs, not what the hardware does).
"""
from __future__ import annotations

from dataclasses import dataclass

from kdexp.config.qwen3 import Qwen3Spec

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("sdpa", "megatron")


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    sequence: bool = False  # sequence parallelism: the layer norms and linear inputs are split over the TP ranks too


def params_per_rank(spec: Qwen3Spec, tp: int) -> int:
    """Parameters one TP rank holds: matrices split over TP (vocabulary rows, heads, ffn columns); norms whole."""
    h, f, d, a, g = spec.hidden_size, spec.intermediate_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    layer = (h * (a + 2 * g) * d + a * d * h + 3 * h * f) // tp + 2 * h + 2 * d  # qkv, proj, fc1 (gate|up), fc2
    emb = spec.vocab_size * h // tp * (1 if spec.tie_embeddings else 2)
    return spec.num_layers * layer + emb + h


def matmul_params(spec: Qwen3Spec) -> tuple[int, int]:
    """(parameters of the layers' matmuls, of the logit layer): what a token multiplies by (the input embedding is a
    lookup and the norms are elementwise, so neither counts)."""
    h, f, d, a, g = spec.hidden_size, spec.intermediate_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    return spec.num_layers * (h * (a + 2 * g) * d + a * d * h + 3 * h * f), spec.vocab_size * h


def _norm(width: float) -> float:
    """torch RMSNorm per token: an fp32 copy of its input (the input itself when fp32), the fp32 normalised value
    before the weight, the fp32 rstd."""
    return 8 * width + 4


def layer_bytes(spec: Qwen3Spec, tokens: int, seq: int, act_bytes: int, par: Parallel,
                recompute: str = "none", attention: str = "sdpa") -> dict[str, float]:
    """Bytes one transformer layer keeps for backward, for `tokens` tokens (micro-batch x seq) per TP rank:
    {"kept": ..., "working": ...}; "working" is what a recompute re-creates for one layer during its backward (the
    transient on top of "kept" of all layers)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"trainer.recompute={recompute!r} is invalid: must be one of {', '.join(RECOMPUTE)}")
    if attention not in ATTENTION:
        raise ValueError(f"model.attention={attention!r} is invalid: must be one of {', '.join(ATTENTION)}")
    e, t = act_bytes, par.tp
    h, f, d = spec.hidden_size, spec.intermediate_size / t, spec.head_dim
    a, g = spec.num_heads / t, spec.num_kv_heads / t
    # Replicated over TP unless sequence parallel: the two norms (input and pre-MLP) and the saved inputs of the
    # column-parallel linears (qkv, fc1); with sequence parallelism megatron keeps their [s/t] slices.
    whole = 2 * _norm(h) + 2 * e * h
    split = whole / t if par.sequence else whole
    # Per head (split over TP): q-norm input copy + normalised + rstd; k-norm likewise in bf16, but an fp32 k is a
    # view of the fused qkv output and keeps all of it alive.
    qk_norm = 8 * a * d + 4 * a + (8 * g * d + 4 * g if e != 4 else 4 * (a + 2 * g) * d + 4 * g * d + 4 * g)
    # The core attention's inputs as a recompute checkpoint (or SDPA) keeps them: q and k after RoPE, and v, a view of
    # the fused qkv output (in bf16 nothing else keeps that alive; in fp32 the k-norm already does).
    inputs = e * a * d + e * g * d + (e * (a + 2 * g) * d if e != 4 else 0)
    if attention == "sdpa":
        # the fused kernel keeps its inputs, its output (laid out like the query: linear_proj's input, counted in
        # `rest`) and an fp32 log-sum-exp per query row and head; no score tensor
        core = inputs + 4 * a
    else:
        scores = (4 + (2 if e != 4 else 0)) * a * seq  # fp32 softmax output (+ its 16-bit copy the bmm keeps)
        core = 3 * e * a * d + scores  # q, and k and v repeated to all heads, as the two bmms keep them
    rest = qk_norm + e * a * d + 5 * e * f  # linear_proj input; SwiGLU: fc1 output, silu(x), x_linear + 0, fc2 input
    rope = 4 * seq * d * e  # cos/sin of q and k, per layer, independent of the micro-batch
    full = tokens * (split + core + rest) + rope
    if recompute == "none":
        return {"kept": full, "working": 0.0}
    if recompute == "selective":
        # megatron's "core_attn" checkpoint keeps the core's inputs; with sdpa that drops only the log-sum-exp
        return {"kept": tokens * (split + inputs + rest) + rope, "working": tokens * core}
    # full: each layer's input [s, b, h] (its [s/t] slice with sequence parallelism); one layer is rebuilt at a time
    return {"kept": tokens * e * h / (t if par.sequence else 1), "working": full}


def outside_layers_bytes(spec: Qwen3Spec, tokens: int, seq: int, act_bytes: int, par: Parallel,
                         attention: str = "sdpa") -> float:
    """Kept outside the layers: the final norm, the logit layer's input, the token ids (and under TP the embedding's
    masked ids and mask), and for megatron's attention the causal mask [s, s] (bool, cached once; SDPA's causal
    kernel takes none)."""
    h = spec.hidden_size
    per_token = _norm(h) + act_bytes * h
    if par.sequence:
        per_token /= par.tp
    ids = 8 + (9 if par.tp > 1 else 0)
    return tokens * (per_token + ids) + (seq * seq if attention == "megatron" else 0)


def attention_buffer_bytes(specs, micro: int, seq: int, act_bytes: int, tp: int, attention: str = "sdpa") -> float:
    """megatron's DotProductAttention takes its [b * heads/t, s, s] score buffer from the global memory buffer
    (parallel_state.get_global_memory_buffer), allocated once at the largest size asked and kept: shared by the
    teacher and the student (same dtype), not a saved tensor, so separate from the layers' activations. SDPA has none."""
    if attention == "sdpa":
        return 0.0
    return micro * max(s.num_heads for s in specs) / tp * seq * seq * act_bytes


def kd_saved_per_token(top_k: int | None, top_p: float | None, initial_k: int, fused_lm: bool = False) -> float:
    """Bytes per token the chunked KD loss keeps between forward and backward besides the logits (which it keeps by
    reference): per kept candidate the global index (int64), the keep flag (bool) and the candidate gradient (fp32),
    per token three fp32 scalars; the dense loss keeps ~6 fp32 scalars. Plus the per-token loss and its 5 stats (fp32).
    With the LM loss fused (`fused_lm`): per candidate the student's probability (fp32), per token the label's
    column (int64), two flags, its logit and the LM loss (fp32). Top-P without top_k keeps at most the nucleus:
    estimated by the initial candidate count."""
    stats = 6 * 4
    if top_k is None and top_p is None:
        return 6 * 4 + stats
    k = top_k if top_k is not None else initial_k
    lm = k * 4 + 8 + 2 + 2 * 4 if fused_lm else 0
    return k * (8 + 1 + 4) + 3 * 4 + stats + lm


# [rows, K+1] fp32-sized temporaries of one chunk of the KD loss live at once at its peak, beyond its [rows, V/t + 1]
# buffer, its saved values and the logit gradient (tests/test_plan.py::test_the_plan_bounds_the_kd_loss_alone measures
# the loss's peak: ~1.9 for Top-K, ~9 with a nucleus cut, whose float64 cumsum and keep mask widen the chunk).
KD_CHUNK_K_ARRAYS = 2
KD_CHUNK_K_ARRAYS_CUT = 10
# per row of a Top-K chunk: the tie rule's selection of the top K + 1 (its two smallest values and their ids,
# the moved last column; kdexp.losses._shard._topk_lowest_ids)
KD_CHUNK_SELECT_ROW_BYTES = 64


def logits_bytes(tokens: int, local_vocab: int, act_bytes: int, *, needs_lm: bool, kd_saved: float,
                 chunk_rows: int, kept: int = 0, cut: bool = False,
                 cache_record: int | None = None, held: bool = False) -> dict[str, float]:
    """The logit-sized buffers at the start of the backward pass (their peak), per TP rank:
    teacher and student logits [tokens, V/t] (both kept by the KD loss and the step; with an offline teacher cache,
    `cache_record` bytes per token of the batch's decoded record instead of the teacher's logits, on every TP rank:
    kdexp.teacher.format.Layout.decoded_bytes_per_token); the LM loss's fp32 copy (which
    megatron's vocab-parallel cross-entropy turns into its saved softmax) when the balancer needs a separate LM loss
    (`needs_lm`; an LM loss fused into the KD loss has neither the copy nor a gradient of its own); the KD loss's
    O(K) values; the logit gradients (the KD loss's, plus the LM loss's cast to the logits' dtype); the KD loss's
    fp32 chunk buffer [rows, V/t + 1] (dense: two [rows, V/t], teacher and student) and its chunk's `kept`-wide
    temporaries (top-k values and indices, kept log-probs, divergence terms and gradients: small at real scale, where
    K << V/t; more with a nucleus `cut`). `held` (kdexp.losses.logits.holds_gradient): the loss works in the
    gradient's own rows, so the chunk buffer is its K-wide temporaries alone."""
    k_arrays = KD_CHUNK_K_ARRAYS_CUT if cut else KD_CHUNK_K_ARRAYS
    v = tokens * local_vocab
    return {
        **({"teacher logits": v * act_bytes} if cache_record is None else
           {"teacher cache record": tokens * cache_record}),
        "student logits": v * act_bytes,
        "LM loss fp32 softmax": v * 4 if needs_lm else 0.0,
        "KD loss saved values": tokens * kd_saved,
        "logit gradients": v * act_bytes * (2 if needs_lm else 1),
        "KD loss chunk buffer": (chunk_rows * (((0 if held else local_vocab + 1) + k_arrays * (kept + 1)) * 4
                                               + KD_CHUNK_SELECT_ROW_BYTES)
                                 if kept else
                                 2 * chunk_rows * local_vocab * 4),  # dense: a teacher and a student chunk
    }


def flops_per_token(spec: Qwen3Spec, seq: int, *, backward: bool) -> float:
    """Model FLOPs per token: 2 x matmul parameters (+ the logit layer) + attention 4*s*a*d per layer, forward;
    x3 with the backward (two matmuls per forward one)."""
    layers, logit = matmul_params(spec)
    fwd = 2 * (layers + logit) + 4 * seq * spec.num_heads * spec.head_dim * spec.num_layers
    return 3 * fwd if backward else fwd


def recompute_flops_per_token(spec: Qwen3Spec, seq: int, recompute: str) -> float:
    """Extra (hardware, not model) FLOPs per token a recompute spends: the attention core's forward (selective) or
    every layer's forward (full)."""
    attn = 4 * seq * spec.num_heads * spec.head_dim * spec.num_layers
    if recompute == "selective":
        return attn
    if recompute == "full":
        return 2 * matmul_params(spec)[0] + attn
    return 0.0


def fused_head_bytes(tokens: int, local_vocab: int, hidden: int, teacher_hidden: int, act_bytes: int, *,
                     chunk_rows: int, chunk: dict, cache_record: int | None = None) -> dict[str, float]:
    """The output layer fused into the objective (loss.fused_head, kdexp.losses.head), per TP rank, at its peak:
    the teacher's final hidden states [tokens, H_t] (or the batch's cache record), the student's as the head reads
    them [tokens, H] (a token-major copy, kept for the backward), the head's gradients (the hidden states', and the
    output weight's accumulated in fp32 [V/t, H], plus its cast when the weight is not fp32), and one chunk of tokens'
    logit working set: `chunk`, the whole-logits items (logits_bytes) of `chunk_rows` tokens. Sampled KD from an
    online teacher draws from its logits chunk by chunk (no grad) before the student's head: nothing at the peak."""
    return {
        **({"teacher hidden states": tokens * teacher_hidden * act_bytes} if cache_record is None else
           {"teacher cache record": tokens * cache_record}),
        "head hidden states": tokens * hidden * act_bytes,
        "head gradients": tokens * hidden * act_bytes + local_vocab * hidden * (4 + (act_bytes if act_bytes != 4 else 0)),
        "head chunk working set": sum(chunk.values()),
    }


# The sampler's [b, V/tp] buffers per decoded token (kdexp.models.sampling): float64 logits / temperature, their
# exponentials and probabilities, the order codes, the argsort, the sorted codes and the suffix masses (int64 /
# float64), the Gumbel scores: about 9 eight-byte values per logit, plus the fp32 logits themselves.
SAMPLER_BYTES_PER_LOGIT = 9 * 8 + 4


def rollout_bytes(spec: Qwen3Spec, rows: int, prompt: int, new: int, act_bytes: int, tp: int,
                  attention: str = "sdpa") -> dict[str, float]:
    """Generation's own memory per TP rank (kdexp.models.generate, no grad, before the training forward): megatron's
    static inference context keeps keys and values of every layer for `rows` x (prompt + new) positions
    ([max_seq, b, kv_heads/tp, head_dim] each); the prefill's one-layer transient over the prompt (as the teacher's
    no-grad forward: megatron's attention scores, or the MLP's fc1 output and products); the sampler's buffers of one
    decoded token over this rank's vocabulary shard."""
    positions = prompt + new
    kv = 2 * spec.num_layers * rows * positions * (spec.num_kv_heads // tp) * spec.head_dim * act_bytes
    scores = (4 + 4 + (2 if act_bytes == 2 else 0)) * (spec.num_heads // tp) * prompt if attention == "megatron" else 0
    prefill = rows * prompt * max(scores, 5 * act_bytes * spec.intermediate_size / tp)
    return {"KV cache": kv, "prefill layer": prefill,
            "sampler buffers": rows * (spec.vocab_size // tp) * SAMPLER_BYTES_PER_LOGIT}
