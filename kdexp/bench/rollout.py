"""Generation throughput with and without the KV cache (kdexp.models.generation), on one process.

    python -m kdexp.bench.rollout [--size tiny-student] [--batch 8] [--prompt-tokens 64] [--new-tokens 64] [--threads 1]

The model is a random init of a kdexp.models.QWEN3_SIZES shape (default: the embedded default's student, with the
shipped tokenizer's vocabulary), built as the trainer builds it (--attention). Each repeat generates the same
continuations twice, with megatron's static KV cache and by recomputing the whole prefix at every step, alternating so
machine noise hits both alike; no eos, so every row runs --new-tokens steps. tokens/s counts generated tokens (batch x
new tokens) over the median wall time. `identical` is true when both paths produced the same tokens in every repeat.
The last stdout line is one JSON object.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from kdexp.bench import parser


def run(*, size: str = "tiny-student", vocab: int = 0, batch: int = 8, prompt_tokens: int = 64,
        new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, attention: str = "sdpa",
        dtype: str = "float32", repeats: int = 1, seed: int = 1) -> dict:
    from kdexp import assets, distributed, models
    from kdexp.models.generation import generate, rollout_seeds

    distributed.initialize(seed=seed)
    spec = models.get_spec(size, vocab_size=vocab or assets.shipped_vocab_size(),
                           max_position_embeddings=max(prompt_tokens + new_tokens, 1))
    model = models.build(spec, params_dtype=models.DTYPES[dtype], attention=attention)
    prompts = torch.randint(0, spec.vocab_size, (batch, prompt_tokens), generator=torch.Generator().manual_seed(seed))
    seeds = rollout_seeds(seed, 0, range(batch))
    times: dict = {"kv_cache": [], "recompute": []}
    identical = True
    for _ in range(repeats):
        out = {}
        for path in ("kv_cache", "recompute"):
            t0 = time.perf_counter()
            out[path] = generate(model, prompts, max_new_tokens=new_tokens, seeds=seeds, temperature=temperature,
                                 top_p=top_p, kv_cache=path == "kv_cache").tokens
            times[path].append(time.perf_counter() - t0)
        identical = identical and torch.equal(out["kv_cache"], out["recompute"])
    tokens = batch * new_tokens
    r = {"size": size, "vocab": spec.vocab_size, "attention": attention, "dtype": dtype, "batch": batch,
         "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "temperature": temperature, "top_p": top_p,
         "repeats": repeats, "threads": torch.get_num_threads()}
    for path in times:
        r[f"{path}_s"] = times[path]
        r[f"{path}_tokens_per_s"] = tokens / statistics.median(times[path])
    r["kv_cache_speedup"] = r["kv_cache_tokens_per_s"] / r["recompute_tokens_per_s"]
    r["identical"] = identical
    return r


def main(argv=None) -> None:
    ap = parser(__spec__.name, __doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny-student", help="the student's shape: a Qwen3 size or tiny-student / "
                    "tiny-teacher")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size; 0: the shipped tokenizer's")
    ap.add_argument("--batch", type=int, default=8, help="sequences generated together")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus of the sampler (1.0: the whole vocabulary)")
    ap.add_argument("--attention", default="sdpa", choices=("sdpa", "megatron"), help="the model's attention")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the model's weights")
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds of each path (the median is reported)")
    ap.add_argument("--seed", type=int, default=1, help="the model's init and the samples' seed")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads; 0 keeps torch's default (on a shared CPU, more threads than free "
                         "cores make every small op wait)")
    args = ap.parse_args(argv)
    for key in ("batch", "prompt_tokens", "new_tokens", "repeats"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.threads < 0:
        ap.error(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.vocab < 0:
        ap.error(f"--vocab must be >= 0, got {args.vocab}")
    if not args.temperature > 0:
        ap.error(f"--temperature must be > 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    r = run(size=args.size, vocab=args.vocab, batch=args.batch, prompt_tokens=args.prompt_tokens,
            new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p, attention=args.attention,
            dtype=args.dtype, repeats=args.repeats, seed=args.seed)
    print(f"generation: {r['size']} (vocab {r['vocab']}, {r['attention']}, {r['dtype']}), batch {r['batch']} x "
          f"prompt {r['prompt_tokens']} + {r['new_tokens']} new tokens, {r['threads']} CPU thread(s)")
    for path in ("kv_cache", "recompute"):
        print(f"  {path:<9} {r[f'{path}_tokens_per_s']:10,.1f} tokens/s")
    print(f"  kv_cache_speedup {r['kv_cache_speedup']:.2f}x, identical tokens: {r['identical']}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
