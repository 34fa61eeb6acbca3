"""A tiny embedded config for the cache tests, and (run as a script) one job that prepares data and the teacher.

    python tests/_cache_worker.py <cache_dir> <go_file> <out_json>

waits until <go_file> exists (so that several workers start their builds at the same moment), then runs what a
training job runs before its first step: kdexp.data.prepare and kdexp.train.teacher.get_teacher, logging at INFO on
stderr (the builds say so: "training a ... BPE", "tokenizing", "stage teacher: pretraining"), and writes the sha256
of every cached file it used to <out_json> ("{rank}" in it becomes the global rank: it runs under torchrun too).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

TINY = {
    "data": {"name": "stdlib", "vocab_size": 512, "max_chars": 120_000, "val_fraction": 0.1},
    "model": {"teacher": "tiny-teacher", "embedded_teacher": "pretrain", "teacher_pretrain_steps": 4,
              "teacher_pretrain_micro_batch_size": 2, "teacher_pretrain_seq_length": 32},
    "trainer": {"seq_length": 32, "micro_batch_size": 2, "seed": 3, "eval_iters": 1},
}


def tiny_cfg(cache: str | Path):
    """The schema (its defaults) with the tiny overrides and `cache` as paths.cache."""
    from kdexp.config import KdexpConfig

    cfg = OmegaConf.merge(OmegaConf.structured(KdexpConfig), TINY)
    cfg.paths.cache = str(cache)
    cfg.paths.index = str(Path(cache) / "points")
    return cfg


def prepare_and_teacher(cfg):
    """(data bundle, teacher dir) exactly as the trainer's setup gets them (kdexp.distributed initialized)."""
    from kdexp.data import prepare
    from kdexp.train.teacher import get_teacher, pretrained_teacher_dir

    t = cfg.trainer
    data = prepare(cfg.data, seq_length=t.seq_length, cache_dir=cfg.paths.cache, seed=cfg.data.seed,
                   train_samples=cfg.model.teacher_pretrain_steps * t.micro_batch_size,
                   val_samples=t.eval_iters * t.micro_batch_size)
    get_teacher(cfg, data)
    return data, pretrained_teacher_dir(cfg, data)


def digests(*dirs: Path) -> dict:
    """sha256 of every file of the given artefact directories (their manifests say it, and verify says they match),
    but the record of what a build cost (build.json: its wall time differs between two builds of the same bytes)."""
    from kdexp.data import cache
    from kdexp.track.cost import ONE_TIME_RECORD

    out = {}
    for d in dirs:
        assert cache.verify(d) is None, cache.verify(d)
        manifest = json.loads((d / cache.MANIFEST).read_text())
        out.update({f"{d.parent.name}/{name}": v["sha256"] for name, v in manifest["files"].items()
                    if name != ONE_TIME_RECORD})
    return out


def main(cache: str, go: str, out: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(process)d %(name)s %(message)s")
    from kdexp import distributed

    cfg = tiny_cfg(cache)
    distributed.initialize(seed=cfg.trainer.seed)
    while not Path(go).exists():  # every worker has paid its imports; now all start building at once
        time.sleep(0.01)
    data, teacher_dir = prepare_and_teacher(cfg)
    result = digests(Path(data.info["tokenizer"]), Path(data.info["tokens"]), teacher_dir)
    rank = distributed.state().rank
    Path(out.replace("{rank}", str(rank))).write_text(json.dumps(result, sort_keys=True))
    distributed.destroy()


if __name__ == "__main__":
    main(*sys.argv[1:4])
