"""Padded vocabularies (model.vocab_alignment=tokenizer, kdexp.models.vocab): tiny Hugging Face checkpoints of three
vocabulary sizes over one 256-id tokenizer (the teacher padded to 320 rows, the student to 288, the unpadded teacher
at 256), built here. Loaded aligned, the teacher's logits on the real ids are the unpadded teacher's exactly, every
padded id is -inf in both models, and the KD loss equals the float64 reference on the shared ids; a model with fewer
rows than the tokenizer has ids, or a mismatch without the option, is a config error naming the fix."""
import math

import pytest
import torch
from hydra import compose, initialize_config_module

from _kd_reference import reference_kd
from _launch import kdexp_run
from _lone_process import lone_process
from kdexp.config import validate
from kdexp.losses import logits_kd_loss
from kdexp.models import load_hf, vocab_parallel_logits

REAL = 256  # the tokenizer's ids


def _qwen3(vocab: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                      rms_norm_eps=1e-6, max_position_embeddings=4096,
                      rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, attn_implementation="eager")
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return model


def _tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(REAL - 2)} | {"<|endoftext|>": REAL - 2, "<unk>": REAL - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """teacher (256 rows), the same teacher padded to 320 rows (64 random rows appended), a student of 288 rows and
    one of 200 (fewer than the tokenizer's ids); each directory holds the tokenizer."""
    root = tmp_path_factory.mktemp("padded")
    teacher = _qwen3(REAL, seed=1)
    padded = _qwen3(320, seed=1)
    with torch.no_grad():
        for name, p in teacher.named_parameters():
            q = dict(padded.named_parameters())[name]
            if p.shape == q.shape:
                q.copy_(p)
            else:  # embed_tokens / lm_head: the real rows, then padding rows of noise
                q[:REAL].copy_(p)
                q[REAL:].normal_(0, 1.0)
    out = {}
    for name, model in (("teacher", teacher), ("padded", padded), ("student", _qwen3(288, seed=2)),
                        ("short", _qwen3(200, seed=3))):
        model.save_pretrained(root / name, safe_serialization=True)
        _tokenizer(root / name)
        out[name] = root / name
    return out


@pytest.fixture
def tp1(monkeypatch):
    with lone_process(seed=5, monkeypatch=monkeypatch) as state:
        yield state


def test_aligned_teacher_is_exact_on_the_real_ids_and_minus_inf_beyond(tp1, ckpts):
    ids = torch.randint(0, REAL, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = vocab_parallel_logits(load_hf(ckpts["teacher"]), ids)
        for which in ("padded", "teacher"):  # 320 rows cut to 288, 256 rows padded to 288
            got = vocab_parallel_logits(load_hf(ckpts[which], vocab_size=288, real_vocab=REAL), ids)
            assert got.shape == (2, 16, 288)
            torch.testing.assert_close(got[..., :REAL], plain, rtol=0, atol=1e-5)
            assert torch.isneginf(got[..., REAL:]).all()
        student = vocab_parallel_logits(load_hf(ckpts["student"], real_vocab=REAL), ids)
        assert torch.isneginf(student[..., REAL:]).all() and torch.isfinite(student[..., :REAL]).all()
        unmasked = vocab_parallel_logits(load_hf(ckpts["padded"]), ids)
        assert unmasked.shape[-1] == 320 and torch.isfinite(unmasked).all()  # without the option: as it was


@pytest.mark.parametrize("kw", [dict(), dict(divergence="reverse_kl"), dict(divergence="jsd"), dict(top_k=32),
                                dict(top_p=0.9, min_k=2), dict(top_k=288, divergence="reverse_kl")],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "dense")
def test_the_kd_loss_between_aligned_models_is_exact_on_the_shared_ids(tp1, ckpts, kw):
    ids = torch.randint(0, REAL, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        teacher = vocab_parallel_logits(load_hf(ckpts["padded"], vocab_size=288, real_vocab=REAL), ids)
    student_model = load_hf(ckpts["student"], real_vocab=REAL)
    student = vocab_parallel_logits(student_model, ids)
    loss = logits_kd_loss(student, teacher, **kw)
    s64 = student[..., :REAL].detach().double().reshape(-1, REAL).requires_grad_(True)
    ref_kw = {**kw, "top_k": min(kw["top_k"], REAL)} if "top_k" in kw else kw
    ref = reference_kd(s64, teacher[..., :REAL].double().reshape(-1, REAL), **ref_kw)[0]
    torch.testing.assert_close(loss.double().reshape(-1), ref.detach(), rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    w = student_model.output_layer.weight.grad
    assert torch.isfinite(w).all() and (w[REAL:] == 0).all()  # nothing learnt on a row that is not a token


def _cfg(*overrides):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_config_accepts_padding_only_and_names_the_fix(ckpts):
    both = (f"model.teacher_path={ckpts['padded']}", f"model.student_path={ckpts['student']}",
            "model.teacher=null", "model.student=null", "trainer.seq_length=64")
    with pytest.raises(ValueError, match=r"vocabulary \(320\) and model.student vocabulary \(288\) differ: .*"
                                         r"set model.vocab_alignment=tokenizer"):
        validate(_cfg(*both))
    validate(_cfg(*both, "model.vocab_alignment=tokenizer", "loss.top_k=288", "teacher.k_max=288"))
    with pytest.raises(ValueError, match=r"tokenizer has 256 ids but model.teacher has 320 vocabulary rows and "
                                         r"model.student 200"):
        validate(_cfg(f"model.teacher_path={ckpts['padded']}", f"model.student_path={ckpts['short']}",
                      "model.teacher=null", "model.student=null", "trainer.seq_length=64",
                      "model.vocab_alignment=tokenizer"))
    with pytest.raises(ValueError, match="model.vocab_alignment='tokens' is invalid"):
        validate(_cfg(*both, "model.vocab_alignment=tokens"))


@pytest.mark.slow
def test_a_run_distils_between_padded_checkpoints(ckpts, env, tmp_path):
    import json

    args = [f"model.teacher_path={ckpts['padded']}", f"model.student_path={ckpts['student']}", "model.teacher=null",
            "model.student=null", "teacher.k_max=256", "loss.top_k=64", "logger=none", "data.max_chars=100000",
            "trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.micro_batch_size=2", "trainer.seq_length=32",
            "trainer.eval_interval=2", "trainer.eval_iters=1", "trainer.checkpoint_interval=2", f"hydra.run.dir={tmp_path / 'run'}"]
    refused = kdexp_run(args, env, tmp_path, check=False, timeout=600)
    assert refused.returncode == 2 and "set model.vocab_alignment=tokenizer" in refused.stderr, refused.stderr[-2000:]
    done = kdexp_run([*args, "model.vocab_alignment=tokenizer"], env, tmp_path, check=False, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    final = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]
    assert all(math.isfinite(v) for k, v in final.items() if isinstance(v, float)), final


def _aligned_step(paths, fused: bool, coefficients) -> dict:
    """One KD (Top-K 32 + ghost, fused LM) + LM step between the padded teacher (320 rows cut to 288) and the
    288-row student, both masked beyond the tokenizer's 256 ids, through the objective: the loss, the eval metrics
    and the student's gradients (gathered over TP)."""
    from megatron.core import parallel_state as ps

    import kdexp.distributed as kd
    from kdexp.config import LossConfig
    from kdexp.losses import KDLossOptions
    from kdexp.models import read_config, spec_from_hf
    from kdexp.models.hf import gather_tp, hf_tensors
    from kdexp import objective

    teacher = load_hf(paths["padded"], vocab_size=288, real_vocab=REAL)
    teacher.requires_grad_(False)
    student = load_hf(paths["student"], real_vocab=REAL)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, REAL, (2, 16), generator=g)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
             "loss_mask": (torch.rand(2, 16, generator=g) > 0.2).float()}
    loss_cfg = LossConfig(top_k=32)
    term = objective.LogitTerm(KDLossOptions.from_config(loss_cfg))
    source = objective.OnlineTeacher(teacher, fused=fused)
    obj = objective.Objective(loss_cfg, source, term, fused=fused, fuses_lm=term.fuses_lm, coefficients=coefficients,
                              eval_teacher=source)
    denom = batch["loss_mask"].sum()
    r = obj(obj.student(student, batch), obj.teacher(batch), batch, denom)
    loss = 0.6 * r.kd + 0.4 * r.lm
    loss.backward()
    kd.sum_grads_over_tp(student.parameters())
    group, tp = ps.get_tensor_model_parallel_group(), kd.state().tp_size
    spec, grads = spec_from_hf(read_config(paths["student"])), {}
    for name, p in student.named_parameters():
        grads.update(hf_tensors(name, gather_tp(p, group, tp, p.grad), spec, tp))  # TP-independent layout
    return {"loss": loss.detach(), "eval": obj.evaluate(student, batch, denom), "grads": grads}


FUSED = {"fused, recompute": (True, None), "fused, coefficients": (True, (0.6, 0.4))}


def _aligned_tp2(rank, world_size, paths):
    import kdexp.distributed as kd

    kd.initialize(tensor_parallel=2, seed=5)
    return {name: _aligned_step(paths, *case) for name, case in FUSED.items()}


@pytest.mark.slow
def test_the_fused_head_masks_the_padded_ids_as_the_output_layer_does(ckpts):
    """With model.vocab_alignment=tokenizer the fused head's chunks (student and teacher) are -inf beyond the
    tokenizer's ids, as the output layer's hook makes the whole logits: the loss, the eval metrics and every student
    gradient fused (both backward modes; TP 1, and TP 2 where only rank 1's shard holds padded columns) equal the
    whole-logits path at TP 1 within 1e-5, and the padded rows of the output weight learn nothing."""
    from kdexp.distributed.testing import run_on_processes

    with lone_process(seed=5):
        ref = _aligned_step(ckpts, False, None)
        one = {name: _aligned_step(ckpts, *case) for name, case in FUSED.items()}
    two = run_on_processes(_aligned_tp2, 2, args=(dict(ckpts),))[0]
    assert torch.isfinite(ref["loss"]) and (ref["grads"]["lm_head.weight"][REAL:] == 0).all()
    for case, got in [*((("tp1", k), v) for k, v in one.items()), *((("tp2", k), v) for k, v in two.items())]:
        assert (got["loss"] - ref["loss"]).abs() <= 1e-5 * ref["loss"].abs(), case
        torch.testing.assert_close(got["eval"], ref["eval"], rtol=1e-5, atol=1e-6)
        assert got["grads"].keys() == ref["grads"].keys()
        for k, want in ref["grads"].items():
            rel = float((got["grads"][k] - want).norm() / want.norm().clamp_min(1e-12))
            assert rel <= 1e-5, (case, k, rel)
        assert (got["grads"]["lm_head.weight"][REAL:] == 0).all(), case
