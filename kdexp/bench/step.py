"""KD step overhead on the embedded default: a distillation train step vs (student fwd+bwd + teacher fwd).

    python -m kdexp.bench.step [--steps 20] [hydra overrides ...]

Both variants run interleaved in one process on the same batches, so machine noise hits both alike; the table gives
medians and the ratio. The baseline is what any distillation must pay anyway (the teacher's forward and the student's
forward + backward with the LM loss); the difference is the cost of the KD loss itself. Both end like a trainer step:
DP gradient averaging, clipping, the non-finite guard's one host read, the optimizer step. The setup is the
trainer's own (kdexp.train.loop.setup).

``--versus KEY=VALUE ...`` builds a second trainer setup with those overrides added and times its KD step in the same
interleaved rotation, on the same batches: ``--versus model.attention=megatron`` is the embedded default's step with
SDPA against megatron's attention, ``--versus loss.fused_head=false`` the fused head against the logits path.

With ``teacher=cached`` the KD step reads the offline teacher cache (built first if missing; any ``teacher.store``: a
hidden store's step also forms the teacher's logits with its output layer) and the baseline is the LM-only student
step (no teacher at all): the ratio is what distilling from the cache costs over plain training.

With ``rollout=on_policy`` an on-policy step joins the rotation, timed in three parts on the same batches: generation
(the student continues the prompts, KV cache), teacher scoring (its forward on the rollouts) and the update (student
forward + backward of the rollout loss, the optimizer step); the table gives each part's median and their sum.
"""
from __future__ import annotations

import itertools
import statistics
import time

import torch
from hydra import compose, initialize_config_module

import kdexp.config  # noqa: F401
from kdexp import distributed
from kdexp.data import batches
from kdexp.train.batches import batch_to
from kdexp.train.loop import setup
from kdexp.train.step import StepDriver, rollout_micro_batches
from kdexp.bench import parser

# teacher kind -> (what the baseline pays for the teacher, the KD step), the table's rows
LABELS = {"online": ("teacher fwd + student fwd+bwd (LM)", "KD train step (teacher, student, KD+LM)"),
          "cached": ("student fwd+bwd (LM only, no teacher)", "KD train step from the teacher cache")}


def main(argv=None) -> None:
    ap = parser(__spec__.name, __doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--versus", nargs="+", default=None, metavar="KEY=VALUE",
                    help="overrides of a second setup whose KD step is timed in the same rotation")
    ap.add_argument("overrides", nargs="*", help="kdexp.run overrides of the setup (key=value, group=option)")
    args = ap.parse_intermixed_args(argv)  # options may follow the overrides (README lines + --steps N)
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0, got --steps {args.steps} --warmup {args.warmup}")
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=args.overrides)
        other = compose(config_name="config", overrides=args.overrides + args.versus) if args.versus else None
    kdexp.config.validate(cfg)
    if other is not None:
        kdexp.config.validate(other)
    st = distributed.initialize(tensor_parallel=cfg.parallel.tensor, seed=cfg.trainer.seed)
    t = cfg.trainer
    s = setup(cfg)  # the trainer's own setup: same data, teacher (cache key), reseed, student, objective, optimizer
    driver = StepDriver(s, cfg)  # the trainer's own step sequence
    versus = StepDriver(setup(other), other) if other is not None else None

    def stream():  # the timed steps may outnumber the trainer's batches: start the stream over
        while True:  # (a cache holds the run's max_steps batches: start over after those)
            yield from itertools.islice(batches(s.data.train_ds, micro_batch_size=t.micro_batch_size,
                                                dp_rank=st.dp_rank, dp_size=st.dp_size), t.max_steps)

    train_batches = stream()

    def kd_step(i, batch):
        driver.step(i, batch)

    cached = cfg.teacher.name == "cached"

    def baseline_step(i, batch):  # the teacher's forward (none from a cache, of any store) + the LM-only student step
        driver.lm_step(i, batch, teacher=not cached)

    variants = [("baseline", baseline_step), ("kd", kd_step)]
    if versus is not None:
        variants.append(("versus", versus.step))
    times = {name: [] for name, _ in variants}
    on_policy = cfg.rollout.name == "on_policy"
    if on_policy:
        parts = {"generation": [], "teacher scoring": [], "update": []}

        def on_policy_step(i, batch):
            timed = {}
            start = _now(st.device)
            rolled = rollout_micro_batches(s.student, s.objective, [batch], i)
            timed["generation"], start = _now(st.device) - start, _now(st.device)
            with torch.no_grad():
                scored = [s.objective.teacher(b) for b in rolled]
            timed["teacher scoring"], start = _now(st.device) - start, _now(st.device)
            driver.on_policy_update(i, rolled, scored)
            timed["update"] = _now(st.device) - start
            if i >= args.warmup:
                for key, value in timed.items():
                    parts[key].append(value)

        variants.append(("on-policy", on_policy_step))
        times["on-policy"] = []
    for i in range(args.warmup + args.steps):
        batch = batch_to(next(train_batches), st.device)
        shift = i % len(variants)  # each variant runs first, second, ... equally often
        for name, fn in variants[shift:] + variants[:shift]:
            if st.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn(i, batch)
            if st.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    kd, base = statistics.median(times["kd"]), statistics.median(times["baseline"])
    if st.rank == 0:
        tokens = t.micro_batch_size * t.seq_length
        print(f"loss={cfg.loss.name} top_k={cfg.loss.top_k} top_p={cfg.loss.top_p} vocab={s.data.vocab_size} "
              f"tokens/step={tokens} device={st.device} steps={args.steps} teacher={cfg.teacher.name}")
        print(f"{'variant':<40} {'median ms':>10}")
        baseline_label, kd_label = LABELS[cfg.teacher.name]
        print(f"{baseline_label:<40} {1000 * base:>10.1f}")
        print(f"{kd_label:<40} {1000 * kd:>10.1f}")
        if versus is not None:
            print(f"{kd_label + ', ' + ' '.join(args.versus):<40} "
                  f"{1000 * statistics.median(times['versus']):>10.1f}")
        if on_policy:
            total = 0.0
            for key, values in parts.items():
                total += statistics.median(values)
                print(f"{'on-policy step: ' + key:<40} {1000 * statistics.median(values):>10.1f}")
            print(f"{'on-policy step (sum of the parts)':<40} {1000 * total:>10.1f}")
        print(f"KD overhead: {100 * (kd / base - 1):+.1f}%  (ratio {kd / base:.3f})")
        if versus is not None:
            print(f"KD step vs {' '.join(args.versus)}: ratio {kd / statistics.median(times['versus']):.3f}")


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


if __name__ == "__main__":
    main()
