"""Tiny Llama-family models (grouped-query attention, RoPE) with seeded random weights, for tests.

The real Llama-family model of the course is SmolLM2-135M-Instruct (kvcourse/models/smollm2.py, loaded
offline after `./course setup`); these share its architecture at a size that runs in milliseconds.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    """2 layers, 4 query heads sharing 2 KV heads of 16, RoPE theta 1e5; a large init scale makes attention sharp."""
    fields = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=1e5,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaConfig(**{**fields, **overrides})


def random_llama(config: LlamaConfig | None = None, seed: int = 0) -> LlamaForCausalLM:
    """The architecture in `config` (tiny_llama_config() by default) with weights from a seeded generator."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config or tiny_llama_config())
    model.is_pretrained = False
    return model.eval()


__all__ = ["random_llama", "tiny_llama_config"]
