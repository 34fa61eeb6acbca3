"""One attention layer, forward + backward: model.attention=sdpa against megatron's unfused DotProductAttention.

    python -m kdexp.bench.attention [--seq 4096] [--batch 1] [--repeats 3] [--dtype float32] [--size 0.6b]

The layer is megatron's SelfAttention as kdexp builds it (fused QKV, q/k RMSNorm, RoPE, the core attention, the
output projection) with a Qwen3 size's heads (0.6B: 16 query heads over 8 kv heads of 128, hidden 1024), once per
core attention from the same weights, on the same input. Peak memory is the peak of the tensor storages the
forward + backward creates (kdexp.bench.losses.PeakTensorMemory: what an allocator must hold, on the CPU or a GPU),
measured on the first call after megatron's global score buffer is dropped, so that buffer counts; time is the
median of `--repeats` calls, the two variants alternating so machine noise hits both alike. Goals: memory
ratio sdpa/megatron <= 0.25 and time ratio <= 1.0. The last stdout line is one JSON object.
"""
from __future__ import annotations

import json
import statistics
import time

import torch
from kdexp.bench import parser

GOALS = {"memory_ratio": 0.25, "time_ratio": 1.0}


def _layer(spec, attention: str, dtype: torch.dtype):
    from megatron.core.transformer.spec_utils import build_module

    from kdexp.models.build import layer_spec, transformer_config

    config = transformer_config(spec, params_dtype=dtype)
    return build_module(layer_spec(attention).submodules.self_attention, config=config, layer_number=1).to(dtype)


def _rope(spec, seq: int):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    emb = RotaryEmbedding(spec.head_dim, rotary_percent=1.0, rotary_base=spec.rope_theta)(seq)
    return emb, emb


def _step(layer, x, mask, rope) -> None:
    out, _ = layer(x, attention_mask=mask, rotary_pos_emb=rope)
    out.float().sum().backward()


def run(*, seq: int = 4096, batch: int = 1, repeats: int = 3, dtype: str = "float32", size: str = "0.6b") -> dict:
    from megatron.core import parallel_state

    from kdexp import distributed, models
    from kdexp.bench.losses import PeakTensorMemory
    from kdexp.models.build import _causal_mask

    distributed.initialize(seed=1)
    spec = models.get_spec(size)
    dt = getattr(torch, dtype)
    layers = {}
    for attention in ("sdpa", "megatron"):
        distributed.reseed(1)
        layers[attention] = _layer(spec, attention, dt)
    layers["sdpa"].load_state_dict(layers["megatron"].state_dict())
    torch.manual_seed(0)
    x = torch.randn(seq, batch, spec.hidden_size, dtype=dt).requires_grad_()
    rope = _rope(spec, seq)
    masks = {"sdpa": None, "megatron": _causal_mask(seq, x.device)}  # as vocab_parallel_logits passes them
    out: dict = {"seq": seq, "batch": batch, "dtype": dtype, "heads": spec.num_heads, "kv_heads": spec.num_kv_heads,
                 "head_dim": spec.head_dim, "hidden": spec.hidden_size, "threads": torch.get_num_threads()}
    for attention in ("sdpa", "megatron"):
        parallel_state._GLOBAL_MEMORY_BUFFER = None  # megatron's score buffer is allocated (and counted) anew
        parallel_state._set_global_memory_buffer()
        x.grad = None
        with PeakTensorMemory() as mem:
            _step(layers[attention], x, masks[attention], rope)
        out[attention] = {"peak_bytes": mem.peak, "ms": []}
    for _ in range(repeats):
        for attention in ("sdpa", "megatron"):
            x.grad = None
            layers[attention].zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            _step(layers[attention], x, masks[attention], rope)
            out[attention]["ms"].append((time.perf_counter() - t0) * 1e3)
    for attention in ("sdpa", "megatron"):
        out[attention]["median_ms"] = statistics.median(out[attention]["ms"])
    out["memory_ratio"] = out["sdpa"]["peak_bytes"] / out["megatron"]["peak_bytes"]
    out["time_ratio"] = out["sdpa"]["median_ms"] / out["megatron"]["median_ms"]
    out["goals"] = GOALS
    out["meets_goals"] = out["memory_ratio"] <= GOALS["memory_ratio"] and out["time_ratio"] <= GOALS["time_ratio"]
    return out


def main(argv=None) -> None:
    ap = parser(__spec__.name, __doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096, help="sequence length")
    ap.add_argument("--batch", type=int, default=1, help="sequences per batch")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per path (the median is reported)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="activation dtype")
    ap.add_argument("--size", default="0.6b", help="a kdexp.models.QWEN3_SIZES name whose heads to use")
    args = ap.parse_args(argv)
    for key in ("seq", "batch", "repeats"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    r = run(seq=args.seq, batch=args.batch, repeats=args.repeats, dtype=args.dtype, size=args.size)
    print(f"attention layer fwd+bwd: {r['heads']} q heads / {r['kv_heads']} kv heads x {r['head_dim']}, hidden "
          f"{r['hidden']}, batch {r['batch']} x seq {r['seq']}, {r['dtype']}, {r['threads']} CPU thread(s)")
    for attention in ("sdpa", "megatron"):
        a = r[attention]
        print(f"  {attention:<9} peak {a['peak_bytes'] / 2**20:9,.1f} MiB   median {a['median_ms']:9,.1f} ms  "
              f"({', '.join(f'{m:,.0f}' for m in a['ms'])})")
    print(f"  ratio sdpa/megatron: memory {r['memory_ratio']:.3f} (goal <= {GOALS['memory_ratio']}), time "
          f"{r['time_ratio']:.3f} (goal <= {GOALS['time_ratio']})")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
