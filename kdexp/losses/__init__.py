"""kdexp.losses: logit and hidden-state distillation losses and the LM/KD loss balancers.

Pure torch + torch.distributed (no Megatron, no Hydra imports), so the trainer, the benchmark and the tests all
call the same functions:

- `logits_kd_loss(student_logits, teacher_logits, *, temperature, top_k, top_p, min_k, ghost_token,
  normalization, divergence, tp_group, return_stats, ...)`: per-token KD loss (dense, Top-K, Top-P with a min-K
  floor, ghost token for the residual mass, forward/reverse KL, generalized JSD), vocab-parallel aware.
- `AlphaBalancer(alpha)`: total = (1 - alpha) * lm + alpha * kd;  `DynamicBalancer(kd_loss_scale, skip_lm_loss)`:
  ModelOpt's legacy LogitsAndIntermediatesLossBalancer;  `make_balancer(name, **kwargs)`.
- Hidden-state losses: `cosine_hidden_loss`, `mse_hidden_loss`, `IntermediateLoss` (with a learnable projection when
  hidden sizes differ) and `scale_to_logits_loss` (intermediate rescaled to |logits loss|, no host sync).
"""

from kdexp.losses.balancers import AlphaBalancer, DynamicBalancer, make_balancer
from kdexp.losses.intermediate import IntermediateLoss, cosine_hidden_loss, mse_hidden_loss, scale_to_logits_loss
from kdexp.losses.logits import KDStats, logits_kd_loss

__all__ = [
    "logits_kd_loss",
    "KDStats",
    "AlphaBalancer",
    "DynamicBalancer",
    "make_balancer",
    "IntermediateLoss",
    "cosine_hidden_loss",
    "mse_hidden_loss",
    "scale_to_logits_loss",
]
