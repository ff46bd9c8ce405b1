import pytest
import torch

from hf_mars import add_mask_token, get_mars_metadata
from hf_mars.testing_utils import tiny_qwen2


def test_add_mask_token_adds_resizes_and_records(tokenizer):
    model = tiny_qwen2(tokenizer)
    rows = model.get_input_embeddings().weight.shape[0]
    mean = model.get_input_embeddings().weight.mean(0).clone()
    mid = add_mask_token(model, tokenizer)
    assert tokenizer.mask_token == "<|mask|>" and tokenizer.mask_token_id == mid
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == rows + 1 == mid + 1
    torch.testing.assert_close(emb[mid], mean)
    assert get_mars_metadata(model.config)["mask_token_id"] == mid
    # tokenizer round trip: the mask is one token
    assert tokenizer("a<|mask|>b")["input_ids"] == [tokenizer.convert_tokens_to_ids("a"), mid, tokenizer.convert_tokens_to_ids("b")]


def test_add_mask_token_idempotent(tokenizer):
    model = tiny_qwen2(tokenizer)
    mid = add_mask_token(model, tokenizer)
    weight = model.get_input_embeddings().weight.clone()
    assert add_mask_token(model, tokenizer) == mid
    assert len(tokenizer) == mid + 1
    torch.testing.assert_close(model.get_input_embeddings().weight, weight)


def test_add_mask_token_no_resize_when_rows_spare(tokenizer):
    from transformers import Qwen2ForCausalLM

    from hf_mars.testing_utils import tiny_qwen2_config

    model = Qwen2ForCausalLM(tiny_qwen2_config(128))  # padded embedding matrix, as real checkpoints have
    mid = add_mask_token(model, tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == 128
    assert mid < 128


def test_add_mask_token_keeps_pad_multiple(tokenizer):
    from transformers import Qwen2ForCausalLM

    from hf_mars.testing_utils import tiny_qwen2_config

    for _ in range(64 - len(tokenizer) % 64):
        tokenizer.add_special_tokens({"additional_special_tokens": [f"<|x{_}|>"]}, replace_extra_special_tokens=False)
    assert len(tokenizer) % 64 == 0
    model = Qwen2ForCausalLM(tiny_qwen2_config(len(tokenizer)))
    add_mask_token(model, tokenizer)
    assert model.get_input_embeddings().weight.shape[0] % 64 == 0


def test_add_mask_token_reuses_existing_special(mars_tokenizer):
    model = tiny_qwen2(mars_tokenizer)
    n = len(mars_tokenizer)
    mid = add_mask_token(model, mars_tokenizer)
    assert mid == mars_tokenizer.mask_token_id and len(mars_tokenizer) == n


def test_add_mask_token_refuses_ordinary_token(tokenizer):
    model = tiny_qwen2(tokenizer)
    with pytest.raises(ValueError, match="ordinary token"):
        add_mask_token(model, tokenizer, mask_token="a")
    with pytest.raises(ValueError, match="non-empty"):
        add_mask_token(model, tokenizer, mask_token="")


# ----------------------------------------------------------------------------- mask-token safety


@pytest.mark.parametrize("token,role", [
    ("<|im_end|>", "EOS token"),
    ("<|endoftext|>", "padding token"),
    ("<|im_start|>", "special token"),
    ("a", "ordinary token"),
    ("cat", "does not look like a special token"),
    ("hello world", "does not look like a special token"),
    ("<|user|>", "chat template"),
])
def test_mask_token_already_in_use_is_refused_with_its_role(tokenizer, token, role):
    tokenizer.chat_template = tokenizer.chat_template.replace("'<|im_start|>' + message['role']",
                                                              "'<|im_start|>' + '<|user|>' + message['role']")
    model = tiny_qwen2(tokenizer)
    n = len(tokenizer)
    with pytest.raises(ValueError, match=role):
        add_mask_token(model, tokenizer, mask_token=token)
    assert len(tokenizer) == n and tokenizer.mask_token is None  # nothing changed


def test_bos_token_refused(tokenizer):
    tokenizer.add_special_tokens({"bos_token": "<|begin|>"})
    with pytest.raises(ValueError, match="BOS token"):
        add_mask_token(tiny_qwen2(tokenizer), tokenizer, mask_token="<|begin|>")


def test_registered_mask_token_is_reused_by_default(tokenizer):
    """Gemma-style: the tokenizer already registers a mask token; MARS reuses it instead of adding one."""
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    model = tiny_qwen2(tokenizer)
    n = len(tokenizer)
    mid = add_mask_token(model, tokenizer)
    assert tokenizer.mask_token == "<mask>" and mid == tokenizer.convert_tokens_to_ids("<mask>") and len(tokenizer) == n
    assert get_mars_metadata(model.config)["mask_token"] == "<mask>"


# ----------------------------------------------------------------------------- tokenizers shaped like the real ones


def _bpe_tokenizer(pad=True, with_bos=False):
    """A byte-level BPE with merges (GPT-2 / Llama-3 / Qwen2 style), built locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<|begin_of_text|>"] if with_bos else [])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50 + ["copy abc abc", "hello moon"] * 50,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>" if pad else None,
                                   bos_token="<|begin_of_text|>" if with_bos else None,
                                   additional_special_tokens=["<|im_start|>"])
    from hf_mars.testing_utils import CHAT_TEMPLATE

    fast.chat_template = CHAT_TEMPLATE
    return fast


def _sentencepiece_like():
    """A Unigram model with a Metaspace pre-tokenizer (Llama-2 / Gemma / T5 style), built locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=["<pad>", "</s>", "<s>", "<unk>"],
                                      unk_token="<unk>")
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "copy abc abc", "hello moon"] * 50,
                            trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("kind", ["bpe-padded-rows", "bpe-tied", "bpe-no-pad", "sentencepiece"])
def test_real_shaped_tokenizers_train_and_decode(kind, tmp_path):
    """add_mask_token + a few MARSTrainer steps + MARS decoding on tokenizers shaped like the real ones."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_mars import MARSConfig, MARSTrainer, enable_mars

    tok = _sentencepiece_like() if kind == "sentencepiece" else _bpe_tokenizer(pad=kind != "bpe-no-pad",
                                                                              with_bos=kind == "bpe-no-pad")
    rows = len(tok) + (37 if kind == "bpe-padded-rows" else 0)  # Qwen2.5-style spare rows: no resize needed
    config = LlamaConfig(vocab_size=rows, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=kind == "bpe-tied",
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    mid = add_mask_token(model, tok)
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == (rows if kind == "bpe-padded-rows" else max(rows, mid + 1))
    if kind == "bpe-tied":
        assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    if tok.pad_token is None:  # Llama-3 style: TRL pads with EOS
        tok.pad_token = tok.eos_token
    before = emb[mid].detach().clone()
    data = Dataset.from_list([{"prompt": "copy abc ->", "completion": " abc abc"},
                              {"prompt": "the quick brown", "completion": " fox jumps"}] * 4)
    args = MARSConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                      report_to=[], save_strategy="no", dataloader_num_workers=0, logging_steps=1)
    trainer = MARSTrainer(model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    assert not torch.equal(model.get_input_embeddings().weight[mid].detach(), before)  # the mask row was trained
    enable_mars(model.eval())
    enc = tok(["copy abc ->", "the quick"], return_tensors="pt", padding=True, padding_side="left")
    plain = model.generate(**enc, max_new_tokens=8, do_sample=False)
    same = model.generate(**enc, max_new_tokens=8, do_sample=False, mars_verify=True)
    assert torch.equal(plain, same)
    assert (plain[:, enc.input_ids.shape[1]:] != mid).all()
