"""Read back what a W&B run stored on disk: ``<run_dir>/wandb/offline-run-*/run-<id>.wandb``, without a server.

    run = read_run(run_dir)            # or read_run(".../run-<id>.wandb")
    run.id, run.name, run.group, run.project, run.job_type, run.tags
    run.config      # what wandb.init(config=...) and later config updates recorded (JSON values decoded)
    run.history     # one dict per logged step, {"_step": n, "train/loss": ..., ...} (W&B's _runtime/_timestamp too)
    run.summary     # the final summary, W&B's bookkeeping keys (_wandb, _runtime, ...) included
    run.exit_code   # None when the run never finished (killed before wandb.finish)

wandb 0.31 writes the file from its Go core and ships no Python reader any more. The file is LevelDB's log format:
a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of records, each ``crc32 (uint32) | length
(uint16) | type (uint8) | data``: FULL, or a FIRST-MIDDLE*-LAST chain when a record crosses a block end, a block
tail shorter than a record header being zero padding. Each record's data is one serialized
``wandb.proto.wandb_internal_pb2.Record``, which is parsed with wandb's own protobuf class: only the framing is
read here. The checksum is zlib's CRC-32 seeded with the type byte, as W&B writes it; a bad checksum or a broken
chain raises ``WandbFileError`` naming the file and the offset. A file cut short by a crash ends the scan at the last
complete record (what ``wandb sync`` would upload too).

Resumed runs (the same id over a requeue) write one offline-run directory per process: ``read_run(run_dir)`` reads
them in order and merges them (history rows in step order, a step logged twice keeps its last value, later config
and summary values win).
"""
from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator, Optional, Union

HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
BLOCK = 32768
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_CRC_SEED = {t: zlib.crc32(bytes([t])) for t in (FULL, FIRST, MIDDLE, LAST)}


class WandbFileError(ValueError):
    """A .wandb file that is not W&B's log format, or whose records are corrupt."""


def record_bytes(path: Union[str, Path]) -> Iterator[bytes]:
    """The payloads of a W&B log file, one serialized Record each, in the order they were written."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < HEADER.size:
        raise WandbFileError(f"{path}: {len(data)} bytes, shorter than the W&B file header")
    ident, magic, version = HEADER.unpack_from(data)
    if (ident, magic, version) != (IDENT, MAGIC, VERSION):
        raise WandbFileError(f"{path}: header {ident!r}/{magic:#x}/v{version} is not W&B's {IDENT!r}/{MAGIC:#x}/"
                             f"v{VERSION}")
    pos, chain = HEADER.size, None
    while True:
        left = BLOCK - pos % BLOCK
        if left < RECORD_HEADER.size:  # block trailer: zeros
            pos += left
        if pos + RECORD_HEADER.size > len(data):
            return  # the end, or a record header cut short by a crash
        crc, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0 and crc == 0:  # preallocated zeros after the last record
            return
        body = data[pos + RECORD_HEADER.size:pos + RECORD_HEADER.size + length]
        if len(body) < length:
            return  # cut short by a crash
        if kind not in _CRC_SEED or zlib.crc32(body, _CRC_SEED[kind]) != crc:
            raise WandbFileError(f"{path}: corrupt record at byte {pos} (type {kind}, length {length})")
        pos += RECORD_HEADER.size + length
        if kind == FULL and chain is None:
            yield body
        elif kind == FIRST and chain is None:
            chain = bytearray(body)
        elif kind in (MIDDLE, LAST) and chain is not None:
            chain += body
            if kind == LAST:
                yield bytes(chain)
                chain = None
        else:
            raise WandbFileError(f"{path}: record type {kind} at byte {pos} breaks a FIRST..LAST chain")


def records(path: Union[str, Path]) -> Iterator[Any]:
    """The ``wandb.proto.wandb_internal_pb2.Record`` messages of a W&B log file."""
    from wandb.proto import wandb_internal_pb2

    for raw in record_bytes(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        yield rec


def _key(item) -> str:
    # W&B keeps a flat key in `key`, a nested one as path parts (kdexp's "train/loss" is one part, not split)
    return item.key if item.key else ".".join(item.nested_key)


def _items(items) -> dict:
    return {_key(it): json.loads(it.value_json) for it in items}


@dataclasses.dataclass
class WandbRun:
    files: list
    id: Optional[str] = None
    name: Optional[str] = None
    group: Optional[str] = None
    project: Optional[str] = None
    entity: Optional[str] = None
    job_type: Optional[str] = None
    tags: list = dataclasses.field(default_factory=list)
    config: dict = dataclasses.field(default_factory=dict)
    history: list = dataclasses.field(default_factory=list)
    summary: dict = dataclasses.field(default_factory=dict)
    exit_code: Optional[int] = None

    def metrics(self) -> list[dict]:
        """History rows without W&B's own columns (_step kept as ``step``), as kdexp logged them."""
        return [{"step": row["_step"], **{k: v for k, v in row.items() if not k.startswith("_")}}
                for row in self.history]


def _apply_config(config: dict, update) -> None:
    config.update(_items(update.update))
    for item in update.remove:
        config.pop(_key(item), None)


def _read_file(path: Path, run: WandbRun, steps: dict) -> None:
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.id, run.name, run.group = r.run_id or run.id, r.display_name or run.name, r.run_group or run.group
            run.project, run.entity = r.project or run.project, r.entity or run.entity
            run.job_type = r.job_type or run.job_type
            run.tags = list(r.tags) or run.tags
            _apply_config(run.config, r.config)
        elif kind == "config":
            _apply_config(run.config, rec.config)
        elif kind == "history":
            row = _items(rec.history.item)
            step = rec.history.step.num if rec.history.HasField("step") else row.get("_step", len(steps))
            row["_step"] = int(step)
            steps[int(step)] = row
        elif kind == "summary":
            run.summary.update(_items(rec.summary.update))
            for item in rec.summary.remove:
                run.summary.pop(_key(item), None)
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code


def wandb_files(run_dir: Union[str, Path]) -> list[Path]:
    """The run's .wandb files: ``run_dir/wandb/*-run-*/run-*.wandb`` (or run_dir itself when it is a file), oldest first
    (the directory names start with their start time)."""
    p = Path(run_dir)
    if p.is_file():
        return [p]
    found = sorted(p.glob("wandb/*-run-*/run-*.wandb")) or sorted(p.glob("*-run-*/run-*.wandb")) or \
        sorted(p.glob("run-*.wandb"))
    return found


def read_run(run_dir: Union[str, Path]) -> WandbRun:
    """The W&B run stored under ``run_dir`` (a kdexp run directory, its ``wandb`` folder, one offline-run folder or
    one .wandb file); see the module doc. FileNotFoundError when there is none."""
    files = wandb_files(run_dir)
    if not files:
        raise FileNotFoundError(f"no W&B run file (wandb/offline-run-*/run-*.wandb) under {run_dir}")
    run, steps = WandbRun(files=files), {}
    for f in files:
        _read_file(f, run, steps)
    run.history = [steps[s] for s in sorted(steps)]
    return run
