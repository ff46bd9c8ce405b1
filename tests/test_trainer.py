"""MARSConfig / MARSDataCollator / MARSTrainer on tiny random Qwen2 models (no Hub)."""

import json
import math
import os
import random

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from hf_mars import MARSConfig, MARSDataCollator, MARSTrainer
from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]


def prompt_completion(n=12, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.sample(WORDS, 2)
        rows.append({"prompt": f"{a} {b} ->", "completion": f" {b} {a}"})
    return Dataset.from_list(rows)


def conversational(n=12, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.sample(WORDS, 2)
        rows.append({"messages": [{"role": "user", "content": f"swap {a} {b}"},
                                  {"role": "assistant", "content": f"{b} {a}"}]})
    return Dataset.from_list(rows)


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to=[], max_steps=2,
                logging_steps=1, save_strategy="no", learning_rate=1e-3, seed=0, dataloader_num_workers=0)
    base.update(kw)
    return MARSConfig(**base)


def make_trainer(tmp_path, dataset=None, seed=0, attn="sdpa", tokenizer=None, **kw):
    tok = tokenizer if tokenizer is not None else build_char_tokenizer()
    model = tiny_qwen2(tok, seed=seed, attn_implementation=attn)
    return MARSTrainer(model, args=config(tmp_path, **kw), train_dataset=dataset if dataset is not None
                       else prompt_completion(), processing_class=tok)


# ----------------------------------------------------------------------------- independent reference


def _ce_last(model, ids, target):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits[0, -1]
    return torch.nn.functional.cross_entropy(logits.float()[None], torch.tensor([target])).item()


def split_sequences(batch):
    """The sequences of a collated batch as (ids, labels) lists, from attention_mask or position ids."""
    seqs = []
    for r in range(batch["input_ids"].size(0)):
        ids, labels = batch["input_ids"][r].tolist(), batch["labels"][r].tolist()
        if "attention_mask" in batch:
            keep = [i for i, m in enumerate(batch["attention_mask"][r].tolist()) if m]
            seqs.append(([ids[i] for i in keep], [labels[i] for i in keep]))
        else:
            pos = batch["position_ids"][r].tolist()
            starts = [i for i, p in enumerate(pos) if i == 0 or p != pos[i - 1] + 1] + [len(pos)]
            seqs += [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:])]
    return seqs


def reference_loss(model, batch, block_size, mask_id, ar_weight, normalization):
    """One plain causal forward per target token and stream, straight from docs/method.md."""
    per_seq = []
    for ids, labels in split_sequences(batch):
        labels = [-100] + labels[1:]  # the first token of a sequence is never a target
        z = [mask_id if lab != -100 else tok for tok, lab in zip(ids, labels)]
        noisy, clean, count = 0.0, 0.0, 0
        for t in range(1, len(ids)):
            if labels[t] == -100:
                continue
            p = t - 1
            k0 = (p // block_size) * block_size
            noisy += _ce_last(model, ids[:k0] + z[k0:p + 1], labels[t])
            clean += _ce_last(model, ids[:t], labels[t])
            count += 1
        if count:
            per_seq.append((noisy, clean, count))
    if normalization == "sequence":
        return sum((nz + ar_weight * cl) / c for nz, cl, c in per_seq) / len(per_seq)
    return sum(nz + ar_weight * cl for nz, cl, _ in per_seq) / sum(c for *_, c in per_seq)


def test_the_lm_head_scores_only_positions_with_a_target(tmp_path, monkeypatch):
    """On a CPU, TRL's fused LM head would score every position of both streams; MARSTrainer has it score only the
    positions with a target (``_compat.fused_head_on_targets_only``): the same loss and gradients, fewer rows."""
    import contextlib

    import trl.trainer.utils as trl_utils

    import hf_mars.training.trainer as trainer_module

    trainer = make_trainer(tmp_path, block_size=4)
    batch = dict(next(iter(trainer.get_train_dataloader())))
    kernel, rows = trl_utils._ChunkedLogProbFunction, []

    class Recording(kernel):
        @staticmethod
        def forward(ctx, hidden, *args):
            rows.append(hidden.shape[0])
            return kernel.forward(ctx, hidden, *args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Recording)

    def loss_and_grads():
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        return loss.item(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    compact_loss, compact_grads = loss_and_grads()
    monkeypatch.setattr(trainer_module, "fused_head_on_targets_only", contextlib.nullcontext)
    full_loss, full_grads = loss_and_grads()
    b, n = batch["input_ids"].shape
    position_ids, _, _, labels = trainer._batch_layout(batch)
    targets = int((trainer_module.shift_labels_for_positions(labels, position_ids) != -100).sum())
    assert rows == [2 * targets, 2 * b * n] and 2 * targets < 2 * b * n
    assert math.isclose(compact_loss, full_loss, rel_tol=1e-6), (compact_loss, full_loss)
    assert len(compact_grads) == len(full_grads)
    for compact, full in zip(compact_grads, full_grads):
        torch.testing.assert_close(compact, full, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "block_size,ar_weight,normalization",
    [(1, 1.0, "sequence"), (3, 0.0, "sequence"), (4, 1.0, "sequence"), (4, 0.5, "token"), (2, 2.0, "token"),
     (8, 1.0, "token")],
)
def test_compute_loss_matches_per_token_reference(tmp_path, block_size, ar_weight, normalization):
    trainer = make_trainer(tmp_path, block_size=block_size, ar_weight=ar_weight, loss_normalization=normalization)
    batch = next(iter(trainer.get_train_dataloader()))
    # the collator padded every example to a block multiple with trained EOS
    eos = trainer.processing_class.eos_token_id
    for r, length in enumerate(batch["attention_mask"].sum(1).tolist()):
        assert length % block_size == 0
        assert batch["labels"][r, length - 1].item() == eos
    trainer.model.eval()
    loss = trainer.compute_loss(trainer.model, dict(batch)).item()
    ref = reference_loss(trainer.model, batch, block_size, trainer.mask_token_id, ar_weight, normalization)
    assert math.isclose(loss, ref, rel_tol=1e-4), (loss, ref)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_compute_loss_conversational_packed(tmp_path, attn):
    """Conversational + assistant-only loss, packed (padding-free rows, blocks from position ids)."""
    trainer = make_trainer(tmp_path, dataset=conversational(), attn=attn, block_size=3, assistant_only_loss=True,
                           packing=True, max_length=128, per_device_train_batch_size=2)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "position_ids" in batch and "attention_mask" not in batch
    assert len(split_sequences(batch)) > 2  # several sequences packed in a row
    trainer.model.eval()
    loss = trainer.compute_loss(trainer.model, dict(batch)).item()
    ref = reference_loss(trainer.model, batch, 3, trainer.mask_token_id, 1.0, "sequence")
    assert math.isclose(loss, ref, rel_tol=1e-4), (loss, ref)


def test_plain_text_dataset_and_mask_token_added(tmp_path):
    tok = build_char_tokenizer()
    assert tok.mask_token is None
    ds = Dataset.from_list([{"text": f"the {w} is here"} for w in WORDS])
    trainer = make_trainer(tmp_path, dataset=ds, tokenizer=tok, block_size=2, loss_normalization="token")
    assert tok.mask_token == "<|mask|>"
    assert trainer.model.config.mars == {"block_size": 2, "mask_token_id": tok.mask_token_id,
                                         "mask_token": "<|mask|>", "ar_weight": 1.0}
    assert trainer.model.get_input_embeddings().weight.shape[0] >= len(tok)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.eval()
    loss = trainer.compute_loss(trainer.model, dict(batch)).item()
    ref = reference_loss(trainer.model, batch, 2, trainer.mask_token_id, 1.0, "token")
    assert math.isclose(loss, ref, rel_tol=1e-4), (loss, ref)


def _dataset(kind):
    if kind == "prompt_completion":
        return prompt_completion()
    if kind == "conversational":
        return conversational()
    if kind == "text":
        return Dataset.from_list([{"text": f"the {w} is here"} for w in WORDS])
    tok = build_char_tokenizer()  # pre-tokenized: input_ids and labels as the user prepared them
    return Dataset.from_list([{"input_ids": tok(f"{a} {b}")["input_ids"], "labels": tok(f"{a} {b}")["input_ids"]}
                              for a, b in zip(WORDS, WORDS[1:])])


@pytest.mark.parametrize("kind", ["prompt_completion", "conversational", "text", "tokenized"])
def test_mask_token_set_up_before_sft_init(tmp_path, kind):
    """`_prepare_mars_model` (the one set-up hook, run before SFTTrainer.__init__) for every dataset format: the mask
    token is in the tokenizer and the embeddings, config.mars records it, and SFTTrainer's default collator became
    MARS's, built from what SFTTrainer chose (pad token, padding-free)."""
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok)
    rows = model.get_input_embeddings().weight.shape[0]
    calls = []
    original = MARSTrainer._prepare_mars_model

    def spy(self, model, processing_class, args, train_dataset, peft_config):
        calls.append(getattr(self, "_metrics", None))  # SFTTrainer.__init__ sets _metrics: it has not run yet
        return original(self, model, processing_class, args, train_dataset, peft_config)

    MARSTrainer._prepare_mars_model = spy
    try:
        trainer = MARSTrainer(model, args=config(tmp_path, block_size=3, assistant_only_loss=kind == "conversational"),
                              train_dataset=_dataset(kind), processing_class=tok)
    finally:
        MARSTrainer._prepare_mars_model = original
    assert calls == [None]
    assert tok.mask_token == "<|mask|>" and trainer.mask_token_id == tok.mask_token_id == len(tok) - 1
    assert trainer.model.config.mars == {"block_size": 3, "mask_token_id": tok.mask_token_id, "mask_token": "<|mask|>",
                                         "ar_weight": 1.0}
    assert rows <= trainer.model.get_input_embeddings().weight.shape[0] > tok.mask_token_id
    assert type(trainer.data_collator) is MARSDataCollator and trainer.data_collator.block_size == 3
    assert trainer.data_collator.pad_token_id == tok.pad_token_id and trainer.data_collator.eos_token_id == tok.eos_token_id
    batch = next(iter(trainer.get_train_dataloader()))
    assert tok.mask_token_id not in batch["input_ids"].tolist()  # the data never holds the mask: only the loss adds it
    trainer.model.eval()
    assert torch.isfinite(trainer.compute_loss(trainer.model, dict(batch)))


def test_model_given_by_path(tmp_path):
    """A model named by a path is loaded as SFTTrainer would (model_init_kwargs consumed), with its tokenizer."""
    tok = build_char_tokenizer()
    tiny_qwen2(tok).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    args = config(tmp_path, model_init_kwargs={"dtype": "float32", "attn_implementation": "eager"})
    trainer = MARSTrainer(str(tmp_path / "base"), args=args, train_dataset=prompt_completion())
    assert args.model_init_kwargs is None
    assert trainer.model.config._attn_implementation == "eager" and trainer.model.dtype == torch.float32
    assert trainer.processing_class.mask_token == "<|mask|>"
    assert trainer.model.config.mars["mask_token_id"] == trainer.processing_class.mask_token_id == trainer.mask_token_id
    assert type(trainer.data_collator) is MARSDataCollator


# ----------------------------------------------------------------------------- config and collator


def test_config_defaults_and_validation(tmp_path):
    args = MARSConfig(output_dir=str(tmp_path), report_to=[])
    assert (args.block_size, args.ar_weight, args.mask_token) == (4, 1.0, None)  # None: the tokenizer's mask, else <|mask|>
    assert args.loss_normalization == "sequence" and args.pad_to_block_multiple
    if not torch.cuda.is_available():  # no fast bf16 / no memory pressure on CPU
        assert args.bf16 is False and args.gradient_checkpointing is False
    from dataclasses import fields

    name = "activation_checkpointing" if "activation_checkpointing" in {f.name for f in fields(MARSConfig)} \
        else "gradient_checkpointing"  # transformers >= 5.24 renamed it
    assert MARSConfig(output_dir=str(tmp_path), report_to=[], bf16=False, **{name: True}).gradient_checkpointing is True
    with pytest.raises(ValueError, match="block_size"):
        MARSConfig(output_dir=str(tmp_path), block_size=0)
    with pytest.raises(ValueError, match="ar_weight"):
        MARSConfig(output_dir=str(tmp_path), ar_weight=-0.5)
    with pytest.raises(ValueError, match="loss_normalization"):
        MARSConfig(output_dir=str(tmp_path), loss_normalization="batch")


def test_collator_pads_each_packed_sequence_to_block_multiple():
    collator = MARSDataCollator(pad_token_id=0, padding_free=True, block_size=4, eos_token_id=2)
    batch = collator([{"input_ids": [5, 6, 7, 8, 9, 10, 11], "labels": [-100, 6, 7, 8, -100, 10, 11],
                       "seq_lengths": [3, 4]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 2, 8, 9, 10, 11]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch["labels"].tolist() == [[-100, 6, 7, 2, -100, -100, 10, 11]]  # TRL unlabels sequence starts
    padded = MARSDataCollator(pad_token_id=0, block_size=3, eos_token_id=2)(
        [{"input_ids": [5, 6], "labels": [-100, 6]}, {"input_ids": [5, 6, 7, 8]}])
    assert padded["input_ids"].tolist() == [[5, 6, 2, 0, 0, 0], [5, 6, 7, 8, 2, 2]]
    assert padded["labels"].tolist() == [[-100, 6, 2, -100, -100, -100], [5, 6, 7, 8, 2, 2]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    off = MARSDataCollator(pad_token_id=0, block_size=3, eos_token_id=2, pad_to_block_multiple=False)
    assert off([{"input_ids": [5, 6]}])["input_ids"].tolist() == [[5, 6]]


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_before_training(tmp_path):
    tok = build_char_tokenizer()
    ids = tok("hello there")["input_ids"]
    no_labels = Dataset.from_list([{"input_ids": ids, "labels": [-100] * len(ids)}] * 3)
    with pytest.raises(ValueError, match="no trainable token"):
        make_trainer(tmp_path, dataset=no_labels, max_length=None)
    with pytest.raises(ValueError, match="no trainable token"):
        make_trainer(tmp_path, dataset=no_labels)  # TRL drops fully-masked rows: nothing left

    with pytest.raises(ValueError, match="empty"):
        make_trainer(tmp_path, dataset=Dataset.from_list([{"text": "x"}]).select([]))

    tok_no_eos = build_char_tokenizer()
    tok_no_eos.eos_token = None
    assert tok_no_eos.eos_token is None
    with pytest.raises(ValueError, match="EOS"):
        make_trainer(tmp_path, tokenizer=tok_no_eos)


# ----------------------------------------------------------------------------- training behaviour


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("normalization", ["sequence", "token"])
def test_gradient_accumulation_matches_large_batch(tmp_path, normalization):
    """One SGD step: batch 4 == 2 micro-batches of 2 (the denominator spans the accumulated batch)."""
    kw = dict(max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", warmup_steps=0,
              loss_normalization=normalization, max_grad_norm=0.0)
    ds = prompt_completion(8, seed=1)
    big = make_trainer(tmp_path / "a", dataset=ds, per_device_train_batch_size=4, **kw)
    big.train()
    acc = make_trainer(tmp_path / "b", dataset=ds, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                       **kw)
    acc.train()
    init = _weights(tiny_qwen2(build_char_tokenizer(), seed=0))
    wa, wb = _weights(big.model), _weights(acc.model)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(wa[name], init[name])  # the step did something
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-4)


def test_training_lowers_loss_and_logs_mars_metrics(tmp_path):
    ds = conversational(16)
    trainer = make_trainer(tmp_path, dataset=ds, assistant_only_loss=True, max_steps=40, learning_rate=3e-3,
                           logging_steps=10, block_size=4)
    trainer.model.eval()
    before = trainer.evaluate(ds)
    trainer.train()
    after = trainer.evaluate(ds)
    assert after["eval_loss"] < 0.7 * before["eval_loss"], (before, after)
    for key in ["eval_mars_loss", "eval_ar_loss", "eval_mask_accuracy", "eval_mean_token_accuracy"] + \
            [f"eval_mask_accuracy_{j}" for j in range(1, 5)]:
        assert key in after, key
    assert math.isclose(after["eval_loss"], after["eval_mars_loss"] + after["eval_ar_loss"], rel_tol=1e-3)
    train_logs = [h for h in trainer.state.log_history if "loss" in h and "mars_loss" in h]
    assert train_logs and all(0 <= h["mask_accuracy_1"] <= 1 for h in train_logs)


def test_checkpoint_records_mars_metadata(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    trainer = make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, block_size=3, ar_weight=0.5)
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    meta = json.loads((ckpt / "config.json").read_text())["mars"]
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert meta == {"block_size": 3, "mask_token_id": tok.convert_tokens_to_ids("<|mask|>"),
                    "mask_token": "<|mask|>", "ar_weight": 0.5, "trained_steps": 2}
    assert AutoConfig.from_pretrained(ckpt).mars == meta
    model = AutoModelForCausalLM.from_pretrained(ckpt)  # still a plain Qwen2 checkpoint
    assert type(model).__name__ == "Qwen2ForCausalLM"
    trainer.save_model(str(tmp_path / "final"))
    assert json.loads((tmp_path / "final" / "config.json").read_text())["mars"] == meta
    # a Hub checkpoint holds no pickle: the weights are safetensors, the training arguments JSON
    final_files = {p.name for p in (tmp_path / "final").iterdir()}
    assert "model.safetensors" in final_files and "training_args.json" in final_files
    assert not [f for f in final_files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]


def test_resume_reproduces_uninterrupted_run(tmp_path):
    ds = prompt_completion(16, seed=2)
    kw = dict(max_steps=6, save_strategy="steps", save_steps=3, per_device_train_batch_size=2,
              gradient_accumulation_steps=2, learning_rate=1e-3)
    full = make_trainer(tmp_path / "full", dataset=ds, **kw)
    full.train()
    resumed = make_trainer(tmp_path / "resumed", dataset=ds, seed=1, **kw)  # different init: must be overwritten
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-3"))
    wa = load_file(os.path.join(tmp_path / "full" / "out" / "checkpoint-6", "model.safetensors"))
    wb = load_file(os.path.join(tmp_path / "resumed" / "out" / "checkpoint-6", "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-5)


def test_model_card_survives_push_card_step(tmp_path):
    """push_to_hub writes TRL's card after save_model; MARSTrainer puts the MARS card back before the upload."""
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model()
    out = tmp_path / "out"
    assert (out / "custom_generate" / "generate.py").is_file()
    trainer._mars_pushing = True  # what push_to_hub sets around Trainer.push_to_hub (which then uploads)
    trainer.create_model_card(model_name="tiny-mars", dataset_name="local/words")
    card = (out / "README.md").read_text()
    assert "MARS" in card and "<|mask|>" in card


@pytest.mark.parametrize("tied", [False, True])
def test_lora_trains_the_adapters_and_the_new_mask_row_where_it_can(tmp_path, tied):
    """With a peft LoRA config the adapters train. Untied embeddings: so does the mask token's new row (peft's
    ``trainable_token_indices``, set by the trainer), and no other row. Tied embeddings (peft would wrap the LM
    head, which TRL's fused loss cannot read): the row stays at its initial value, with one warning."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    tok = build_char_tokenizer()
    model = tiny_qwen2(tok, seed=0, tie_word_embeddings=tied)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    if tied:
        with pytest.warns(UserWarning, match="stays at its initial value"):
            trainer = MARSTrainer(model, args=config(tmp_path, learning_rate=5e-2), train_dataset=prompt_completion(),
                                  processing_class=tok, peft_config=lora)
    else:
        trainer = MARSTrainer(model, args=config(tmp_path, learning_rate=5e-2), train_dataset=prompt_completion(),
                              processing_class=tok, peft_config=lora)
    mask_id = trainer.mask_token_id
    assert lora.trainable_token_indices == (None if tied else {"embed_tokens": [mask_id]})
    initial_mask_row = trainer.model.get_input_embeddings().weight.detach()[mask_id].clone()
    trainer.train()
    merged = trainer.model.merge_and_unload()
    emb = merged.get_input_embeddings().weight.detach()
    old = before["model.embed_tokens.weight"]
    assert torch.equal(emb[:old.shape[0]], old) and mask_id == old.shape[0]  # a new row; the others untouched
    assert torch.equal(emb[mask_id], initial_mask_row) == tied  # the new row trained where it can
    after = dict(merged.named_parameters())
    q, up = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(after[q], before[q]) and torch.equal(after[up], before[up])
