"""kdexp.losses: logit and hidden-state distillation losses and the LM/KD loss balancers.

Pure torch + torch.distributed (no Megatron, no Hydra imports), so the trainer, the benchmark and the tests all
call the same functions:

- `logits_kd_loss(student_logits, teacher_logits, *, temperature, top_k, top_p, min_k, ghost_token,
  normalization, divergence, tp_group, return_stats, ...)`: per-token KD loss (dense, Top-K, Top-P with a min-K
  floor, ghost token for the residual mass, forward/reverse KL, generalized JSD), vocab-parallel aware; with
  `labels=` (Top-K / Top-P at T = 1) also the LM cross-entropy from the same pass over the vocabulary: (kd, lm).
- `teacher_topk_record(teacher_logits, k_max, temperatures)` / `cached_kd_loss(student_logits, values, indices, lse,
  lse_rest, ...)`: what an offline teacher cache stores per token, and the same loss computed from it.
- `KDLossOptions`: the loss options (the keywords above, their defaults and value rules), defined once; the config
  schema subclasses it and `KDLossOptions.from_config(node).kwargs()` turns a config node into the keywords.
- `AlphaBalancer(alpha)`: total = (1 - alpha) * lm + alpha * kd;  `DynamicBalancer(kd_loss_scale, skip_lm_loss)`:
  ModelOpt's legacy LogitsAndIntermediatesLossBalancer;  `BalancerOptions` (keys, rules, `from_config(node).build()`)
  and `make_balancer(name, **kwargs)`: the one balancer factory.
- Hidden-state losses: `cosine_hidden_loss`, `mse_hidden_loss`, `IntermediateLoss` (with a learnable projection when
  hidden sizes differ) and `scale_to_logits_loss` (intermediate rescaled to |logits loss|, no host sync);
  `IntermediatePair` (one loss.intermediate entry) and `check_intermediate` (its rules).
- Sampled KD (RS-KD): `sample_teacher(teacher_logits, samples=..., proposal_temperature=..., seed=...)` ->
  `TokenSamples(ids, counts, weights, teacher_logprobs)`, `sampled_kd_loss(student_logits, ids, weights, ...)`,
  `SampledKDOptions` (loss.samples, loss.proposal_temperature and their rules); `draw_teacher(...)` ->
  `TeacherDraws` (the draws with what weighs them at any temperature: the teacher cache's "sampled" record) and
  `weigh(draws, temperature=...)` -> `TokenSamples`, the two halves of `sample_teacher`. Both take the teacher's
  logits as a tensor or as `LogitRows` (formed chunk by chunk: the fused head's teacher).
- The fused head: `fused_head_loss(hidden, weight, loss_fn, token_weight=..., coefficients=...)` -> `HeadResult(kd, lm,
  stats)`, the output layer and any per-token loss above chunk by chunk (`loss_fn(z, rows)` -> `ChunkLoss`), never
  the [tokens, vocab] logits; `teacher_head_logits` (an online teacher's chunk), `tp_copy` (the TP input region).
"""

from __future__ import annotations

from kdexp import lazy_exports

# name -> module. Loaded on first use (PEP 562), so that kdexp.config can import the torch-free option classes
# without importing torch: a config error or `--cfg job` stays quick.
_EXPORTS = {
    "logits_kd_loss": "logits", "KDStats": "logits",
    "cached_kd_loss": "cached", "teacher_topk_record": "cached", "TeacherRecord": "cached",
    "KDLossOptions": "options", "BalancerOptions": "options", "DIVERGENCES": "options", "NORMALIZATIONS": "options",
    "BALANCERS": "options",
    "AlphaBalancer": "balancers", "DynamicBalancer": "balancers", "make_balancer": "balancers",
    "IntermediateLoss": "intermediate", "cosine_hidden_loss": "intermediate", "mse_hidden_loss": "intermediate",
    "scale_to_logits_loss": "intermediate", "IntermediatePair": "options", "check_intermediate": "options",
    "SampledKDOptions": "options", "sample_teacher": "sampled", "sampled_kd_loss": "sampled", "TokenSamples": "sampled",
    "importance_weights": "sampled", "draw_teacher": "sampled", "weigh": "sampled", "TeacherDraws": "sampled",
    "LogitRows": "sampled",
    "fused_head_loss": "head", "ChunkLoss": "head", "HeadResult": "head", "teacher_head_logits": "head",
    "tp_copy": "head",
}
__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
