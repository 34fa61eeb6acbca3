"""On-policy distillation in the objective (kdexp.objective.rollout), against independent references: the schedule of
on-policy steps by hand, the rollout batch's masks against the generation it came from, both estimators' losses and
gradients against float64 formulas on the whole logits (fused head and reference path), and val/onpolicy_reverse_kl
against a float64 KL(student || teacher) on the student's own continuations. Tiny random models, a few tokens."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

import kdexp.distributed as kd
from _lone_process import lone_process
from kdexp import models, objective
from kdexp.config.schema import LossConfig, RolloutConfig
from kdexp.losses import KDLossOptions

V, P, N = 256, 4, 6


@pytest.fixture
def tp1(monkeypatch):
    with lone_process(seed=5, monkeypatch=monkeypatch) as state:
        yield state


def _rollouts(estimator: str) -> objective.Rollouts:
    cfg = RolloutConfig(name="on_policy", on_policy_fraction=1.0, prompt_tokens=P, max_new_tokens=N, temperature=0.9,
                        estimator=estimator)
    return objective.Rollouts(cfg, seed=11, eos_id=3)


def test_the_on_policy_steps_are_an_exact_fraction_after_the_warmup():
    def steps(fraction, warmup=0, name="on_policy"):
        r = objective.Rollouts(RolloutConfig(name=name, on_policy_fraction=fraction, warmup_steps=warmup), seed=0,
                               eos_id=None)
        return [s for s in range(20) if r.on_policy(s)]

    assert steps(1.0) == list(range(20)) and steps(0.0) == []
    assert steps(0.5) == [1, 3, 5, 7, 9, 11, 13, 15, 17, 19]
    assert steps(0.25, warmup=4) == [7, 11, 15, 19]  # k = step - 4: floor((k+1)/4) > floor(k/4) at k = 3, 7, ...
    assert len(steps(1 / 3)) == 6 and steps(1.0, warmup=18) == [18, 19]
    assert steps(1.0, name="off") == []


def _pair(seed=7):
    kd.reseed(seed)
    spec = models.get_spec("tiny-student", vocab_size=V, max_position_embeddings=64)
    student = models.build(spec)
    teacher = models.build(dataclasses.replace(spec, tie_embeddings=False))
    teacher.requires_grad_(False)
    return student, teacher


def _prompt_batch(b=3):
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(4, V, (b, 16), generator=g)
    return {"tokens": tokens, "sample_index": torch.arange(10, 10 + b)}


def test_a_rollout_batch_trains_on_the_generated_tokens_only(tp1):
    student, _ = _pair()
    batch = _prompt_batch()
    r = objective.Rollouts(RolloutConfig(name="on_policy", on_policy_fraction=1.0, prompt_tokens=P, max_new_tokens=N,
                                         temperature=3.0), seed=11, eos_id=5)
    rb = r.sample(student, batch, step=4)
    ref = models.generate(student, batch["tokens"][:, :P], max_new_tokens=N, temperature=3.0, eos_id=5,
                          seeds=models.rollout_seeds(11, 4, [10, 11, 12]))
    assert torch.equal(rb["tokens"], ref.tokens[:, :-1]) and torch.equal(rb["labels"], ref.tokens[:, 1:])
    assert torch.equal(rb["tokens"][:, :P], batch["tokens"][:, :P])
    for i in range(3):
        n = int(ref.lengths[i])
        want = torch.zeros(P + N - 1)
        want[P - 1:P - 1 + n] = 1  # label j is token j + 1: the first generated token is label P - 1
        assert torch.equal(rb["loss_mask"][i], want)
        assert torch.equal(rb["sampler_logprobs"][i, P - 1:P - 1 + n], ref.sampler_logprobs[i, :n].float())
        assert bool(rb["truncated"][i]) == (n == N and int(ref.tokens[i, P + N - 1]) != 5)
    assert torch.equal(rb["lengths"], ref.lengths)


def _objective(student, teacher, fused: bool, estimator: str, loss_cfg=None):
    loss_cfg = loss_cfg or LossConfig(top_k=None, ghost_token=False, divergence="reverse_kl")
    term = objective.LogitTerm(KDLossOptions.from_config(loss_cfg))
    return objective.Objective(loss_cfg, objective.OnlineTeacher(teacher, fused=fused), term, fused=fused,
                               fuses_lm=term.fuses_lm, eval_teacher=objective.OnlineTeacher(teacher, fused=fused),
                               rollout=_rollouts(estimator=estimator))


def _whole(model, tokens):
    return models.forward_logits(model, tokens).double()


def _loss_and_grads(fused: bool, estimator: str):
    student, teacher = _pair()
    obj = _objective(student, teacher, fused, estimator)
    rb = obj.rollout.sample(student, _prompt_batch(), step=0)
    denom = rb["loss_mask"].sum()
    kd_, stats = objective.rollout_loss(obj, obj.student(student, rb), obj.teacher(rb), rb, denom, seed=0)
    kd_.backward()
    return student, teacher, rb, kd_.detach(), stats, {n: p.grad.clone() for n, p in student.named_parameters()}


def _reference(student, teacher, rb, estimator):
    """The float64 loss on the whole logits, and its gradient through a float32 copy of the graph."""
    student.zero_grad(set_to_none=True)
    z = models.forward_logits(student, rb["tokens"])
    s = torch.log_softmax(z.double(), -1)
    with torch.no_grad():
        t = torch.log_softmax(_whole(teacher, rb["tokens"]), -1)
    mask = rb["loss_mask"].double()
    y = rb["labels"][..., None]
    lp_s, lp_t = s.gather(-1, y)[..., 0], t.gather(-1, y)[..., 0]
    if estimator == "sampled_token":
        per_token = -torch.exp(lp_s - rb["sampler_logprobs"].double()) * (lp_t - lp_s).detach()
    else:
        per_token = (s.exp() * (s - t)).sum(-1)  # KL(student || teacher)
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    lp_s = lp_s.detach()
    stats = {"student_logprob": (lp_s * mask).sum() / mask.sum(), "teacher_logprob": (lp_t * mask).sum() / mask.sum(),
             "entropy": (-(s.exp() * s).sum(-1).detach() * mask).sum() / mask.sum()}
    return loss.detach(), stats, {n: p.grad.clone() for n, p in student.named_parameters()}


@pytest.mark.parametrize("fused", [False, True], ids=["whole logits", "fused head"])
@pytest.mark.parametrize("estimator", ["distribution", "sampled_token"])
def test_the_rollout_loss_and_its_gradient_match_a_float64_reference(tp1, fused, estimator):
    student, teacher, rb, loss, stats, grads = _loss_and_grads(fused, estimator)
    assert 0 < rb["loss_mask"].sum() < rb["loss_mask"].numel()  # prompts masked, generated tokens counted
    want, want_stats, want_grads = _reference(student, teacher, rb, estimator)
    assert float(loss) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    for key, value in want_stats.items():
        assert float(getattr(stats, key)) == pytest.approx(float(value), rel=1e-4), key
    for name, g in want_grads.items():
        rel = float((grads[name] - g).norm() / g.norm().clamp_min(1e-12))
        assert rel < 1e-4, (name, rel)
    if estimator == "sampled_token":
        # at the sampler's temperature 0.9 the ratio p_S / q differs from 1; its mean is the reference's
        mask = rb["loss_mask"].double()
        lp_s = torch.log_softmax(_whole(student, rb["tokens"]), -1).gather(-1, rb["labels"][..., None])[..., 0]
        ratio = torch.exp(lp_s - rb["sampler_logprobs"].double())
        assert float(stats.importance_ratio) == pytest.approx(float((ratio * mask).sum() / mask.sum()), rel=1e-4)
        assert float(stats.importance_ratio_sq) == pytest.approx(float((ratio ** 2 * mask).sum() / mask.sum()),
                                                                 rel=1e-4)
    else:
        assert stats.importance_ratio is None


@pytest.mark.parametrize("fused", [False, True], ids=["whole logits", "fused head"])
def test_val_onpolicy_reverse_kl_is_the_exact_reverse_kl_on_the_students_continuations(tp1, fused):
    student, teacher = _pair()
    obj = _objective(student, teacher, fused, "distribution")
    micros = [_prompt_batch(2), {k: v[1:] for k, v in _prompt_batch(3).items()}]
    student.eval()
    got = float(objective.onpolicy_reverse_kl(obj, student, micros))
    num = den = 0.0
    for b in micros:
        r = models.generate(student, b["tokens"][:, :P], max_new_tokens=N, temperature=0.9, eos_id=3,
                            seeds=models.rollout_seeds(11, objective.rollout.EVAL_STREAM, b["sample_index"].tolist()))
        tokens, mask = r.tokens[:, :-1], r.generated[:, 1:].double()
        s = torch.log_softmax(_whole(student, tokens), -1)
        t = torch.log_softmax(_whole(teacher, tokens), -1)
        num += float(((s.exp() * (s - t)).sum(-1) * mask).sum())
        den += float(mask.sum())
    assert got == pytest.approx(num / den, rel=1e-5)
    assert math.isfinite(got) and got > 0


def test_the_eos_id_comes_from_the_tokenizer():
    assert objective._eos(SimpleNamespace(tokenizer=SimpleNamespace(eos=0))) == 0
    assert objective._eos(SimpleNamespace(vocab_size=8)) is None


def test_the_plans_kv_cache_is_what_megatrons_inference_context_allocates(tp1):
    """kdexp.plan.sizing.rollout_bytes' KV cache against the bytes of the keys and values megatron's static inference
    context holds after a prefill of a tiny model (GQA: 2 kv heads of 4)."""
    from kdexp.models.generation import _inference, _Steps
    from kdexp.plan.sizing import rollout_bytes

    student, _ = _pair()
    b, prompt, new = 3, P, N
    with _inference(student):
        steps = _Steps(student, b, prompt + new, kv_cache=True)
        steps.first(_prompt_batch(b)["tokens"][:, :prompt])
    held = sum(t.numel() * t.element_size() for kv in steps.ctx.key_value_memory_dict.values() for t in kv)
    spec = student.kdexp_spec
    assert held == rollout_bytes(spec, b, prompt, new, 4, 1)["KV cache"] > 0
