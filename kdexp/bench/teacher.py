"""How peaked is the teacher? Its next-token distribution on the validation split, against what a real LM gives.

    python -m kdexp.bench.teacher [--samples 64] [--json FILE] [hydra overrides ...]

The teacher is the one a run with these overrides distills from (the trainer's own setup): the shipped one,
``model.teacher_path``, or with model.embedded_teacher=pretrain the cached pretrained one (pretrained first when the
cache has none). Over up to ``--samples`` validation sequences it prints the LM loss (nats/token), the mean top-1 probability, the median and mean size of the 0.95
nucleus (the fewest tokens holding 95% of the mass, as loss=top_p counts it) and the mean mass the Top-K keeps at
K = 16, 64, 256, 1024: what decides whether Top-K / Top-P / ghost-token ablations on it say anything about a real
teacher. Qwen3-class teachers on code have nuclei of tens of tokens and a top-1 probability well above 0.3.
Pretraining time, if it happened, is printed too (``setup_s``: data + teacher + student setup).
"""
from __future__ import annotations

import json
import logging
import time

import torch
from hydra import compose, initialize_config_module

import kdexp.config
from kdexp import assets, distributed, models
from kdexp.data import batches
from kdexp.train.batches import batch_to
from kdexp.bench import parser

KS = (16, 64, 256, 1024)
NUCLEUS_P = 0.95
# What "peaked like a real LM" means for the embedded default's teacher, on its validation split; the
# shipped teacher meets it (tests/test_readme.py runs this bench on it).
MAX_LM_LOSS, MIN_TOP1, MAX_NUCLEUS = 4.0, 0.30, 512


def token_stats(logits: torch.Tensor, labels: torch.Tensor, *, ks=KS, p: float = NUCLEUS_P) -> dict:
    """Per-token statistics of full-vocabulary logits [n, V] (float64): nll of the label, top-1 probability,
    nucleus size at ``p`` and the kept mass of each Top-K (K > V keeps everything). Returns [n] tensors."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    probs, _ = logp.exp().sort(dim=-1, descending=True)
    cum = probs.cumsum(dim=-1)
    vocab = logits.shape[-1]
    out = {
        "nll": -logp.gather(-1, labels[:, None]).squeeze(-1),
        "top1": probs[:, 0],
        # loss=top_p's nucleus (kdexp.losses.logits): the sorted prefix where cumsum(p) - p < top_p
        "nucleus": ((cum - probs) < p).sum(dim=-1).double(),
    }
    for k in ks:
        out[f"kept@{k}"] = cum[:, min(k, vocab) - 1]
    return out


def summarize(stats: dict) -> dict:
    """Means over tokens (median for the nucleus as well): the numbers the bench prints."""
    out = {"tokens": int(stats["nll"].numel()), "lm_loss": stats["nll"].mean().item(),
           "top1_prob": stats["top1"].mean().item(), "nucleus_median": stats["nucleus"].median().item(),
           "nucleus_mean": stats["nucleus"].mean().item()}
    out.update({k: v.mean().item() for k, v in stats.items() if k.startswith("kept@")})
    return out


@torch.no_grad()
def measure(teacher: torch.nn.Module, val_ds, *, samples: int, micro_batch_size: int = 4) -> dict:
    """The teacher's statistics over the first ``samples`` validation sequences (or all there are), on rank 0's view
    (full-vocabulary logits, gathered over tensor parallelism)."""
    st = distributed.state()
    parts: dict[str, list] = {}
    seen = 0
    for batch in batches(val_ds, micro_batch_size=micro_batch_size, dp_rank=0, dp_size=1):
        if seen >= samples:
            break
        batch = batch_to(batch, st.device)
        logits = models.forward_logits(teacher, batch["tokens"])
        keep = batch["loss_mask"].reshape(-1) > 0
        stats = token_stats(logits.reshape(-1, logits.shape[-1])[keep], batch["labels"].reshape(-1)[keep])
        for k, v in stats.items():
            parts.setdefault(k, []).append(v.cpu())
        seen += batch["tokens"].shape[0]
    if not parts:
        raise ValueError("the validation split holds no full micro-batch of sequences to measure")
    return summarize({k: torch.cat(v) for k, v in parts.items()})


def main(argv=None) -> dict:
    ap = parser(__spec__.name, __doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64, help="validation sequences to measure")
    ap.add_argument("--json", default=None, help="also write the numbers (and the recipe) to this JSON file")
    ap.add_argument("--curve", type=int, default=0, metavar="N",
                    help="pretrain the embedded teacher here (no cache; always from scratch on the BPE trained on the "
                         "corpus, whatever model.embedded_teacher says) and measure it every N steps on --samples "
                         "validation sequences, with the CPU seconds spent so far (choosing a recipe)")
    ap.add_argument("--save", default=None, metavar="DIR",
                    help="with --curve: write the trained teacher there as a HF checkpoint (bfloat16 weights) with "
                         "its tokenizer and recipe.json: how kdexp/assets/teacher was made")
    ap.add_argument("overrides", nargs="*", help="kdexp.run overrides of the setup (key=value, group=option)")
    args = ap.parse_intermixed_args(argv)  # options may follow the overrides
    if args.samples < 1:
        ap.error(f"--samples must be >= 1, got {args.samples}")
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=args.overrides)
    kdexp.config.validate(cfg)
    from kdexp.train.loop import setup
    from kdexp.train.point import quiet_megatron
    from kdexp.train.teacher import recipe

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    quiet_megatron()  # the teacher's pretraining log lines stay, megatron's index chatter goes
    distributed.initialize(tensor_parallel=cfg.parallel.tensor, seed=cfg.trainer.seed)
    if args.curve:
        return _curve(cfg, args)
    started = time.perf_counter()
    s = setup(cfg)  # the trainer's own: same data, same teacher cache key
    setup_s = time.perf_counter() - started
    result = measure(s.teacher, s.data.val_ds, samples=args.samples)
    result.update(setup_s=setup_s, vocab_size=s.data.vocab_size, teacher=cfg.model.teacher,
                  recipe=recipe(cfg) if assets.teacher_checkpoint(cfg.model) is None else None,
                  checkpoint=assets.teacher_checkpoint(cfg.model))
    if distributed.is_rank0():
        print(f"teacher={cfg.model.teacher} vocab={s.data.vocab_size} val tokens={result['tokens']} "
              f"setup {setup_s:.1f} s")
        print(f"  val LM loss        {result['lm_loss']:8.3f} nats")
        print(f"  mean top-1 prob    {result['top1_prob']:8.3f}")
        print(f"  0.95-nucleus       median {result['nucleus_median']:.0f}, mean {result['nucleus_mean']:.1f} tokens")
        print("  mean kept mass     " + "  ".join(f"K={k}: {result[f'kept@{k}']:.3f}" for k in KS))
        meets = result["lm_loss"] <= MAX_LM_LOSS and result["top1_prob"] >= MIN_TOP1 and \
            result["nucleus_median"] <= MAX_NUCLEUS
        print(f"  real-LM bar (LM loss <= {MAX_LM_LOSS}, top-1 >= {MIN_TOP1}, median nucleus <= {MAX_NUCLEUS}): "
              + ("met" if meets else "NOT met"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return result


def _curve(cfg, args) -> dict:
    """Pretrain the embedded teacher of ``cfg`` as get_teacher would (same data, seed and recipe), measuring it every
    ``args.curve`` steps; prints one line per measurement, CPU seconds (process time) beside wall seconds because a
    shared machine stretches the latter."""
    from kdexp.data import prepare
    from kdexp.train.teacher import pretrain, pretrain_seq_length

    st, t = distributed.state(), cfg.trainer
    # the data kdexp.train.teacher.pretrain_data gives get_teacher (its windows: data.seed, its own sample length)
    data = prepare(cfg.data, seq_length=pretrain_seq_length(cfg), cache_dir=cfg.paths.cache, seed=cfg.data.seed,
                   train_samples=cfg.model.teacher_pretrain_steps * cfg.model.teacher_pretrain_micro_batch_size
                   * st.dp_size, val_samples=t.eval_iters * t.micro_batch_size * st.dp_size,
                   tokenizer_path=cfg.data.tokenizer)
    distributed.reseed(cfg.model.teacher_pretrain_seed)
    spec = models.get_spec(cfg.model.teacher, vocab_size=data.vocab_size)
    model = models.build(spec, params_dtype=models.DTYPES[cfg.model.params_dtype])
    rows, cpu0, wall0 = [], time.process_time(), time.perf_counter()
    steps = cfg.model.teacher_pretrain_steps

    def on_step(step, m):
        if step % args.curve and step != steps:
            return
        m.eval()
        row = {"step": step, "cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0,
               **measure(m, data.val_ds, samples=args.samples)}
        rows.append(row)
        if distributed.is_rank0():
            print(f"step {step:5d} cpu {row['cpu_s']:7.1f} s wall {row['wall_s']:7.1f} s  lm {row['lm_loss']:.3f}  "
                  f"top1 {row['top1_prob']:.3f}  nucleus median {row['nucleus_median']:.0f}  "
                  + " ".join(f"K{k} {row[f'kept@{k}']:.3f}" for k in KS), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)

    pretrain(model, data, cfg, on_step=on_step)
    if args.save:
        _save(model, spec, data, cfg, args, rows)
    return rows[-1]


def _save(model, spec, data, cfg, args, rows) -> None:
    """The trained teacher as a loadable HF checkpoint (bfloat16 weights: half the bytes, loaded as float32), the
    tokenizer it was trained with (its token ids are the checkpoint's), and recipe.json (the overrides, the recipe,
    the data it saw and the measured curve), then it is measured again as reloaded: what a run will load."""
    import shutil
    from pathlib import Path

    from kdexp.train.teacher import recipe

    out = Path(args.save)
    models.save_hf(model, out, spec, dtype=torch.bfloat16)
    if not distributed.is_rank0():
        return
    tok_dir = Path(data.info["tokenizer"])
    for name in ("tokenizer.json", "kdexp_tokenizer.json"):
        if (tok_dir / name).is_file():
            shutil.copy2(tok_dir / name, out / name)
    reloaded = measure(models.load_hf(out, params_dtype=torch.float32), data.val_ds, samples=args.samples)
    with open(out / "recipe.json", "w") as f:
        json.dump({"command": "python -m kdexp.bench.teacher --curve N --save DIR " + " ".join(args.overrides),
                   "overrides": list(args.overrides), "recipe": recipe(cfg), "seq_length": data.seq_length,
                   "seed": cfg.model.teacher_pretrain_seed, "data.seed": cfg.data.seed,
                   "data": {"fingerprint": data.fingerprint, "info": data.info, "train_samples": len(data.train_ds)},
                   "curve": rows, "reloaded": reloaded}, f, indent=1, default=str)
    print(f"saved to {out}: reloaded val LM loss {reloaded['lm_loss']:.3f}, top-1 {reloaded['top1_prob']:.3f}, "
          f"median nucleus {reloaded['nucleus_median']:.0f}", flush=True)


if __name__ == "__main__":
    main()
