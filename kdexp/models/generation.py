"""Generation on the megatron-core GPTModel kdexp builds: the student's continuations of prompts, with a KV cache.

    seeds = rollout_seeds(cfg.seed, step, sample_ids)        # one stream per global sample
    r = generate(model, prompts, max_new_tokens=64, temperature=1.0, top_p=0.95, eos_id=tokenizer.eos, seeds=seeds)
    r.tokens [b, p+n]  r.generated [b, p+n]  r.lengths [b]  r.truncated [b]  r.sampler_logprobs [b, n]

The KV cache is megatron-core's own inference path: a ``StaticInferenceContext`` passed to GPTModel.forward as
``inference_context``. Each attention layer keeps its keys and values in the context's preallocated [max_seq, b, ...]
buffers, slices the rotary embedding at the context's ``sequence_len_offset`` and runs its core attention on the cached
keys; the prompt goes through once (the prefill, causal), then one token per step (no mask: the single query sees
every cached key). tests/test_generate.py checks it runs on a CPU with kdexp's SDPA attention and with megatron's
DotProductAttention, GQA, tied and untied, giving the tokens that recomputing the whole prefix at every step gives, and
that at TP 2 (gloo) it gives TP 1's tokens; it is the path megatron's own static-batching inference runs on CUDA (not
run on a GPU here: no device was available). So kdexp keeps no cache of its own. The logits are formed here from the final hidden states and this TP rank's output-weight rows (the model's
post-processing is off for the call, as in kdexp.models.final_hidden): megatron's inference post-processing insists
on gathering the whole vocabulary, the sampler (kdexp.models.sampling) needs only the shard.

Per row: temperature / top-p sampling (kdexp.models.sampling: exact across vocabulary shards), a stop at `eos_id`
(the eos is kept and counted; later positions hold `eos_id` as padding, `generated` False, log-prob 0), truncation at
max_new_tokens (`truncated` True). The noise of row i at position t is a function of (seeds[i], t, vocabulary id)
only, so a sample's tokens depend neither on the batch it sits in nor on the DP or TP size (up to the float rounding
of the forward, which differs with the batch shape and the TP reductions). Every TP rank must pass the same prompts
and seeds. Prompts share one length (a [b, p] tensor). Sequence parallelism is not supported (a decode step has one
token per row to split over the TP ranks).
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from kdexp.losses.sampled import step_seed
from kdexp.models.build import _causal_mask, _gpt, output_weight, sequence_parallel
from kdexp.models.sampling import sample_shard
from kdexp.models.vocab import padded_vocab_mask
from kdexp.rules import is_int, is_real


class Rollout(NamedTuple):
    tokens: torch.Tensor  # [b, p + n] int64: prompt, then the generated tokens, then eos_id as padding after a stop
    generated: torch.Tensor  # [b, p + n] bool: True at the generated tokens (the eos that stopped a row included)
    lengths: torch.Tensor  # [b] int64: generated tokens per row
    truncated: torch.Tensor  # [b] bool: the row reached max_new_tokens without an eos
    sampler_logprobs: torch.Tensor  # [b, n] float64: log q of each generated token under the sampled distribution


def rollout_seeds(seed: int, step: int, sample_ids) -> torch.Tensor:
    """One sampler seed per global sample index (int64 [b]): the mix of sampled KD's draws (kdexp.losses.sampled
    .step_seed) of (run seed, step, sample index), so a sample's stream does not depend on the DP rank it lands on."""
    return torch.tensor([step_seed(seed, step, int(i)) for i in sample_ids], dtype=torch.long)


def _check(prompts, max_new_tokens, temperature, top_p, eos_id, seeds, model) -> None:
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or prompts.dtype != torch.long:
        raise ValueError(f"prompts must be a [batch, prompt] int64 tensor, got {getattr(prompts, 'shape', prompts)}")
    if prompts.shape[0] < 1 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must hold at least one token per row, got shape {tuple(prompts.shape)}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not is_real(temperature) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    vocab = output_weight(model).shape[0] * _tp_size()
    if eos_id is not None and (not is_int(eos_id) or not 0 <= eos_id < vocab):
        raise ValueError(f"eos_id must be None or an id in [0, {vocab}), got {eos_id!r}")
    if not isinstance(seeds, torch.Tensor) or seeds.shape != prompts.shape[:1] or seeds.dtype != torch.long:
        raise ValueError(f"seeds must be an int64 tensor [{prompts.shape[0]}] (one per row), got "
                         f"{getattr(seeds, 'shape', seeds)}")
    spec = getattr(_gpt(model), "kdexp_spec", None)
    if spec is not None and prompts.shape[1] + max_new_tokens > spec.max_position_embeddings:
        raise ValueError(f"prompt {prompts.shape[1]} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"max_position_embeddings={spec.max_position_embeddings}")
    if sequence_parallel(model):
        raise ValueError("generation does not support sequence parallelism (parallel.sequence=true)")


def _tp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size()


@contextlib.contextmanager
def _inference(model):
    """eval mode, no autograd, GPTModel's output layer off (the caller forms the shard's logits); all restored."""
    gpt, training = _gpt(model), model.training
    model.eval()
    gpt.post_process = False
    try:
        with torch.no_grad():
            yield
    finally:
        gpt.post_process = True
        model.train(training)


class _Head:
    """Last position's hidden state [s, b, h] -> this TP rank's logits shard [b, V/tp] (float32), padded ids -inf."""

    def __init__(self, model, device):
        from megatron.core import parallel_state as ps

        self.weight = output_weight(model)
        local = self.weight.shape[0]
        self.vocab_start = ps.get_tensor_model_parallel_rank() * local
        self.group = ps.get_tensor_model_parallel_group() if _tp_size() > 1 else None
        self.padded = padded_vocab_mask(model, local, device)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        # a Float16Module wrapper hands back fp32 copies of its bf16/fp16 hidden states: back to the weight's dtype
        logits = F.linear(hidden[-1].to(self.weight.dtype), self.weight).float()
        return logits if self.padded is None else logits.masked_fill(self.padded, -math.inf)


def _sdpa(model) -> bool:
    return getattr(_gpt(model), "kdexp_attention", "megatron") == "sdpa"


def _positions(start: int, stop: int, b: int, device) -> torch.Tensor:
    return torch.arange(start, stop, device=device).unsqueeze(0).expand(b, -1)


class _Steps:
    """The forwards of one generation: with `kv_cache`, megatron's static inference context (prefill, then one
    token a step); without, the whole sequence so far at every step (the reference the cache must reproduce)."""

    def __init__(self, model, b: int, total: int, kv_cache: bool):
        self.model, self.sdpa = model, _sdpa(model)
        self.ctx = None
        if kv_cache:
            from megatron.core.inference.contexts import StaticInferenceContext

            self.ctx = StaticInferenceContext(b, total)

    def _forward(self, ids, start: int, mask):
        kw = {} if self.ctx is None else {"inference_context": self.ctx, "runtime_gather_output": True}
        return self.model(ids, _positions(start, start + ids.shape[1], ids.shape[0], ids.device), mask, **kw)

    def first(self, prompts: torch.Tensor) -> torch.Tensor:
        s = prompts.shape[1]
        hidden = self._forward(prompts, 0, None if self.sdpa else _causal_mask(s, prompts.device))
        if self.ctx is not None:
            self.ctx.sequence_len_offset = s
            self.ctx.enable_decode_mode()
        return hidden

    def next(self, tokens: torch.Tensor, end: int) -> torch.Tensor:
        """Hidden states after feeding tokens[:, :end] (its last column the newest token)."""
        if self.ctx is None:
            return self.first(tokens[:, :end])
        hidden = self._forward(tokens[:, end - 1:end], end - 1, None)
        self.ctx.sequence_len_offset = end
        return hidden


def generate(model, prompts: torch.Tensor, *, max_new_tokens: int, seeds: torch.Tensor, temperature: float = 1.0,
             top_p: float = 1.0, eos_id: Optional[int] = None, kv_cache: bool = True) -> Rollout:
    """Sample continuations of `prompts` [b, p] from `model` (see the module docstring). Every TP rank calls it with
    the same prompts and seeds and gets the same Rollout. The model's train/eval mode is restored on return."""
    _check(prompts, max_new_tokens, temperature, top_p, eos_id, seeds, model)
    b, p = prompts.shape
    device = prompts.device
    tokens = torch.cat([prompts, prompts.new_full((b, max_new_tokens), 0 if eos_id is None else eos_id)], 1)
    generated = torch.zeros(b, p + max_new_tokens, dtype=torch.bool, device=device)
    logprobs = torch.zeros(b, max_new_tokens, dtype=torch.float64, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    with _inference(model):
        head, steps = _Head(model, device), _Steps(model, b, p + max_new_tokens, kv_cache)
        hidden = steps.first(prompts)
        for t in range(max_new_tokens):
            pos = p + t
            ids, lq = sample_shard(head(hidden), vocab_start=head.vocab_start, temperature=temperature, top_p=top_p,
                                   seeds=seeds, positions=torch.full((b,), pos, dtype=torch.long), group=head.group)
            live = ~done
            tokens[:, pos] = torch.where(live, ids.to(device), tokens[:, pos])
            generated[:, pos] = live
            logprobs[:, t] = torch.where(live, lq.to(device), logprobs[:, t])
            if eos_id is not None:
                done = done | (live & (ids.to(device) == eos_id))
            if bool(done.all()) or t + 1 == max_new_tokens:
                break
            hidden = steps.next(tokens, pos + 1)
    return Rollout(tokens=tokens, generated=generated, lengths=generated.sum(1), truncated=~done,
                   sampler_logprobs=logprobs)
