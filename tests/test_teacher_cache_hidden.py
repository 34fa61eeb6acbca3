"""teacher.store=hidden: a cache of the teacher's final hidden states, the logits formed in the step with the
teacher's own output layer, equals the online teacher for every loss family (dense, Top-K with a ghost token,
renormalised Top-K, a pure nucleus, reverse KL, JSD, sampled KD with its draws made at training time) at two
temperatures, on the fused head and on the reference path, at TP 1 and TP 2 (gloo), with a tied and an untied
teacher head: the KD loss and the student's gradient within fp32 rounding. The reference is the online objective on
the same tiny megatron models (kdexp.objective.OnlineTeacher), not the code under test.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from _lone_process import lone_process

VOCAB, SEQ, SAMPLES, MICRO = 512, 16, 4, 2
CASES = [dict(top_k=None), dict(top_k=8), dict(top_k=8, normalization="renormalize", ghost_token=False),
         dict(top_k=None, top_p=0.9), dict(top_k=16, divergence="reverse_kl"), dict(top_k=None, divergence="jsd"),
         dict(name="sampled", top_k=None, ghost_token=False, samples=16)]
TEMPERATURES = (1.0, 2.0)


def _loss_cfg(case: dict, temperature: float):
    from kdexp.config.schema import LossConfig

    return OmegaConf.merge(OmegaConf.structured(LossConfig), {**case, "temperature": temperature})


def _compare(rank, world, root, tp, tied, fused_cases):
    """Every case x temperature x fused: (max relative loss difference, max gradient difference / max gradient)."""
    import kdexp.distributed as kd
    from kdexp import models, objective
    from kdexp.objective.sources import HiddenCacheTeacher
    from kdexp.teacher import format as fmt
    from kdexp.teacher.writer import ensure_at

    kd.initialize(tensor_parallel=tp, seed=0)
    teacher = models.build(models.get_spec("tiny-teacher", vocab_size=VOCAB, tie_embeddings=tied),
                           params_dtype=torch.float32)
    teacher.eval().requires_grad_(False)
    kd.reseed(1)
    student = models.build(models.get_spec("tiny-student", vocab_size=VOCAB), params_dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    data = [{"tokens": torch.randint(0, VOCAB, (SEQ,), generator=g)} for _ in range(SAMPLES)]
    layout = fmt.Layout(samples=SAMPLES, seq_length=SEQ, k_max=0, record="hidden", temperatures=(),
                        values="float32", index_bytes=fmt.index_bytes(VOCAB), shard_samples=3,
                        hidden_size=teacher.kdexp_spec.hidden_size)
    cache = ensure_at(Path(root), {"teacher": f"tiny tied={tied}", "record": "hidden"}, layout, teacher, data, MICRO)
    out = []
    for fused in fused_cases:
        online = objective.OnlineTeacher(teacher, fused=fused)
        hidden = HiddenCacheTeacher(cache, teacher, fused=fused)
        for ids in ([0, 1], [3, 0]):  # a batch as written, and windows of two micro-batches in another order
            tokens = torch.stack([data[i]["tokens"] for i in ids])
            batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(tokens.shape),
                     "sample_index": torch.tensor(ids)}
            for case in CASES:
                for temperature in TEMPERATURES:
                    cfg = _loss_cfg(case, temperature)
                    loss = objective.LossOptions.parse(cfg)
                    got = {}
                    for name, source in (("online", online), ("hidden", hidden)):
                        obj = objective.Objective(cfg, source, objective.term(loss, source), fused=fused,
                                                  fuses_lm=False)
                        student.zero_grad(set_to_none=True)
                        r = obj(obj.student(student, batch), source(batch), batch, torch.tensor(float(tokens.numel())),
                                seed=11, needs_lm=False)
                        r.kd.backward()
                        got[name] = (r.kd.detach(), torch.cat([p.grad.reshape(-1) for p in student.parameters()
                                                               if p.grad is not None]))
                    (lo, go), (lh, gh) = got["online"], got["hidden"]
                    out.append((fused, ids, str(case), temperature, float(lo), float((lh - lo).abs() / lo.abs()),
                                float((gh - go).abs().max() / go.abs().max())))
    return out


def _check(results):
    for fused, ids, case, temperature, loss, dloss, dgrad in results:
        where = f"fused={fused} batch={ids} {case} T={temperature}: loss {loss:.6g}"
        assert loss > 0 and dloss <= 1e-5 and dgrad <= 1e-5, f"{where}: rel diff {dloss:.2e}, grad {dgrad:.2e}"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hidden_store_equals_online_tp1(tmp_path, tied):
    with lone_process():
        results = _compare(0, 1, tmp_path / "c", 1, tied, (True, False))
    assert len(results) == 2 * 2 * len(CASES) * len(TEMPERATURES)
    _check(results)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hidden_store_equals_online_tp2(tmp_path, tied):
    from kdexp.distributed.testing import run_on_processes

    per_rank = run_on_processes(_compare, 2, args=(str(tmp_path / "c"), 2, tied, (True,)), timeout=600)
    for results in per_rank:
        assert len(results) == 2 * len(CASES) * len(TEMPERATURES)
        _check(results)


def test_the_hidden_layout_and_its_config():
    """H values per token in the teacher's params dtype (the embedded teacher: 4 x hidden bytes at fp32); the store
    serves what a top-K store refuses (dense, any temperature), and teacher.store is checked like any key."""
    from test_teacher_cache_run import cfg_of

    from kdexp.config import validate
    from kdexp.teacher import format as fmt

    lay = fmt.Layout.from_config(cfg_of("teacher=cached", "teacher.store=hidden"), VOCAB, 10, hidden_size=256,
                                 hidden_dtype="bfloat16")
    assert (lay.record, lay.bytes_per_token(), lay.key_entries()) == ("hidden", 512, {"hidden_size": 256})
    assert lay.shapes(3) == {"values": ((3, 256, 256), fmt.np.dtype("<u2"))}
    validate(cfg_of("teacher=cached", "teacher.store=hidden", "loss=dense", "loss.temperature=3"))
    validate(cfg_of("teacher=cached", "teacher.store=hidden", "loss=sampled", "loss.temperature=2"))
    with pytest.raises(ValueError, match="teacher.store='all' is invalid: must be one of null, topk, sampled, hidden"):
        validate(cfg_of("teacher=cached", "teacher.store=all"))
    with pytest.raises(ValueError, match="teacher.store='sampled' is invalid: needs loss.samples"):
        validate(cfg_of("teacher=cached", "teacher.store=sampled"))
    with pytest.raises(ValueError, match="teacher.store='topk' is invalid: cannot serve sampled KD"):
        validate(cfg_of("teacher=cached", "teacher.store=topk", "loss=sampled"))


@pytest.mark.slow
def test_a_run_from_the_hidden_store_matches_the_online_run(env, tmp_path):
    """End to end: `teacher=cached teacher.store=hidden` with what a top-K store refuses (dense KD at T=2) trains to
    the online run's losses and eval metrics (the cache built first, by the run)."""
    from _launch import kdexp_run, metrics

    smoke = ["experiment=smoke", "logger=none", "loss=dense", "loss.temperature=2"]
    runs = {}
    for name, extra in (("online", []), ("hidden", ["teacher=cached", "teacher.store=hidden"])):
        proc = kdexp_run([*smoke, *extra, f"hydra.run.dir={tmp_path / name}"], env, tmp_path)
        runs[name] = metrics(tmp_path / name, "train") + metrics(tmp_path / name, "val")
        if name == "hidden":
            out = proc.stdout + proc.stderr
            assert "hidden record: final hidden states of size 256" in out and "1024 B/token" in out, out[-3000:]
    assert len(runs["online"]) == len(runs["hidden"]) > 0
    for a, b in zip(runs["online"], runs["hidden"]):
        for key in ("train/kd_loss", "train/lm_loss", "val/kl_to_teacher", "val/lm_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a["step"])
