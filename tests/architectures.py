"""Tiny random configs of the decoder architectures people fine-tune, built from each model's own config class.

Shared by tests/test_architectures.py and tests/compat_table.py (which renders docs/architectures.md's table).
Sliding-window models get a window of 6 positions, so prompts and generations run past it.
"""

from __future__ import annotations

import torch

WINDOW = 6
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def _cfg(name, **kw):
    import transformers

    return getattr(transformers, name)(**kw)


ARCHITECTURES = {
    # name: (config class, kwargs, note)
    "llama": ("LlamaConfig", dict(COMMON), ""),
    "mistral": ("MistralConfig", dict(COMMON, sliding_window=WINDOW), "sliding window on every layer"),
    "qwen2": ("Qwen2Config", dict(COMMON), ""),
    "qwen3": ("Qwen3Config", dict(COMMON, head_dim=16), ""),
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, decoder_sparse_step=1), "MoE (4 experts, top-2)"),
    "mixtral": ("MixtralConfig", dict(COMMON, num_local_experts=4, num_experts_per_tok=2), "MoE (4 experts, top-2)"),
    "gemma2": ("Gemma2Config", dict(COMMON, head_dim=16, sliding_window=WINDOW,
                                    layer_types=["sliding_attention", "full_attention"]),
               "alternating sliding / full layers, logit soft-capping"),
    "gemma3_text": ("Gemma3TextConfig", dict(COMMON, head_dim=16, sliding_window=WINDOW,
                                             layer_types=["sliding_attention", "full_attention"]),
                    "alternating sliding / full layers"),
    "phi3": ("Phi3Config", dict(COMMON), ""),
    "olmo2": ("Olmo2Config", dict(COMMON), ""),
    "smollm3": ("SmolLM3Config", dict(COMMON), ""),
    "gpt_oss": ("GptOssConfig", dict(COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
                "MoE + attention sinks + alternating sliding / full layers"),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256), "learned absolute positions"),
}


SDPA_UNSUPPORTED = {"gemma2", "gpt_oss"}  # transformers offers eager attention only for these


def build(arch: str, tokenizer, attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    """A random tiny model of ``arch`` with the mask token added (``config.mars`` set); sdpa falls back to eager
    where transformers has no sdpa path for the architecture. ``overrides``: config fields to change."""
    from transformers import AutoModelForCausalLM

    from hf_mars import add_mask_token

    name, kwargs, _ = ARCHITECTURES[arch]
    kwargs = {**kwargs, **overrides}
    torch.manual_seed(seed)
    config = _cfg(name, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False, **kwargs)
    if hasattr(config, "initializer_range"):
        config.initializer_range = 0.5  # peaked distributions: acceptance varies per row
    if attn_implementation == "sdpa" and arch in SDPA_UNSUPPORTED:
        attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    add_mask_token(model, tokenizer)
    return model
