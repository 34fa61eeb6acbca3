"""Sequence parallelism (parallel.sequence=true) against TP 1: the model's loss, logits and every gradient, hidden-state
capture, the gloo reduce-scatter answer (kdexp.distributed.cpu), and whole runs (final metrics, resume).

Model level: the tiny student (GQA, q/k norms), one forward + backward of a loss that weighs every full-vocabulary
logit differently plus a loss on layer 0's captured hidden states; gradients all-gathered over TP and mapped to the
HF names (the export's own gather), after the step's TP rule for norm weights (kdexp.distributed.sum_grads_over_tp).
Tolerance (fp32): loss and logits max |diff| <= 1e-5, each gradient 1e-5 relative (L2); measured ~1e-7 (only the
summation order of the TP reductions differs).
"""
from __future__ import annotations

import pytest
import torch

import kdexp.distributed as kd
from _lone_process import lone_process
from kdexp.distributed.testing import run_on_processes
from kdexp.models import build, capture_hidden, forward_logits, get_spec

SPEC = dict(vocab_size=256, max_position_embeddings=64)


def _model_run(sp: bool, attention: str, native_reduce_scatter: bool = True) -> dict:
    from kdexp.distributed import cpu
    from kdexp.models.hf import gather_tp, hf_tensors

    cpu._NATIVE_REDUCE_SCATTER[0] = native_reduce_scatter
    st = kd.state()
    kd.reseed(7)
    spec = get_spec("tiny-student", **SPEC)
    model = build(spec, sequence_parallel=sp, attention=attention)
    model.train()
    ids = torch.randint(0, SPEC["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(3))
    with capture_hidden(model, [0]) as hidden:
        logits = forward_logits(model, ids)
    w = torch.linspace(-1, 1, logits.numel()).view_as(logits)
    h0 = hidden[0]
    loss = (logits * w).sum() / logits.shape[-1] + (h0 * torch.linspace(0, 1, h0.numel()).view_as(h0)).sum()
    loss.backward()
    kd.sum_grads_over_tp(model.parameters())
    from megatron.core import parallel_state as ps

    grads = {}
    for name, p in model.named_parameters():
        grads.update(hf_tensors(name, gather_tp(p, ps.get_tensor_model_parallel_group(), st.tp_size, p.grad), spec,
                                 st.tp_size))
    return {"loss": loss.detach(), "logits": logits.detach(), "hidden": h0.detach(), "grads": grads}


def _tp2_worker(rank, world_size):
    kd.initialize(tensor_parallel=2, seed=5)
    runs = {(sp, attention, native): _model_run(sp, attention, native)
            for sp, attention, native in ((False, "sdpa", True), (True, "sdpa", True), (True, "megatron", True),
                                          (True, "sdpa", False))}
    marks = {}
    for sp in (False, True):
        model = build(get_spec("tiny-student", **SPEC), sequence_parallel=sp)
        marks[sp] = sorted(n for n, p in model.named_parameters() if getattr(p, "tp_summed_grad", False))
    return runs, marks


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.slow
def test_tp2_with_and_without_sequence_parallel_matches_tp1():
    with lone_process(seed=5):
        ref = {attention: _model_run(False, attention) for attention in ("sdpa", "megatron")}
    for res, marks in run_on_processes(_tp2_worker, 2):
        # megatron's finalize_model_grads rule: the q/k norms at TP > 1; under SP every norm: 2 layers x (input,
        # pre-MLP, q, k) + the final norm
        assert marks[False] and all("q_layernorm" in n or "k_layernorm" in n for n in marks[False])
        assert len(marks[True]) == 2 * 4 + 1 and set(marks[False]) < set(marks[True])
        for (sp, attention, native), r in res.items():
            one = ref[attention]
            case = (sp, attention, native)
            assert (r["loss"] - one["loss"]).abs() <= 1e-5 * one["loss"].abs().clamp_min(1), case
            torch.testing.assert_close(r["logits"], one["logits"], rtol=0, atol=1e-5)
            torch.testing.assert_close(r["hidden"], one["hidden"], rtol=0, atol=1e-5)  # gathered under SP
            assert r["grads"].keys() == one["grads"].keys()
            for name in one["grads"]:
                # norm weights included: without the TP sum the q/k norms (and under SP every norm) are partial
                assert _rel(r["grads"][name], one["grads"][name]) <= 1e-5, (case, name)


def test_norm_weights_carry_megatrons_marks():
    from kdexp.models.norms import TP_SUMMED, RMSNorm

    with lone_process(seed=5):
        model = build(get_spec("tiny-student", **SPEC))
        norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
        assert norms and all(isinstance(m, RMSNorm) for m in norms)  # final norm included
        assert not any(getattr(p, TP_SUMMED, False) for p in model.parameters())  # TP 1: nothing to sum
        assert all(m.weight.sequence_parallel is False for m in norms)
