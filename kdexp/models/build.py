"""Qwen3Spec -> megatron-core GPTModel (local layer spec), and the logits entry points the trainer calls.

The local spec (no Transformer Engine / apex) gives torch.nn.RMSNorm for the layer norms and for Qwen3's per-head
q/k norms, ColumnParallelLinear for the fused QKV and the fused gate|up projection, RowParallelLinear for the
output and down projections and DotProductAttention with GQA. That is exactly Qwen3 (checked against transformers'
Qwen3ForCausalLM in tests/test_models.py). ``attention="sdpa"`` (model.attention, the default) swaps the core
attention for kdexp.models.attention.SDPAttention (torch's fused SDPA kernels, no [s, s] score tensor); "megatron"
keeps DotProductAttention.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from kdexp.config.qwen3 import Qwen3Spec


def _tp_size() -> int:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("call kdexp.distributed.initialize() before building a model")
    if ps.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError(f"parallel.pipeline={ps.get_pipeline_model_parallel_world_size()}: kdexp.models "
                         "supports pipeline_parallel=1 only")
    return ps.get_tensor_model_parallel_world_size()


def check_tp(spec: Qwen3Spec, tp: int) -> None:
    """ValueError unless tensor parallel size `tp` divides heads, kv heads, ffn and vocab."""
    for what, n in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads),
                    ("intermediate_size", spec.intermediate_size), ("vocab_size", spec.vocab_size)):
        if n % tp:
            raise ValueError(f"parallel.tensor={tp} must divide model.{what}={n}")


# trainer.recompute -> megatron's activation recompute settings. selective: the core attention (softmax(QK^T)V, the
# activation that grows with seq^2) is recomputed in the backward; full: each layer's input is the only activation
# kept and the whole layer runs again in the backward (uniform, one layer per checkpoint).
RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def transformer_config(spec: Qwen3Spec, *, params_dtype=torch.float32, tp: int = 1, init: bool = True,
                       recompute: str = "none", sequence_parallel: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype must be float32, bfloat16 or float16, got {params_dtype}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"trainer.recompute={recompute!r} is invalid: must be one of {', '.join(RECOMPUTE)}")
    if sequence_parallel and tp == 1:
        raise ValueError("parallel.sequence=True is invalid: needs parallel.tensor > 1")
    return TransformerConfig(
        **RECOMPUTE[recompute],
        sequence_parallel=sequence_parallel,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Why: with bf16/fp16 params megatron keeps the attention softmax in fp32 (as transformers does).
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        # A random init builds each full master weight on the CPU from torch's seeded CPU generator and keeps this
        # rank's slice (build() then moves the model to the GPU): the init is the same for every TP size and on a
        # CPU or a GPU machine, so the embedded teacher (whose cache key has no TP size) and a TP=2 student start
        # from the TP=1 weights. Megatron's GPU init would draw each shard in the model-parallel RNG fork on the
        # device, different per TP size. Without init (load_hf fills the weights) they are allocated on the device.
        use_cpu_initialization=init or not torch.cuda.is_available(),
        # load_hf overwrites every weight; skip the random init there.
        perform_initialization=init,
        # No CUDA graphs. megatron's default scope, "full", is deprecated and warns on every model built; the empty
        # list is the same setting in its current spelling.
        cuda_graph_scope=[],
    )


ATTENTION = ("sdpa", "megatron")  # model.attention


def layer_spec(attention: str = "sdpa"):
    """megatron's local GPT layer spec with Qwen3's q/k RMSNorm, its core attention per `attention`, every norm
    kdexp.models.norms.RMSNorm (torch's RMSNorm that megatron accepts under sequence parallelism)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from kdexp.models.norms import RMSNorm

    if attention not in ATTENTION:
        raise ValueError(f"model.attention={attention!r} is invalid: must be one of {', '.join(ATTENTION)}")
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
    attn = spec.submodules.self_attention.submodules
    attn.q_layernorm = attn.k_layernorm = RMSNorm
    if attention == "sdpa":
        from kdexp.models.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build(spec: Qwen3Spec, *, params_dtype=torch.float32, init: bool = True, recompute: str = "none",
          sequence_parallel: bool = False, attention: str = "sdpa"):
    """A megatron GPTModel with Qwen3's architecture, sharded for the current tensor-parallel size.

    kdexp.distributed.initialize() must have been called. `init=False` leaves weights unset (load_hf fills them).
    The spec is kept on the model as `model.kdexp_spec`. `recompute` (none | selective | full) and
    `sequence_parallel` go to megatron's TransformerConfig (see RECOMPUTE); `attention` (model.attention) picks the
    core attention (see layer_spec).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from kdexp.models.norms import RMSNorm, mark_tp_summed

    tp = _tp_size()
    check_tp(spec, tp)
    config = transformer_config(spec, params_dtype=params_dtype, tp=tp, init=init, recompute=recompute,
                                sequence_parallel=sequence_parallel)
    model = GPTModel(
        config=config,
        # the block spec names the final norm too (from a layer spec megatron would pick WrappedTorchNorm)
        transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[layer_spec(attention)] * spec.num_layers,
                                                          layer_norm=RMSNorm),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
    )
    if not init:
        _mark_tp_attributes(model)
    mark_tp_summed(model, tp, sequence_parallel)
    if params_dtype != torch.float32:
        # Why: megatron leaves the torch RMSNorm weights in fp32; its training wraps the model in Float16Module,
        # which casts every parameter. The same here, so a bf16 build, a cast teacher and the megatron path agree.
        model.to(params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    model.kdexp_spec = spec
    model.kdexp_attention = attention
    return model


def cast(model, dtype):
    """Cast a built model in place to `dtype` (bf16 teacher of a trainer.precision=bf16 run), megatron's precision
    flags included: its attention softmax keeps fp32 for bf16/fp16 inputs only when the config and the softmax
    module (built with the flags at init) say so. The rotary inverse frequencies are a plain attribute, not a
    buffer, so they stay fp32 as in a model built in bf16."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    model.to(dtype)
    half = {"bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16}
    for mod in model.modules():
        config = getattr(mod, "config", None)
        if config is not None and hasattr(config, "params_dtype"):
            config.params_dtype, config.bf16, config.fp16 = dtype, half["bf16"], half["fp16"]
        if isinstance(mod, FusedScaleMaskSoftmax):
            mod.input_in_bf16, mod.input_in_fp16 = half["bf16"], half["fp16"]
            mod.input_in_float16 = half["bf16"] or half["fp16"]
    return model


def _mark_tp_attributes(model) -> None:
    """Set megatron's TP attributes (tensor_model_parallel, partition_dim, partition_stride) on the weights.

    Why: megatron sets them inside its weight initializers, which perform_initialization=False skips; grad-norm
    clipping, the distributed optimizer and save_hf's gather all read them.
    """
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding, set_tensor_model_parallel_attributes)

    for name, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(mod, RowParallelLinear):
            dim = 1
        else:
            continue
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.nn.Parameter) and not hasattr(w, "tensor_model_parallel"):
            # linear_fc1 holds [gate | up] per rank: megatron's stride 2 (see MLP.__init__).
            set_tensor_model_parallel_attributes(w, True, dim, 2 if name.endswith("linear_fc1") else 1)


@functools.lru_cache(maxsize=8)
def _causal_mask(seq: int, device: torch.device) -> torch.Tensor:
    # megatron's convention: True = masked (may not attend). [1, 1, s, s] broadcasts over batch and heads.
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)


def vocab_parallel_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V/tp]: this TP rank's contiguous vocabulary shard (rank r holds [r*V/tp, (r+1)*V/tp)).

    Causal attention over the whole row (no document masking), positions 0..s-1. The unfused attention reads an
    explicit [s, s] mask; SDPA's causal kernel needs none (no s^2 bytes anywhere).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    sdpa = getattr(_unwrap(model), "kdexp_attention", "megatron") == "sdpa"
    mask = None if sdpa else _causal_mask(input_ids.shape[1], input_ids.device)
    return model(input_ids, _positions(input_ids), mask)


def forward_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [b, s, V] (all-gathered over the tensor-parallel group; differentiable)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    logits = vocab_parallel_logits(model, input_ids)
    if ps.get_tensor_model_parallel_world_size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits.contiguous())


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module  # DDP / Float16Module wrappers
    return model


def _decoder_layers(model):
    return _unwrap(model).decoder.layers


def _keep_hidden(store: dict, index: int, gather: bool, module, args, output) -> None:
    # A megatron TransformerLayer returns (hidden_states, context); hidden_states is [s, b, h] ([s/t, b, h] under
    # sequence parallelism: gathered here, its backward handing each rank the gradient of its own slice).
    hidden = output[0] if isinstance(output, tuple) else output
    if gather:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # the loss on the gathered states is the same on every TP rank (replicated), so the backward only splits
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    store[index] = hidden


@contextlib.contextmanager
def capture_hidden(model, layers):
    """Within the block, forwards of `model` record the output of each decoder layer in `layers` (0-based; the
    layer's output before the final norm, megatron's [s, b, h] layout) in the dict this yields: {index: tensor}.

    The hidden states are whole and replicated over the tensor-parallel ranks: each layer ends in a RowParallelLinear
    all-reduce, and under sequence parallelism (its reduce-scatter leaves [s/t, b, h] per rank) they are all-gathered
    here, differentiably.
    """
    store: dict = {}
    layers = sorted(set(layers))
    if not layers:
        yield store
        return
    decoder = _decoder_layers(model)
    gather = bool(getattr(decoder[0].config, "sequence_parallel", False))
    handles = [decoder[i].register_forward_hook(functools.partial(_keep_hidden, store, i, gather)) for i in layers]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def _gpt(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module  # DDP / Float16Module wrappers
    return model


def sequence_parallel(model) -> bool:
    """Whether the model's hidden states are sharded over the sequence (megatron's sequence parallelism)."""
    return bool(getattr(_gpt(model).config, "sequence_parallel", False))


def output_weight(model) -> torch.Tensor:
    """The output layer's weight [V/tp, H]: the word embedding when tied (Qwen3-0.6B), else output_layer.weight."""
    m = _gpt(model)
    return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight


def final_hidden(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, weight): the final hidden states [s, b, h] (after the final norm, before the output layer;
    [s/tp, b, h] under sequence parallelism) and the output weight, for a caller that forms the logits itself
    (kdexp.losses.head). The model runs through its wrappers as for vocab_parallel_logits; only GPTModel's
    post-processing (the output layer) is switched off for this call, as megatron does for a pipeline stage
    without post_process."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    m = _gpt(model)
    if m.config.mtp_num_layers:
        raise ValueError("final_hidden: multi-token prediction layers are not supported")
    m.post_process = False
    try:
        hidden = model(input_ids, _positions(input_ids), _causal_mask(input_ids.shape[1], input_ids.device))
    finally:
        m.post_process = True
    return hidden, output_weight(model)
