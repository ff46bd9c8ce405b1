"""Test fixtures (as transformers' ``testing_utils``): a tokenizer and tiny Qwen2-architecture models built locally.

Nothing here touches the network, so tests, examples and CI run offline. The
tokenizer is character-level over printable ASCII plus ChatML specials: the
bundled tasks are short, and characters keep the vocabulary (and the model)
tiny while making many tokens predictable — the regime where MARS shines.
"""

from __future__ import annotations

import string

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode map (what a ByteLevel pre-tokenizer emits: ' ' -> 'Ġ', '\\n' -> 'Ċ')."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_char_tokenizer(extra_chars: str = ""):
    """A character-level `PreTrainedTokenizerFast` with a ChatML chat template.

    pad = ``<|endoftext|>``, eos = ``<|im_end|>`` (the end of an assistant turn), no bos.
    No mask token: `hf_mars.add_mask_token` adds it, as it would to a real model.

    It is written as a byte-level BPE without merges (one token per ASCII character) because
    transformers reloads the tokenizer of a ``qwen2`` checkpoint as ``Qwen2Tokenizer``, whose
    byte-level pre-tokenizer would drop the spaces of a plain character vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_unicode = _bytes_to_unicode()
    chars = sorted(set(string.printable) - set("\x0b\x0c\r") | set(extra_chars))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab["<unk>"] = len(vocab)
    for ch in chars:
        for byte in ch.encode("utf-8"):
            vocab.setdefault(byte_to_unicode[byte], len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        bos_token=None,
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_qwen2_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int | None = None, max_position: int = 1024,
                      attn_implementation: str = "sdpa", **kwargs):
    """A small `Qwen2Config` (random init), the architecture of the paper's base models."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position,
        **{"tie_word_embeddings": True, **kwargs},
    )
    config._attn_implementation = attn_implementation
    return config


def tiny_qwen2(tokenizer, seed: int = 0, attn_implementation: str = "sdpa", **config_kwargs):
    """A randomly initialised tiny Qwen2ForCausalLM whose vocabulary matches ``tokenizer``."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = tiny_qwen2_config(len(tokenizer), attn_implementation=attn_implementation, **config_kwargs)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.eval()


def save_tiny_vllm_checkpoint(path, block_size: int = 4):
    """A tiny random Qwen2 MARS checkpoint saved at ``path`` (config.mars with the mask id and block size), shaped
    for vLLM: head_dim 32, which vLLM's CPU attention supports (it has no 16). Returns ``path``."""
    from .training.tokens import add_mask_token

    tok = build_char_tokenizer()
    model = tiny_qwen2(tok, seed=0, max_position=256, num_heads=2, num_kv_heads=1)
    add_mask_token(model, tok)
    model.config.mars = {**model.config.mars, "block_size": block_size, "mask_token": "<|mask|>"}
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
