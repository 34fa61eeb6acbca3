"""Teacher-cache record sizes and build times: bytes per token of each store, and each store's build here.

    python -m kdexp.bench.cache [--samples 16] [hydra overrides ...]

Bytes per token (kdexp.teacher.format.Layout.bytes_per_token, one temperature): `topk` at K_max 1,024 / 128 / 32
with float32 and bfloat16 values, `sampled` (loss.samples draws), and `hidden` (the teacher's final hidden states in
its params dtype) at the run's teacher and, computed from their shapes, at Qwen3-1.7B / 8B / 32B teachers (vocabulary
151,936: 3-byte ids; hidden in bfloat16). Then one build of each store (top-K_max at the run's teacher.k_max, sampled,
hidden) over the first `--samples` training windows with the run's teacher (the trainer's own setup), into a
temporary directory, timed: seconds per 1,000 tokens. The last line is JSON (the numbers of docs/teacher-cache.md).
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_module

import kdexp.config  # noqa: F401
from kdexp import distributed
from kdexp.bench import parser
from kdexp.config.qwen3 import QWEN3_SIZES
from kdexp.teacher import format as fmt
from kdexp.teacher.writer import cache_key, ensure_at, layout_for
from kdexp.train.loop import setup
from kdexp.train.teacher import teacher_identity

QWEN3_VOCAB = 151_936
TOPK = (1024, 128, 32)
QWEN3 = ("1.7b", "8b", "32b")


def _compose(overrides: list[str]):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def sizes(cfg, vocab: int, teacher_hidden: int, teacher_dtype: str) -> dict[str, int]:
    """Store label -> bytes per token, at the run's vocabulary and teacher, then at Qwen3 teachers."""
    out = {}
    for label, v in (("", vocab), ("qwen3 ", QWEN3_VOCAB)):
        for k in TOPK:
            for values in ("float32", "bfloat16"):
                lay = fmt.Layout(samples=0, seq_length=1, k_max=k, temperatures=(1.0,), values=values,
                                 index_bytes=fmt.index_bytes(v), shard_samples=1)
                out[f"{label}topk K_max {k} {values}"] = lay.bytes_per_token()
        sampled = fmt.Layout(samples=0, seq_length=1, k_max=0, record="sampled", draws=int(cfg.loss.samples or 64),
                             proposal_temperature=1.0, draw_seed=0, temperatures=(1.0,), values="bfloat16",
                             index_bytes=fmt.index_bytes(v), shard_samples=1)
        out[f"{label}sampled {sampled.draws} draws bfloat16"] = sampled.bytes_per_token()
    hidden = {"embedded teacher": (teacher_hidden, teacher_dtype),
              **{f"Qwen3-{n.upper()}": (QWEN3_SIZES[n].hidden_size, "bfloat16") for n in QWEN3}}
    for name, (h, dtype) in hidden.items():
        lay = fmt.Layout(samples=0, seq_length=1, k_max=0, record="hidden", hidden_size=h, temperatures=(),
                         values=dtype, index_bytes=1, shard_samples=1)
        out[f"hidden {name} (H {h}) {dtype}"] = lay.bytes_per_token()
    return out


def main(argv=None) -> dict:
    ap = parser(__spec__.name, __doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=16, help="training windows each timed build covers")
    ap.add_argument("overrides", nargs="*", help="kdexp.run overrides of the setup (key=value, group=option)")
    args = ap.parse_intermixed_args(argv)
    if args.samples < 1:
        ap.error(f"--samples must be >= 1, got {args.samples}")
    base = _compose(args.overrides)
    kdexp.config.validate(base)
    distributed.initialize(tensor_parallel=base.parallel.tensor, seed=base.trainer.seed)
    s = setup(base)  # the trainer's own data and teacher
    dtype = str(next(s.teacher.parameters()).dtype).removeprefix("torch.")
    result = {"bytes_per_token": sizes(base, s.data.vocab_size, s.teacher.kdexp_spec.hidden_size, dtype),
              "build_s_per_1k_tokens": {}, "samples": args.samples, "seq_length": int(base.trainer.seq_length)}
    tokens = args.samples * int(base.trainer.seq_length)
    stores = {"topk": ["teacher=cached", "teacher.store=topk"],
              "sampled": ["teacher=cached", "loss=sampled", "teacher.store=sampled"],
              "hidden": ["teacher=cached", "teacher.store=hidden"]}
    with tempfile.TemporaryDirectory(prefix="kdexp-bench-cache-") as root:
        for store, extra in [("warmup", stores["hidden"]), *stores.items()]:  # warmup: untimed first forward
            cfg = _compose(args.overrides + extra)
            layout = layout_for(cfg, s.data, s.teacher).grown(min(args.samples, len(s.data.train_ds)))
            key = cache_key(cfg, s.data, layout, teacher_identity(cfg, s.data))
            started = time.perf_counter()
            ensure_at(Path(root) / store, key, layout, s.teacher, s.data.train_ds, int(cfg.trainer.micro_batch_size))
            seconds = time.perf_counter() - started
            if store == "warmup":
                continue
            result["build_s_per_1k_tokens"][f"{store} ({layout.describe()}, {layout.values})"] = \
                round(1000 * seconds / tokens, 4)
    if distributed.is_rank0():
        width = max(len(k) for k in result["bytes_per_token"])
        print(f"{'store':<{width}} {'bytes/token':>12}")
        for k, v in result["bytes_per_token"].items():
            print(f"{k:<{width}} {v:>12,}")
        print(f"build over {args.samples} windows x {base.trainer.seq_length} tokens here:")
        for k, v in result["build_s_per_1k_tokens"].items():
            print(f"  {k}: {v:.3f} s per 1,000 tokens")
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
