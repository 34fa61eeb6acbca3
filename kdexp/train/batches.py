"""What a training step reads of a batch: its fields on the device, and the seed of each micro-batch's draws."""
from __future__ import annotations

from kdexp import distributed
from kdexp.losses.sampled import step_seed


def batch_to(batch: dict, device) -> dict:
    """The fields the objective reads, on the device (position ids are rebuilt by the model code, not copied);
    sample_index (the key into an offline teacher cache) stays on the host."""
    out = {k: batch[k].to(device, non_blocking=True) for k in ("tokens", "labels", "loss_mask")}
    if "sample_index" in batch:
        out["sample_index"] = batch["sample_index"]
    return out


def sampling_seed(cfg, step: int, micro: int = 0) -> int:
    """The sampled-KD seed of micro-batch `micro` of a (0-based) training step on this data-parallel rank: from
    trainer.seed, the step and the micro-batch only, so a resumed run draws exactly what the uninterrupted one drew
    and no two micro-batches of a step (or DP ranks) reuse a stream."""
    st = distributed.state()
    return step_seed(cfg.trainer.seed, step, st.dp_rank + st.dp_size * micro)
