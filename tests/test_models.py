"""kdexp.models against transformers' own Qwen3ForCausalLM (random tiny checkpoints built here, fp32, eager).

TP=1 runs in this process; TP=2 runs on two gloo processes and is compared with the same transformers reference.
"""

import dataclasses
import json

import pytest
import torch

import kdexp.distributed as kd
from _lone_process import lone_process
from kdexp.distributed.testing import run_on_processes
from kdexp.models import (QWEN3_SIZES, Qwen3Spec, build, check_tp, forward_logits, get_spec, load_hf, save_hf,
                          spec_from_hf, spec_to_hf, vocab_parallel_logits)

VOCAB = 256


def _hf_model(tie: bool, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie,
                      rms_norm_eps=1e-6, max_position_embeddings=128,
                      rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, attn_implementation="eager")
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights and larger weights, so a wrong mapping cannot hide
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return model


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Three checkpoints (tied, untied, untied+sharded) with the transformers logits on fixed inputs."""
    root = tmp_path_factory.mktemp("qwen3")
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    out = {"ids": ids}
    for name, tie, shard in (("tied", True, None), ("untied", False, None), ("sharded", False, "30KB")):
        model = _hf_model(tie, seed=len(out))
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(root / name, safe_serialization=True, **kwargs)
        out[name] = (root / name, _hf_logits(model, ids))
    assert (root / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    return out


@pytest.fixture
def tp1(monkeypatch):
    with lone_process(seed=5, monkeypatch=monkeypatch) as state:
        yield state


@pytest.mark.parametrize("which", ["tied", "untied", "sharded"])
def test_load_hf_matches_transformers(tp1, ckpts, which):
    path, ref = ckpts[which]
    model = load_hf(path)
    assert (model.output_layer.weight is None) == (which == "tied")
    with torch.no_grad():
        got = forward_logits(model, ckpts["ids"])
        torch.testing.assert_close(vocab_parallel_logits(model, ckpts["ids"]), got, rtol=0, atol=0)
    assert got.shape == (2, 24, VOCAB)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def test_load_hf_bf16_is_close(tp1, ckpts):
    path, ref = ckpts["untied"]
    model = load_hf(path, params_dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        got = forward_logits(model, ckpts["ids"]).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_save_hf_round_trip_loads_in_transformers(tp1, ckpts, tmp_path, which):
    from transformers import Qwen3ForCausalLM

    path, ref = ckpts[which]
    model = load_hf(path)
    out = tmp_path / "student"
    save_hf(model, out, model.kdexp_spec)
    save_hf(model, out, model.kdexp_spec)  # overwriting an existing checkpoint works and leaves no temp dirs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert spec_from_hf(cfg) == spec_from_hf(json.loads((path / "config.json").read_text()))
    back = Qwen3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    torch.testing.assert_close(_hf_logits(back, ckpts["ids"]), ref, rtol=0, atol=1e-5)


def test_loaded_weights_carry_megatron_tp_attributes(tp1, ckpts):
    """Grad clipping and the TP gather read these; load_hf skips megatron's init, which normally sets them."""
    model = load_hf(ckpts["untied"][0])
    loaded = dict(model.named_parameters())
    fresh = dict(build(model.kdexp_spec).named_parameters())
    assert loaded.keys() == fresh.keys()
    for name, p in fresh.items():
        attrs = [(a, getattr(p, a, None)) for a in ("tensor_model_parallel", "partition_dim", "partition_stride")]
        assert attrs == [(a, getattr(loaded[name], a, None)) for a, _ in attrs], name


def test_build_random_tiny_presets_train_step(tp1):
    spec = get_spec("tiny-student", vocab_size=512)
    model = build(spec)
    ids = torch.randint(0, 512, (2, 32))
    logits = forward_logits(model, ids)
    assert logits.shape == (2, 32, 512) and torch.isfinite(logits).all()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    assert model.decoder.layers[0].self_attention.q_layernorm.weight.grad.abs().sum() > 0
    n = sum(p.numel() for p in model.parameters())
    assert n == spec.num_params()


def test_tp_checks_name_parallel_tensor():
    spec = QWEN3_SIZES["tiny-teacher"]
    check_tp(spec, 2)
    for bad, value in ((dict(num_heads=6, num_kv_heads=3), 3), (dict(intermediate_size=769), 769),
                       (dict(vocab_size=4097), 4097)):
        with pytest.raises(ValueError, match=rf"parallel\.tensor=2 .*={value}"):
            check_tp(dataclasses.replace(spec, **bad), 2)
    with pytest.raises(ValueError, match="model.num_kv_heads"):
        Qwen3Spec(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=3,
                  head_dim=8, tie_embeddings=True)


def test_real_sizes_round_trip_and_counts():
    from transformers import Qwen3Config

    for name, spec in QWEN3_SIZES.items():
        cfg = spec_to_hf(spec)
        assert spec_from_hf(cfg) == spec
        hf = Qwen3Config.from_dict(cfg)
        assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (
            spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        if not name.startswith("tiny"):
            nominal = float(name.removesuffix("b"))
            assert abs(spec.num_params() / 1e9 - nominal) / nominal < 0.1, name
            assert spec.vocab_size == 151936 and spec.head_dim == 128
            assert spec.tie_embeddings == (nominal < 5)
    with pytest.raises(ValueError, match="model_type"):
        spec_from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="rope"):
        spec_from_hf({**spec_to_hf(QWEN3_SIZES["0.6b"]), "rope_scaling": {"rope_type": "yarn"}})


def _tp2_worker(rank, world_size, dirs, ids, save_dir):
    st = kd.initialize(tensor_parallel=2)
    out = {}
    for name, path in dirs.items():
        model = load_hf(path)
        with torch.no_grad():
            out[name] = (forward_logits(model, ids), vocab_parallel_logits(model, ids))
    # differentiable through the TP gather
    forward_logits(model, ids).float().logsumexp(-1).mean().backward()
    out["grad_ok"] = bool(model.decoder.final_layernorm.weight.grad.abs().sum() > 0)
    save_hf(model, save_dir, model.kdexp_spec)
    try:
        build(dataclasses.replace(model.kdexp_spec, num_kv_heads=1, num_heads=4))
        out["bad_tp"] = None
    except ValueError as e:
        out["bad_tp"] = str(e)
    out["tp"] = (st.tp_size, st.tp_rank)
    return out


@pytest.mark.slow
def test_tp2_matches_transformers(ckpts, tmp_path):
    from transformers import Qwen3ForCausalLM

    ids = ckpts["ids"]
    dirs = {k: str(ckpts[k][0]) for k in ("tied", "untied", "sharded")}
    results = run_on_processes(_tp2_worker, 2, args=(dirs, ids, str(tmp_path / "saved")))
    half = VOCAB // 2
    for rank, res in enumerate(results):
        assert res["tp"] == (2, rank)
        for name in dirs:
            full, shard = res[name]
            torch.testing.assert_close(full, ckpts[name][1], rtol=0, atol=1e-4)
            torch.testing.assert_close(shard, full[..., rank * half:(rank + 1) * half], rtol=0, atol=0)
        assert res["grad_ok"]
        assert "parallel.tensor=2" in res["bad_tp"] and "num_kv_heads=1" in res["bad_tp"]
    # The TP=2 save (gathered shards, un-fused QKV and gate/up) is a valid transformers checkpoint.
    back = Qwen3ForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager").eval()
    torch.testing.assert_close(_hf_logits(back, ids), ckpts["sharded"][1], rtol=0, atol=1e-5)


def test_tiny_presets_are_gqa_and_run_at_tp2():
    for name in ("tiny-teacher", "tiny-student"):
        spec = QWEN3_SIZES[name]
        assert spec.num_heads > spec.num_kv_heads and spec.tie_embeddings
        check_tp(get_spec(name, vocab_size=4096), 2)
