"""The frozen teacher: a real HF checkpoint, the shipped tiny teacher, or the embedded tiny teacher pretrained once on
the corpus and cached.

The embedded default loads the teacher shipped with the package (kdexp.assets: trained once by this project's recipe,
with its tokenizer) like a real checkpoint, after checking its manifest. With model.embedded_teacher=pretrain the first
embedded run trains the teacher with the LM loss (logged as its own stage), saves it as a Hugging Face checkpoint in
the cache directory, keyed by what made it (its recipe, its own seed model.teacher_pretrain_seed, the data and data.seed,
its sample length: `pretrain_seq_length`), never by the student's trainer.seed, so every replicate of a sweep distils
one teacher, and every later run (any TP size) loads it back through ``load_hf``. The cached copy carries a
sha256 manifest (kdexp.data.cache): a truncated or garbled file is named in a warning and the teacher is pretrained
again; a lock makes concurrent jobs on a cold cache pretrain it once.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from pathlib import Path

import torch

from kdexp import assets, distributed, models
from kdexp.data import batches, prepare
from kdexp.data import cache as data_cache
from kdexp.track import cost, faults, records
from kdexp.train import optim
from kdexp.train.batches import batch_to
from kdexp.train.step import NonFiniteGuard, lm_backward, optimizer_step

log = logging.getLogger("kdexp")


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def check_shipped() -> None:
    """The shipped teacher is intact (its sha256 manifest): a damaged install is an error, never a silent load."""
    problem = data_cache.verify(assets.SHIPPED_TEACHER)
    if problem:
        raise faults.DamagedFile(f"the shipped teacher is damaged: {problem}. Reinstall kdexp (or git checkout "
                                 "kdexp/assets/teacher), or set model.embedded_teacher=pretrain to pretrain one here")


def pretrain_seq_length(cfg) -> int:
    """The length of the embedded teacher's pretraining samples: model.teacher_pretrain_seq_length, or a longer
    trainer.seq_length (a teacher is never asked for positions it was not trained at: RoPE gives it positions it
    never saw, and its logits there would be untrained). So it depends on the run's length only above that."""
    return max(int(cfg.model.teacher_pretrain_seq_length), int(cfg.trainer.seq_length))


def pretrained_teacher_dir(cfg, data) -> Path:
    """Cache directory of the embedded teacher, keyed by everything that determines its weights: its shape, the token
    data (`data.source`) and data.seed (its windows), its sample length, its recipe, its global batch (micro x DP
    size) and its own seed; not trainer.seed, nor the student's length up to pretrain_seq_length."""
    key = {
        "spec": dataclasses.asdict(models.get_spec(cfg.model.teacher, vocab_size=data.vocab_size)),
        "data": data.source, "data.seed": int(cfg.data.seed), "seq_length": pretrain_seq_length(cfg),
        "recipe": recipe(cfg), "dp_size": distributed.state().dp_size, "seed": int(cfg.model.teacher_pretrain_seed),
        "params_dtype": cfg.model.params_dtype,
    }
    return data_cache.cached_path("teacher", key, root=cfg.paths.cache)


def pretrain_data(cfg, data):
    """The data the embedded teacher pretrains on: the run's own when it has the teacher's sample length (one epoch of
    windows: data.seed's alone), else the same token files and data.seed cut at pretrain_seq_length; its steps read
    it again and again. A weighted blend is always sized for the teacher's own samples (megatron sizes a blend by the
    samples asked for, so the run's would follow the run's length)."""
    length = pretrain_seq_length(cfg)
    if length == data.seq_length and getattr(data.train_ds, "datasets", None) is None:
        return data
    st, r = distributed.state(), recipe(cfg)
    return prepare(cfg.data, seq_length=length, cache_dir=cfg.paths.cache, seed=cfg.data.seed,
                   train_samples=r["steps"] * r["micro_batch_size"] * st.dp_size, val_samples=1,
                   tokenizer_path=assets.tokenizer_source(cfg)[1])


def teacher_identity(cfg, data) -> dict:
    """What names the teacher's weights (the teacher cache's key, kdexp.teacher.writer.cache_key): the shipped
    teacher's manifest digest, the pretrained teacher's cache entry (its key hash + the sha256 of its manifest, which
    holds every weight file's sha256), or for teacher_path its config.json digest and weight files' names, sizes and
    mtimes (hashing a multi-GB checkpoint on every run would cost minutes)."""
    if assets.uses_shipped_teacher(cfg.model):  # its manifest holds the sha256 of every file
        return {"shipped": data_cache.sha256_file(assets.SHIPPED_TEACHER / data_cache.MANIFEST)}
    if cfg.model.teacher_path is None:
        d = pretrained_teacher_dir(cfg, data)
        return {"embedded": d.name, "manifest": data_cache.sha256_file(d / data_cache.MANIFEST)}
    p = Path(cfg.model.teacher_path).expanduser().resolve()
    weights = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in p.iterdir()
                     if f.suffix in (".safetensors", ".bin", ".pt"))
    aligned = {} if cfg.model.vocab_alignment == "exact" else {"vocab_alignment": cfg.model.vocab_alignment}
    return {"path": str(p), "config": data_cache.sha256_file(p / "config.json") if (p / "config.json").is_file()
            else None, "weights": hashlib.sha256(repr(weights).encode()).hexdigest(), **aligned}  # aligned: other logits


def recipe(cfg) -> dict:
    """The model.teacher_pretrain_* settings (the schema holds their defaults): what pretrain() runs with."""
    m = cfg.model
    steps = int(m.teacher_pretrain_steps)
    return {"steps": steps, "lr": float(m.teacher_pretrain_lr), "min_lr": float(m.teacher_pretrain_min_lr),
            "warmup_steps": max(1, int(steps * m.teacher_pretrain_warmup_fraction)),
            "micro_batch_size": int(m.teacher_pretrain_micro_batch_size),
            "weight_decay": float(m.teacher_pretrain_weight_decay), "grad_clip": float(cfg.trainer.grad_clip)}


def _endless(ds, **kwargs):
    """batches() over and over: the teacher may see more samples than the distillation asked the dataset for (the
    next pass reads the same shuffled order again, so the stream is a function of the dataset alone)."""
    while True:
        yield from batches(ds, **kwargs)


def pretrain(model: torch.nn.Module, data, cfg, on_step=None) -> None:
    """LM-only training of the tiny teacher (AdamW, warmup + cosine, clipping; the trainer's step sequence,
    kdexp.train.step.optimizer_step, non-finite guard included): the stage 'teacher'.

    ``on_step(step, model)`` (1-based step), if given, runs after each update: kdexp.bench.teacher --curve measures
    the teacher on the way there."""
    st = distributed.state()
    r = recipe(cfg)
    steps, lr = r["steps"], r["lr"]
    opt = optim.make_optimizer(model, lr=lr, weight_decay=r["weight_decay"])
    stream = _endless(data.train_ds, micro_batch_size=r["micro_batch_size"], dp_rank=st.dp_rank, dp_size=st.dp_size)
    model.train()
    started = time.perf_counter()
    running = torch.zeros((), device=st.device)
    guard = NonFiniteGuard(cfg.trainer.skip_nonfinite)  # a non-finite step is never applied silently
    for step in range(steps):
        batch = batch_to(next(stream), st.device)
        optim.set_lr(opt, optim.lr_at(step, lr=lr, min_lr=r["min_lr"], warmup=r["warmup_steps"], total=steps))
        parts, _ = optimizer_step(model, opt, lambda: lm_backward(model, batch), grad_clip=r["grad_clip"],
                                  guard=guard, done=step + 1)  # the trainer's own step sequence
        running += parts["train/loss"]
        if on_step is not None:
            on_step(step + 1, model)
            model.train()
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
            n = (step % max(1, steps // 10)) + 1
            if st.rank == 0:
                log.info("teacher step %6d/%-6d lm %8.4f  %6.1f s", step + 1, steps, running.item() / n,
                         time.perf_counter() - started)
            running.zero_()


def get_teacher(cfg, data) -> torch.nn.Module:
    """The frozen teacher: model.teacher_path's checkpoint, else the embedded teacher from the cache (pretrained here
    first when the cache has no intact copy). Call it on every rank."""
    dtype = models.DTYPES[cfg.model.params_dtype]
    if assets.uses_shipped_teacher(cfg.model):
        check_shipped()
    checkpoint = assets.teacher_checkpoint(cfg.model)
    if checkpoint is not None:  # model.vocab_alignment=tokenizer: the student's rows, padded ids -inf (models.vocab)
        return freeze(models.load_hf(checkpoint, params_dtype=dtype, attention=cfg.model.attention,
                                      **models.vocab_alignment(cfg, data)))
    path = pretrained_teacher_dir(cfg, data)
    writer = distributed.is_rank0()
    # Global rank 0 holds the cache lock around check-train-save, so parallel jobs on a cold cache pretrain once;
    # the other ranks of this job wait for rank 0's decision (a broadcast), so all of them train or none does.
    built = False
    with data_cache.exclusive(path, enabled=writer):
        if not distributed.rank0_decides(data_cache.check(path) if writer else True):
            built = True
            if writer:
                log.info("stage teacher: pretraining the embedded teacher %s for %d steps (once; cached in %s)",
                         cfg.model.teacher, cfg.model.teacher_pretrain_steps, path)
            # Its init from its own seed alone: a rebuild (cold cache, corrupt copy) gives the same weights whatever
            # ran first, and no replicate's trainer.seed changes it.
            distributed.reseed(cfg.model.teacher_pretrain_seed)
            started = time.perf_counter()
            spec = models.get_spec(cfg.model.teacher, vocab_size=data.vocab_size)
            model = models.build(spec, params_dtype=dtype, attention=cfg.model.attention)
            own = pretrain_data(cfg, data)
            pretrain(model, own, cfg)
            models.save_hf(model, path, spec)  # collective; rank 0 writes atomically
            del model
            if writer:  # what it cost, sealed by the manifest; the manifest last: until it exists the directory
                # counts as unfinished and is rebuilt
                st, r = distributed.state(), recipe(cfg)
                records.write_json(path / cost.ONE_TIME_RECORD, cost.one_time_record(
                    wall_s=time.perf_counter() - started, device=st.device,
                    tokens=r["steps"] * r["micro_batch_size"] * st.dp_size * own.seq_length))
                data_cache.write_manifest(path)
    distributed.barrier()
    cost.note_one_time("teacher pretraining", path, built=built)  # the report shares it over the points using it
    return freeze(models.load_hf(path, params_dtype=dtype, attention=cfg.model.attention))
