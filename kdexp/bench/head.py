"""Benchmark of the fused output head (kdexp.losses.head) against the unfused head + loss, in one process.

    python -m kdexp.bench.head [--tokens 2048] [--hidden 1024] [--teacher-hidden 2048] [--vocab 151936]
                               [--top-k 1024] [--alpha 0.5] [--chunk-tokens N] [--repeats 3] [--threads N]
                               [--modes coeff,recompute]

The default is Qwen3-0.6B's head (H 1024, V 151,936; the student's output weight is a leaf parameter, as Qwen3-0.6B's
tied embedding is at the head) distilled from a 1.7B-sized online teacher head (H 2048), 2,048 tokens, fp32 on CPU:
online Top-K 1024 + ghost token + the fused LM loss (labels with ~5% ignored ids), the alpha balancer
total = (1 - alpha) lm + alpha kd. Both paths include the teacher's head: unfused = teacher logits and student logits
[tokens, V] through kdexp.losses.logits_kd_loss, then token-weighted means and backward; fused = fused_head_loss, the
teacher's logits formed per chunk by teacher_head_logits inside loss_fn. Modes: "coeff" passes the balancer's
coefficients (gradients computed in forward), "recompute" does not (each chunk formed again in backward).
Weights are random: teacher logits ~ N(0, (--teacher-scale)^2) (5: a peaked distribution, as kdexp.bench.losses),
student logits ~ N(0, 4).

Memory, "peak extra": a TorchDispatchMode records every tensor storage the ops create during one forward+backward
and when it is freed (storage finalizer), as a timeline; the peak extra is the maximum over that timeline of the
live bytes, NOT counting the storages that end up as the returned gradients (hidden.grad [tokens, H] and
weight.grad [V, H], which any implementation must return) at any time. Inputs and parameters exist before the call
and are not counted; the teacher's and student's logits, their gradients, the losses' buffers and, in the fused
coeff mode, nothing else of size V are. What it cannot see: memory allocated inside one kernel without a tensor
(BLAS packing buffers, small). Both paths are measured the same way, in the same process, on the same inputs.
`peak_vs_fp32_logits` = fused (coeff) peak extra / bytes of one fp32 [tokens, V] tensor.
Time: wall-clock fwd+bwd outside the dispatch mode. After each path's measured (warm-up) run, --repeats rounds time
every path once each, in turn (unfused, fused coeff, fused recompute), so that a slow spell of a shared CPU hits all
of them; a ratio is the median over rounds of that round's fused / unfused time (its spread: the `*_round_ratios`
lists), the seconds are per-path medians. --repeats 0 times the measured runs themselves (the mode costs a Python
call per op: well under 1% at full size). Single runs on this 2-core CPU scattered from 1.04 to 1.35 for one
setting: compare the median ratio of several rounds.

The last stdout line is one JSON object: peak_vs_fp32_logits, time_ratio (fused coeff / unfused),
recompute_peak_vs_fp32_logits, recompute_time_ratio, the unfused numbers and the agreement of the two paths.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import NamedTuple

import torch

from kdexp.bench.losses import StorageTimeline
from kdexp.losses import logits_kd_loss
from kdexp.losses.chunking import head_rows
from kdexp.losses.head import ChunkLoss, fused_head_loss, teacher_head_logits
from kdexp.bench import parser


def _inputs(a):
    g = torch.Generator().manual_seed(0)
    n, h, ht, v = a.tokens, a.hidden, a.teacher_hidden, a.vocab
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g).mul_(2.0 / h ** 0.5)
    th = torch.randn(n, ht, generator=g)
    wt = torch.randn(v, ht, generator=g).mul_(a.teacher_scale / ht ** 0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.05] = -100
    token_weight = torch.full((n,), 1.0 / n)
    return hidden, weight, th, wt, labels, token_weight


def _loss_kwargs(a):
    return dict(top_k=a.top_k, ghost_token=True, return_stats=True)


def unfused(hidden, weight, th, wt, labels, tw, a):
    with torch.no_grad():
        t = th @ wt.T
    (kd, lm), st = logits_kd_loss(hidden @ weight.T, t, labels=labels, **_loss_kwargs(a))
    return (kd * tw).sum(), (lm * tw).sum(), (st.student_residual_mass * tw).sum()


class _Ghost(NamedTuple):
    ghost_mass: torch.Tensor


def fused(hidden, weight, th, wt, labels, tw, a, mode):
    def loss_fn(z, r):
        (kd, lm), st = logits_kd_loss(z, teacher_head_logits(th, wt, r), labels=labels[r], chunk_tokens=z.shape[0],
                                      **_loss_kwargs(a))
        return ChunkLoss(kd, lm, _Ghost(st.student_residual_mass))

    res = fused_head_loss(hidden, weight, loss_fn, token_weight=tw, chunk_tokens=a.chunk_tokens,
                          coefficients=(a.alpha, 1.0 - a.alpha) if mode == "coeff" else None)
    return res.kd, res.lm, res.stats.ghost_mass


def _fwd_bwd(path, hidden0, weight0, rest, a):
    hidden = hidden0.detach().requires_grad_(True)
    weight = weight0.detach().requires_grad_(True)
    kd, lm, ghost = path(hidden, weight, *rest, a)
    ((1.0 - a.alpha) * lm + a.alpha * kd).backward()
    return (float(kd.detach()), float(lm.detach()), float(ghost)), hidden.grad, weight.grad


def measure(path, hidden, weight, rest, a):
    """One measured run: (values, grads, peak extra bytes, seconds)."""
    t0 = time.perf_counter()
    with StorageTimeline() as tl:
        vals, gh, gw = _fwd_bwd(path, hidden, weight, rest, a)
        peak = tl.peak_excluding([gh, gw])
    return vals, (gh, gw), peak, time.perf_counter() - t0


def timed_rounds(paths: dict, hidden, weight, rest, a, rounds: int) -> dict[str, list[float]]:
    """Seconds of fwd+bwd per path, `rounds` times, the paths in turn within each round."""
    times = {name: [] for name in paths}
    for _ in range(rounds):
        for name, path in paths.items():
            t0 = time.perf_counter()
            _fwd_bwd(path, hidden, weight, rest, a)
            times[name].append(time.perf_counter() - t0)
    return times


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main(argv=None):
    ap = parser(__spec__.name, __doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens (rows of the logits)")
    ap.add_argument("--hidden", type=int, default=1024, help="student hidden size")
    ap.add_argument("--teacher-hidden", type=int, default=2048, help="teacher hidden size")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3's)")
    ap.add_argument("--top-k", type=int, default=1024, help="loss.top_k")
    ap.add_argument("--teacher-scale", type=float, default=5.0,
                    help="std of the random teacher logits (sets how peaked the teacher is)")
    ap.add_argument("--alpha", type=float, default=0.5, help="total = (1 - alpha) lm + alpha kd")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="rows per chunk; unset: kdexp.losses.chunking.head_rows decides")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed rounds after the measured warm-up runs, the paths in turn within each round (0: time "
                         "the measured runs themselves)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads; unset: torch's default")
    ap.add_argument("--modes", default="coeff,recompute", help="fused-head backward modes to time, comma-separated")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in ("coeff", "recompute") for m in modes):
        ap.error(f"--modes must be a comma list of coeff, recompute; got {a.modes!r}")
    if a.repeats < 0:
        ap.error(f"--repeats must be >= 0, got {a.repeats}")
    if a.threads:
        torch.set_num_threads(a.threads)
    hidden, weight, *rest = _inputs(a)
    logits_bytes = a.tokens * a.vocab * 4
    rows = head_rows(a.tokens, a.vocab, torch.float32, a.chunk_tokens)
    print(f"head bench: tokens {a.tokens}, H {a.hidden}, teacher H {a.teacher_hidden}, V {a.vocab}, top-k {a.top_k}, "
          f"chunk {rows} tokens, threads {torch.get_num_threads()}; one fp32 [tokens, V] = {logits_bytes / 2**20:.0f} "
          "MiB", flush=True)
    paths = {"unfused": unfused}
    paths.update({mode: (lambda *x, m=mode: fused(*x, m)) for mode in modes})
    measured = {}
    for name, path in paths.items():  # values, gradients and memory; each path's warm-up
        vals, grads, peak, sec = measure(path, hidden, weight, rest, a)
        if name == "unfused":
            ref_vals, ref_grads = vals, grads
            diff = None
        else:
            diff = (max(abs(x - y) for x, y in zip(vals, ref_vals)),
                    max(_rel(g, r) for g, r in zip(grads, ref_grads)))
        measured[name] = (vals, peak, sec, diff)
        del grads
    del ref_grads
    times = timed_rounds(paths, hidden, weight, rest, a, a.repeats) if a.repeats else \
        {name: [m[2]] for name, m in measured.items()}
    vals_u, peak_u, _, _ = measured["unfused"]
    sec_u = statistics.median(times["unfused"])
    print(f"unfused: {sec_u:.2f} s, peak extra {peak_u / 2**20:.0f} MiB ({peak_u / logits_bytes:.3f} x fp32 logits)"
          f", kd {vals_u[0]:.6f} lm {vals_u[1]:.6f}", flush=True)
    out = dict(tokens=a.tokens, hidden=a.hidden, teacher_hidden=a.teacher_hidden, vocab=a.vocab, top_k=a.top_k,
               chunk_tokens=rows, threads=torch.get_num_threads(), rounds=a.repeats or 1,
               fp32_logits_bytes=logits_bytes, unfused_peak_bytes=peak_u,
               unfused_peak_vs_fp32_logits=round(peak_u / logits_bytes, 4), unfused_s=round(sec_u, 3),
               unfused_times_s=[round(t, 3) for t in times["unfused"]])
    for mode in modes:
        _, peak, _, (loss_diff, grad_diff) = measured[mode]
        sec = statistics.median(times[mode])
        ratios = [f / u for f, u in zip(times[mode], times["unfused"])]
        ratio = statistics.median(ratios)
        print(f"fused {mode}: {sec:.2f} s ({ratio:.3f} x unfused, median of {len(ratios)} round(s): "
              f"{', '.join(f'{r:.3f}' for r in ratios)}), peak extra {peak / 2**20:.0f} MiB "
              f"({peak / logits_bytes:.3f} x fp32 logits), |loss diff| {loss_diff:.2e}, grad rel diff {grad_diff:.2e}",
              flush=True)
        key = "" if mode == "coeff" else "recompute_"
        out.update({f"{key}peak_bytes" if key else "fused_peak_bytes": peak,
                    f"{key}peak_vs_fp32_logits": round(peak / logits_bytes, 4),
                    f"{key}time_ratio": round(ratio, 4), f"{key}round_ratios": [round(r, 4) for r in ratios],
                    f"{key or 'fused_'}s": round(sec, 3),
                    f"{key or 'fused_'}times_s": [round(t, 3) for t in times[mode]]})
    diffs = [measured[mode][3] for mode in modes]
    out.update(max_abs_loss_diff=max(d[0] for d in diffs), max_rel_grad_diff=max(d[1] for d in diffs))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
