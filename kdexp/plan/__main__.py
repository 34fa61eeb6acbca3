"""``python -m kdexp.plan [--gpus N] [--mfu F] [--json] [--max-micro] [overrides ...]``: the plan's table.

The overrides are kdexp.run's (``model=qwen3 trainer.seq_length=4096 parallel.tensor=2 ...``), composed the same way;
no weights, data or GPU are needed: checkpoint paths are read for their config.json only, and a real teacher without
``model.teacher_path`` is sized from QWEN3_SIZES. Exit status 2 for a bad command line or config (one line).
"""
from __future__ import annotations

import argparse
import json
import sys

from kdexp.plan import DEFAULT_MFU, GiB, format_table, largest_micro_batch, make_plan

# The one check of validate() the plan may pass by: it sizes a real teacher from QWEN3_SIZES without its weights.
_NO_WEIGHTS = "model.teacher_path=None is invalid"


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_module

    import kdexp.conf  # noqa: F401  (the schema and resolvers)

    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _check(cfg) -> None:
    """kdexp.config.validate, except that the teacher's weights need not exist; the keys the plan reads are then
    checked here (validate stops at its first error, before them)."""
    import kdexp.config
    from kdexp.rules import integer

    try:
        kdexp.config.validate(cfg)
        return
    except ValueError as err:
        if not str(err).startswith(_NO_WEIGHTS):
            raise
    t = cfg.trainer
    for key in ("micro_batch_size", "seq_length"):
        integer(f"trainer.{key}", getattr(t, key), ge=1)
    integer("trainer.global_batch_size", t.global_batch_size, ge=1, none_ok=True)
    integer("parallel.tensor", cfg.parallel.tensor, ge=1)


def _default_gpus(tp: int) -> int:
    """The launcher's world size (torchrun, submitit, an srun step) when it holds whole TP groups, else one replica."""
    from kdexp.distributed import launch

    world = launch.world_size()
    return world if world > 1 and world % tp == 0 else tp


DESCRIPTION = """Size a kdexp run before it launches: memory per GPU item by item, FLOPs per token and tokens/s at
an assumed MFU. Takes kdexp.run's overrides; needs no weights, data or GPU."""

EPILOG = """how to read the table:
  first line          teacher -> student, GPUs = TP x DP, precision, micro-batch x seq, global batch (micro-batches
                      per DP rank and step)
  per GPU ... GiB     torch's allocated peak at the start of the student's backward, one line per item: weights
                      (teacher: no grads), student gradients and optimizer state (split over DP with
                      trainer.distributed_optimizer=true), activations of one micro-batch (by recompute mode),
                      the output head: with loss.fused_head (auto: where one micro-batch's fp32 logits per TP rank
                      take 64 MiB or more) both models' final hidden states, the head's gradients and one chunk of
                      tokens' logits; else both models' logits [micro x seq, V/TP], logit gradients, the KD loss's
                      saved values and chunk buffer (teacher=cached: the decoded cache record instead of the
                      teacher's logits or hidden states)
  peak allocated      the sum: what torch.cuda.max_memory_allocated should report
  reserve             CUDA context, NCCL, allocator fragmentation (1 GiB + 5%)
  needs               peak + reserve, compared with trainer.gpu_memory_gb when set ("fits" / "DOES NOT FIT";
                      kdexp.run refuses a config that does not fit, exit 2)
  FLOPs per token     model FLOPs: student fwd+bwd, teacher fwd, attention over the full s x s scores
  tokens/s at MFU     per GPU and in total at --mfu of trainer.gpu_peak_tflops, and the seconds per optimizer step
  largest micro-batch (--max-micro) the largest trainer.micro_batch_size whose need fits trainer.gpu_memory_gb,
                      what it needs and what one more needs

example (Qwen3-1.7B -> 0.6B on one 8-GPU node; docs/scale.md shows its output):
  python -m kdexp.plan --max-micro --gpus 8 model=qwen3 trainer.precision=bf16 trainer.micro_batch_size=2 \\
      trainer.global_batch_size=256 trainer.seq_length=4096 trainer.recompute=selective \\
      trainer.distributed_optimizer=true parallel.tensor=2 parallel.sequence=true trainer.gpu_memory_gb=79.6

exit status: 0 the plan printed; 2 a bad command line or config (one line)."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdexp.plan", description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs of the run (default: $WORLD_SIZE / $SLURM_NTASKS, else parallel.tensor: DP=1)")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="model FLOPs utilisation assumed (0, 1]")
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON object instead of the table")
    ap.add_argument("--max-micro", action="store_true",
                    help="also find the largest trainer.micro_batch_size that fits trainer.gpu_memory_gb (required)")
    ap.add_argument("overrides", nargs="*", help="kdexp.run overrides (group=option, key=value)")
    args = ap.parse_args(argv)
    if not 0 < args.mfu <= 1:
        ap.error(f"--mfu={args.mfu} must be in (0, 1]")
    try:
        cfg = _compose(args.overrides)
        _check(cfg)
        gpus = args.gpus if args.gpus is not None else _default_gpus(int(cfg.parallel.tensor))
        plan = make_plan(cfg, gpus=gpus, mfu=args.mfu)
        fit = _max_micro(cfg, gpus) if args.max_micro else None
    except Exception as err:  # Hydra's composition errors and the value checks: a user error
        print(f"kdexp.plan: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict() | ({} if fit is None else {"max_micro_batch": fit})))
    else:
        print(format_table(plan) + ("" if fit is None else "\n" + fit["line"]))
    return 0


def _max_micro(cfg, gpus: int) -> dict:
    """--max-micro: the largest micro-batch that fits, with the need at it and one above (kdexp.plan's rule)."""
    limit = cfg.trainer.gpu_memory_gb
    if limit is None:
        raise ValueError("--max-micro needs trainer.gpu_memory_gb=<GiB per GPU> (79.6 on an H100 80GB)")
    m, at, above = largest_micro_batch(cfg, gpus=gpus, limit_gib=float(limit))
    gib = (lambda p: round(p.needs / GiB, 2))
    out = {"micro_batch_size": m, "needs_gib": None if at is None else gib(at),
           "next_needs_gib": None if above is None else gib(above), "gpu_memory_gb": float(limit)}
    seq, name = cfg.trainer.seq_length, f"{'largest micro-batch':<28}"
    if m:
        nxt = "" if above is None else f"; {m + 1} needs {out['next_needs_gib']:.2f} GiB"
        out["line"] = (f"{name} {m:>9}  x seq {seq}: needs {out['needs_gib']:.2f} GiB, within "
                       f"trainer.gpu_memory_gb={limit:g}{nxt}")
    else:
        out["line"] = (f"{name} {'none':>9}  micro-batch 1 x seq {seq} needs {out['next_needs_gib']:.2f} GiB, more "
                       f"than trainer.gpu_memory_gb={limit:g}")
    return out


if __name__ == "__main__":
    sys.exit(main())
