"""In-process checks of the scale features on a tiny GPTModel: bf16 master weights (MasterAdamW against a float64 /
fp32 AdamW reference), activation recompute (same loss and gradients as none), the megatron recompute settings and
the bf16 teacher cast. (Sequence parallelism: tests/test_sequence_parallel.py.)"""
from __future__ import annotations

import pytest
import torch

import kdexp.distributed as kd
from _lone_process import lone_process
from kdexp import models
from kdexp.config.qwen3 import Qwen3Spec
from kdexp.objective import lm_loss
from kdexp.train import optim


def _spec():
    return Qwen3Spec(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, tie_embeddings=True, max_position_embeddings=32)


def _tokens(seed: int = 0, batch: int = 2, seq: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (batch, seq + 1), generator=g)


def _lm_backward(model, tokens):
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits = models.vocab_parallel_logits(model, x)
    loss = lm_loss(logits, y, torch.ones_like(y, dtype=torch.float32))
    loss.backward()
    return loss.detach()


def test_master_adamw_keeps_fp32_masters_state_and_grads_and_writes_back_bf16():
    with lone_process(seed=3):
        kd.reseed(7)
        model = models.build(_spec(), params_dtype=torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert model.config.bf16 and model.config.params_dtype == torch.bfloat16
        opt = optim.make_optimizer(model, lr=1e-2, weight_decay=0.1, master_weights=True)
        assert isinstance(opt, optim.MasterAdamW)
        masters = opt.master_params
        assert masters and all(m.dtype == torch.float32 for m in masters)
        start = [m.detach().clone() for m in masters]
        # two micro-batches accumulate into the fp32 master grads; the bf16 grads are freed as they arrive
        _lm_backward(model, _tokens(0))
        first = [m.grad.clone() for m in masters]
        assert all(p.grad is None for p in model.parameters())
        _lm_backward(model, _tokens(1))
        assert all(m.grad.dtype == torch.float32 for m in masters)
        assert any((m.grad - f).abs().max() > 0 for m, f in zip(masters, first))
        grads = [m.grad.clone() for m in masters]
        opt.step()
        assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if v.ndim)
        # the reference: torch AdamW in float64 on the same fp32 start and grads (same groups, same hyperparameters)
        ref = [torch.nn.Parameter(s.double()) for s in start]
        for r, g in zip(ref, grads):
            r.grad = g.double()
        groups = [{"params": [ref[i] for i, m in enumerate(masters) if any(m is q for q in grp["params"])],
                   "weight_decay": grp["weight_decay"]} for grp in opt.param_groups]
        torch.optim.AdamW(groups, lr=1e-2, betas=optim.BETAS, eps=optim.EPS).step()
        for m, r in zip(masters, ref):
            torch.testing.assert_close(m.double(), r.detach(), rtol=1e-6, atol=1e-7)
        for p, m in zip((p for p in model.parameters() if p.requires_grad), masters):
            assert torch.equal(p, m.to(torch.bfloat16))  # the model holds the masters rounded to bf16
        # resume: a fresh optimizer over a fresh bf16 model loads masters and AdamW state exactly
        saved_model, saved_opt = model.state_dict(), opt.state_dict()
        kd.reseed(99)
        other = models.build(_spec(), params_dtype=torch.bfloat16)
        other.load_state_dict(saved_model)
        opt2 = optim.make_optimizer(other, lr=1e-2, weight_decay=0.1, master_weights=True)
        opt2.load_state_dict(saved_opt)
        for a, b in zip(opt2.master_params, masters):
            assert torch.equal(a, b)
        for a, b in zip(opt2.state.values(), opt.state.values()):
            assert all(torch.equal(a[k], b[k]) for k in b)


def test_teacher_cast_to_bf16_matches_a_bf16_build_of_the_same_weights():
    with lone_process(seed=3):
        kd.reseed(7)
        fp32 = models.build(_spec())
        kd.reseed(7)
        bf16 = models.build(_spec(), params_dtype=torch.bfloat16)
        cast = models.cast(fp32, torch.bfloat16)
        assert cast.config.bf16 and all(p.dtype == torch.bfloat16 for p in cast.parameters())
        tokens = _tokens(2)[:, :-1]
        with torch.no_grad():
            torch.testing.assert_close(models.vocab_parallel_logits(cast, tokens),
                                       models.vocab_parallel_logits(bf16, tokens), rtol=0, atol=0)


def test_recompute_maps_to_megatron_settings():
    from kdexp.models.build import transformer_config

    none = transformer_config(_spec())
    sel = transformer_config(_spec(), recompute="selective")
    full = transformer_config(_spec(), recompute="full")
    assert none.recompute_granularity is None
    assert sel.recompute_granularity == "selective" and sel.recompute_modules == ["core_attn"]
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    with pytest.raises(ValueError, match="trainer.recompute='some'"):
        transformer_config(_spec(), recompute="some")
    with pytest.raises(ValueError, match="parallel.sequence=True is invalid: needs parallel.tensor > 1"):
        transformer_config(_spec(), sequence_parallel=True)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_loss_and_gradients(recompute):
    with lone_process(seed=3):
        out = {}
        for mode in ("none", recompute):
            kd.reseed(7)
            model = models.build(_spec(), recompute=mode)
            loss = _lm_backward(model, _tokens(0))
            out[mode] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
        (l0, g0), (l1, g1) = out["none"], out[recompute]
        assert l0 == l1
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-6, atol=1e-8, msg=name)
