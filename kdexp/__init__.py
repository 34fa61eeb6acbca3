"""kdexp: knowledge-distillation experiments for LLMs on megatron-core."""
