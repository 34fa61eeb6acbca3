"""Qwen3 shapes: the Qwen3Spec dataclass, the real sizes, tiny CPU presets, and HF config.json <-> spec.

Torch-free and in the config package: the value checks ask it which names model.teacher / model.student may take
and what their heads and vocabularies are; kdexp.models builds from it (and re-exports it).

Shapes of the real checkpoints are the values of the Qwen/Qwen3-*/config.json files (vocab 151936, head_dim 128,
rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960); the 0.6B/1.7B/4B tie the input embedding and
the LM head, 8B/14B/32B do not.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from kdexp.rules import is_int

QWEN3_VOCAB = 151936


@dataclasses.dataclass(frozen=True)
class Qwen3Spec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    max_position_embeddings: int = 40960

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not is_int(v) or v < 1:
                raise ValueError(f"model.{f} must be an integer >= 1, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads}")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ValueError(f"model.rope_theta and model.norm_eps must be > 0, got {self.rope_theta}, "
                             f"{self.norm_eps}")

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * hd * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * hd * h + 2 * hd
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h


def _real(hidden, ffn, layers, heads, tie):
    return Qwen3Spec(vocab_size=QWEN3_VOCAB, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
                     num_heads=heads, num_kv_heads=8, head_dim=128, tie_embeddings=tie)


QWEN3_SIZES: dict[str, Qwen3Spec] = {
    "0.6b": _real(1024, 3072, 28, 16, True),
    "1.7b": _real(2048, 6144, 28, 16, True),
    "4b": _real(2560, 9728, 36, 32, True),
    "8b": _real(4096, 12288, 36, 32, False),
    "14b": _real(5120, 17408, 40, 40, False),
    "32b": _real(5120, 25600, 64, 64, False),
    # CPU defaults: Qwen3-shaped (GQA, q/k norm, SwiGLU, tied), vocab replaced by the tokenizer's at build time.
    "tiny-teacher": Qwen3Spec(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                              num_kv_heads=2, head_dim=64, tie_embeddings=True, max_position_embeddings=4096),
    # 4 query heads x 32 over 2 kv heads: same parameter count as 2x64 over 1, but still GQA at parallel.tensor=2.
    "tiny-student": Qwen3Spec(vocab_size=4096, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=32, tie_embeddings=True, max_position_embeddings=4096),
}


def size_key(name: Any) -> Optional[str]:
    """The QWEN3_SIZES key a size name spells, or None: case-insensitive, with or without "Qwen/" and "Qwen3-"
    ("Qwen/Qwen3-1.7B", "Qwen3-1.7B", "1.7B" and "1.7b" are one size). The one table of spellings: the config
    checks, the plan and the model builder all read names through it."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower().removeprefix("qwen/").removeprefix("qwen3-")
    return key if key in QWEN3_SIZES else None


_SHAPE = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def shape_of(spec: Qwen3Spec) -> str:
    """A checkpoint's shape in words: parameters, layers, widths and heads."""
    return (f"{spec.num_params() / 1e6:,.1f} M params: {spec.num_layers} layers x hidden {spec.hidden_size}, "
            f"ffn {spec.intermediate_size}, {spec.num_heads}/{spec.num_kv_heads} heads x {spec.head_dim}, "
            f"vocab {spec.vocab_size}")


def same_shape(a: Qwen3Spec, b: Qwen3Spec) -> bool:
    """Equal layer shapes (the vocabulary aside: tiny presets take the tokenizer's, checkpoints may pad theirs)."""
    return all(getattr(a, f) == getattr(b, f) for f in _SHAPE)


def label(spec: Qwen3Spec, path: Optional[str] = None) -> str:
    """What a run calls a model: its size name when the shape is one of QWEN3_SIZES; else, for a checkpoint of another
    shape, its directory's name and parameter count."""
    for key, known in QWEN3_SIZES.items():
        if same_shape(spec, known):
            return key
    name = str(path).rstrip("/").rsplit("/", 1)[-1] if path else "custom"
    return f"{name} ({spec.num_params() / 1e6:,.1f}M)"


def get_spec(name: str, *, vocab_size: Optional[int] = None, **overrides) -> Qwen3Spec:
    """QWEN3_SIZES[name] (any spelling `size_key` reads), with vocab_size/other fields replaced."""
    key = size_key(name)
    if key is None:
        raise ValueError(f"model.size={name!r} is not known; choose one of {sorted(QWEN3_SIZES)}")
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return dataclasses.replace(QWEN3_SIZES[key], **overrides)


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    # transformers >= 5 writes rope_parameters={"rope_theta", "rope_type"}; 4.x writes rope_theta/rope_scaling.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for p in (params, scaling):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind != "default":
            raise ValueError(f"config.json rope type {kind!r} is not supported (only plain RoPE)")
    # transformers' own default when a config names no theta.
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def spec_from_hf(config: Mapping[str, Any]) -> Qwen3Spec:
    """Qwen3Spec from a Hugging Face Qwen3 config.json dict (ValueError for features kdexp does not model)."""
    mt = config.get("model_type")
    if mt != "qwen3":
        raise ValueError(f"config.json model_type={mt!r}: only 'qwen3' checkpoints are supported")
    if config.get("attention_bias", False):
        raise ValueError("config.json attention_bias=true is not supported (Qwen3 has no biases)")
    if config.get("use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=true is not supported")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r} is not supported (only 'silu')")
    heads = int(config["num_attention_heads"])
    return Qwen3Spec(
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_theta=_rope_theta(config),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 40960)),
    )


def spec_to_hf(spec: Qwen3Spec, *, dtype: str = "float32") -> dict:
    """config.json dict in the format of the real Qwen3 checkpoints (transformers 4.51+ and 5.x load it)."""
    theta = int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": spec.norm_eps,
        "rope_scaling": None,
        "rope_theta": theta,
        "sliding_window": None,
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec.vocab_size,
    }
