"""kdexp.data: embedded corpus, shared tokenizer, megatron indexed datasets and GPTDataset loading.

    bundle = prepare(cfg.data, seq_length=256, cache_dir=None, seed=1234, train_samples=4096, val_samples=64)
    for batch in batches(bundle.train_ds, micro_batch_size=8, dp_rank=r, dp_size=n, start_sample=consumed):
        batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]   # [b, s]

`tokenize_prompts(path, tokenizer, prompt_tokens)`: an on-policy run's rollout.prompts file as a [lines, p] tensor.

`cfg.data` is the schema's data node (kdexp.config.DataConfig holds the defaults). Caching helpers (cache_dir,
cached_path, atomic_dir, build_cached; kdexp.data.cache: sha256 manifests verified on use, one builder under a file
lock) are generic: the trainer stores the pretrained embedded teacher with them too.
"""

from kdexp.data.cache import atomic_dir, build_cached, cache_dir, cached_path
from kdexp.data.corpus import Document, embedded_corpus, embedded_documents
from kdexp.data.dataset import DataBundle, batches, prepare
from kdexp.data.prompts import tokenize_prompts
from kdexp.data.tokenizer import Tokenizer, train_bpe

__all__ = ["prepare", "batches", "DataBundle", "Tokenizer", "train_bpe", "embedded_documents",
           "embedded_corpus", "Document", "cache_dir", "cached_path", "atomic_dir", "build_cached", "tokenize_prompts"]
