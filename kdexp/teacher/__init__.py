"""The offline teacher cache: one teacher pass stores per token what the KD loss needs, every later run (every point
of a sweep) trains from it instead of running the teacher (config group `teacher`, option `cached`).

- format: shard layout, value/index encodings, the key (kdexp.teacher.format);
- writer: `ensure(cfg, data, teacher, teacher_identity)` builds the cache once (locked, resumable, checksummed) and
  opens it; the teacher's identity (what names its weights) is handed in by whoever made the teacher (kdexp.train);
- reader: `TeacherCache` random access by global sample index, `CacheCorrupt` / `CacheMismatch`.
The loss from a record is kdexp.losses.cached_kd_loss.
"""
from kdexp.teacher.reader import CacheCorrupt, CacheMismatch, TeacherCache

__all__ = ["CacheCorrupt", "CacheMismatch", "TeacherCache"]
