"""MARS training on TRL: `MARSTrainer` (an `SFTTrainer`), with `MARSConfig` (an `SFTConfig`, in config.py) and
`MARSDataCollator` (collator.py), both importable from here too.

The trainer keeps everything SFTTrainer does (dataset formats, completion-only / assistant-only loss,
packing, padding-free, PEFT, accelerate launchers) and replaces the loss by the MARS objective
(docs/method.md, section 1): one forward over ``[z ; x]`` with the four-rule attention mask, AR-aligned
targets, ``L = noisy CE + ar_weight * clean CE`` under "sequence" or "token" normalisation.
"""

from __future__ import annotations

import os

import warnings

import torch
from transformers import PreTrainedTokenizerBase, ProcessorMixin
from trl import SFTTrainer

from .._compat import (
    attn_implementation,
    fused_head_on_targets_only,
    trl_count_train_tokens,
    trl_lm_collator,
    trl_load_model,
    trl_metrics,
    trl_processing_class,
)
from .collator import MARSDataCollator
from .config import MARSConfig, checkpointing_argument  # noqa: F401  (both importable from here, as before)
from .masking import (
    build_model_mars_mask,
    build_noisy_input_ids,
    model_attention_layout,
    positions_from_attention_mask,
    sequence_ids_from_positions,
    shift_labels_for_positions,
)
from .loss import RouterLogits, normalised_sums
from .tokens import add_mask_token, set_mars_metadata

__all__ = ["MARSConfig", "MARSDataCollator", "MARSTrainer"]


def _has_trainable_token(dataset) -> bool:
    """True when some example has a trained label after its first token (position 0 is never a target)."""
    from datasets import IterableDataset

    def trainable(example):
        labels = example["labels"] if "labels" in example else example["input_ids"]
        return any(label != -100 for label in list(labels)[1:])

    if isinstance(dataset, IterableDataset):
        for i, example in enumerate(dataset):
            if trainable(example):
                return True
            if i >= 1000:  # an iterable dataset is not scanned in full; assume the rest is like its start
                return True
        return False
    key = "labels" if "labels" in (dataset.column_names or []) else "input_ids"
    for batch in dataset.select_columns([key]).iter(batch_size=1000):
        if any(trainable({key: labels}) for labels in batch[key]):
            return True
    return False


def _as_mars_config(model, args) -> MARSConfig:
    """``args`` as a MARSConfig: a default one named after the model, or any TrainingArguments converted."""
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model") or "model"
        return MARSConfig(f"{str(name).rstrip('/').split('/')[-1]}-MARS")
    if not isinstance(args, MARSConfig):
        dict_args = args.to_dict()
        dict_args["hub_token"] = args.hub_token  # to_dict hides it
        return MARSConfig(**dict_args)
    return args


def _tokenizer_of(processing_class):
    if isinstance(processing_class, ProcessorMixin):
        return processing_class.tokenizer
    if isinstance(processing_class, PreTrainedTokenizerBase):
        return processing_class
    raise TypeError("processing_class must be a PreTrainedTokenizerBase or a ProcessorMixin.")


def _train_new_token_with_peft(peft_config, token_id: int, model) -> None:
    """A LoRA adapter would otherwise leave the new mask embedding frozen at its initial value.

    Not with tied input/output embeddings: peft then wraps the LM head too, and TRL's fused LM-head loss (which
    MARSTrainer and SFTTrainer use) reads ``lm_head.bias``, which peft's wrapper does not carry, so the first step
    would fail. There the row stays at its initial value, the mean embedding (``add_mask_token``): a vector no
    other token has, which the adapted layers learn to read (one warning says so)."""
    if not hasattr(peft_config, "trainable_token_indices"):
        return
    if model.get_output_embeddings() is not None and \
            model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        warnings.warn("MARSTrainer with a peft adapter: the new mask token's embedding row stays at its initial "
                      "value (the mean embedding) - with tied input/output embeddings, peft's trainable tokens "
                      "cannot be combined with TRL's fused LM-head loss. The adapted layers learn to read it. To "
                      "train the row, add modules_to_save=['embed_tokens'] to the LoraConfig, or use a tokenizer "
                      "that already has a mask token.", stacklevel=3)
        return
    indices = peft_config.trainable_token_indices
    if indices is None:
        peft_config.trainable_token_indices = {"embed_tokens": [token_id]}
    elif isinstance(indices, dict):
        indices.setdefault("embed_tokens", [])
        if token_id not in indices["embed_tokens"]:
            indices["embed_tokens"].append(token_id)


def _check_architecture(model, args: MARSConfig) -> None:
    """Refuse, before any step, a model or attention backend the MARS rule cannot be expressed in."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"MARS trains decoder-only causal LMs; {model.config.model_type!r} is encoder-decoder.")
    model_attention_layout(model.config)  # refuses layer types the MARS rule cannot express
    attn = attn_implementation(model.config)
    if "flash" in attn or attn == "paged_attention":
        raise ValueError(
            f"attn_implementation={attn!r} cannot express the MARS attention rule (a 2n x 2n mask). Load the "
            "model with attn_implementation='sdpa' (default), 'eager' or 'flex_attention'."
        )
    if attn == "flex_attention" and args.device.type == "cpu":
        raise ValueError(
            f"flex_attention has no backward pass on CPU (torch {torch.__version__}), so it cannot train here. "
            "Use attn_implementation='sdpa' on CPU; flex_attention (BlockMask, skips masked tiles) on GPU."
        )


def _mars_collator(base, args: MARSConfig, tokenizer) -> MARSDataCollator:
    """SFTTrainer's default collator, as built (padding-free, position ids, ...), plus the block-multiple padding."""
    return MARSDataCollator(
        pad_token_id=base.pad_token_id, padding_free=base.padding_free,
        return_position_ids=base.return_position_ids, pad_to_multiple_of=base.pad_to_multiple_of,
        return_tensors=base.return_tensors, block_size=args.block_size, eos_token_id=tokenizer.eos_token_id,
        pad_to_block_multiple=args.pad_to_block_multiple,
    )


class MARSTrainer(SFTTrainer):
    """`SFTTrainer` that trains with the MARS objective (noisy mask stream + clean AR stream).

    Accepts what SFTTrainer accepts (``model`` as a name/path or a model, conversational, prompt-completion or
    plain-text datasets, packing, padding-free, PEFT). Adds the mask token itself when the tokenizer lacks it and
    records ``config.mars = {block_size, mask_token_id, mask_token, ar_weight}``, which every saved checkpoint
    carries in its config.json. Logs ``mars_loss`` (noisy stream) and ``ar_loss`` (clean stream) separately, and
    ``mask_accuracy`` plus ``mask_accuracy_{j}`` for j = 1..B (prefixed ``eval_`` at evaluation).
    """

    _tag_names = ["trl", "sft", "mars"]
    _name = "MARS"

    def __init__(self, model, args: MARSConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, peft_config=None, **kwargs):
        args = _as_mars_config(model, args)
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("MARSTrainer computes the MARS objective itself; compute_loss_func is not supported.")
        revision = None
        if isinstance(model, str):  # the mask token needs the model itself (see `_prepare_mars_model`)
            model, revision = trl_load_model(model, args, kwargs.pop("quantization_config", None))
        if processing_class is None:
            processing_class = trl_processing_class(model, args, revision)
        self._prepare_mars_model(model, processing_class, args, train_dataset, peft_config)
        super().__init__(model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                         **kwargs)
        if data_collator is None and type(self.data_collator) is trl_lm_collator():
            self.data_collator = _mars_collator(self.data_collator, args, _tokenizer_of(processing_class))
        if not _has_trainable_token(self.train_dataset):
            raise ValueError(
                "The training dataset has no trainable token (every label is -100 after preparation), so the MARS "
                "loss would be empty. Check completion_only_loss / assistant_only_loss (an assistant-only loss needs "
                "a chat template with {% generation %} markers), or that examples are not truncated away by "
                "max_length."
            )
        # summed metric counters per mode, turned into ratios at log time
        self._mars_sums: dict[str, torch.Tensor | None] = {"train": None, "eval": None}

    def _prepare_mars_model(self, model, processing_class, args: MARSConfig, train_dataset, peft_config) -> None:
        """The MARS set-up of the model and tokenizer, run before `SFTTrainer.__init__` sees either.

        Adds the mask token (tokenizer entry and embedding row), records ``config.mars``, makes a PEFT adapter train
        the new row, and refuses what MARS cannot train before any data is prepared. It must run before
        SFTTrainer.__init__: that method wraps the model in PEFT right after loading it, with no overridable method
        in between (the first it calls, ``_prepare_dataset``, comes after the wrap), so this is the one hook.
        """
        tokenizer = _tokenizer_of(processing_class)
        if (args.eos_token or tokenizer.eos_token) is None:
            raise ValueError(
                "MARS needs an EOS token (examples are padded with trained EOS up to a multiple of block_size, and "
                "text datasets get EOS appended), but the tokenizer has none. Set `tokenizer.eos_token` (e.g. to "
                "the end-of-turn token of your chat template) or pass `MARSConfig(eos_token=...)`."
            )
        if train_dataset is not None:
            sample = next(iter(train_dataset), None)
            if sample is None:
                raise ValueError("The training dataset is empty: MARS needs examples with trainable tokens.")
            if "image" in sample or "images" in sample:
                raise ValueError("MARSTrainer supports text datasets only (no image/images columns).")
        vocab_before = len(tokenizer)
        self.mask_token_id = add_mask_token(model, tokenizer, args.mask_token)
        if peft_config is not None and len(tokenizer) > vocab_before:
            _train_new_token_with_peft(peft_config, self.mask_token_id, model)
        set_mars_metadata(model.config, block_size=int(args.block_size), mask_token_id=int(self.mask_token_id),
                          mask_token=tokenizer.convert_ids_to_tokens(self.mask_token_id), ar_weight=float(args.ar_weight))
        _check_architecture(model, args)

    # ------------------------------------------------------------------ loss

    def _batch_layout(self, inputs):
        """Positions, padding mask, per-row sequence ids and effective labels of a collated batch."""
        input_ids, labels = inputs["input_ids"], inputs["labels"]
        attention_mask = inputs.get("attention_mask")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("MARSTrainer builds its own 4D attention mask; the batch must carry a 2D attention_mask.")
        position_ids = inputs.get("position_ids")
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_attention_mask(attention_mask)
            else:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
        position_ids = position_ids.expand_as(input_ids)
        valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        seq = sequence_ids_from_positions(position_ids)
        is_start = torch.ones_like(valid)
        is_start[:, 1:] = seq[:, 1:] != seq[:, :-1]
        # a sequence's first token is never a target, so it is context in both streams (as at inference)
        labels = labels.masked_fill(is_start | ~valid, -100)
        return position_ids, valid, seq, labels

    def _count_items(self, inputs) -> int:
        """Local denominator of the chosen normalisation: target tokens ("token") or sequences with one ("sequence")."""
        _, _, seq, labels = self._batch_layout(inputs)
        targets = torch.zeros_like(labels, dtype=torch.bool)
        targets[:, :-1] = (labels[:, 1:] != -100) & (seq[:, 1:] == seq[:, :-1])
        if self.args.loss_normalization == "token":
            return int(targets.sum())
        gseq = seq + torch.arange(seq.size(0), device=seq.device)[:, None] * seq.size(1)
        return torch.unique(gseq[targets]).numel()

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """What the chosen normalisation divides by, over the whole accumulated (and all-process) batch.

        Counted exactly as `compute_loss` counts (targets after the AR shift, sequence starts excluded), wherever
        Trainer would pass a count at all (it then stops dividing the loss by the accumulation steps itself).
        """
        # Trainer's own condition for counting (without its extra all-process gather)
        if not (batch_samples and "labels" in batch_samples[0]
                and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
            return None
        count = torch.tensor(sum(self._count_items(b) for b in batch_samples), device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return count / (self.get_tp_size() * self.get_cp_size() * self.get_sp_size())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The MARS loss of one collated batch (see the module docstring and docs/method.md, section 1)."""
        mode = "train" if self.model.training else "eval"
        args = self.args
        input_ids = inputs["input_ids"]
        n = input_ids.shape[1]
        position_ids, valid, seq, labels = self._batch_layout(inputs)
        targets = shift_labels_for_positions(labels, position_ids)  # target of the output at p
        unwrapped = self.accelerator.unwrap_model(model)
        outputs, router = self._mars_forward(model, unwrapped, input_ids, labels, position_ids, valid, targets)
        nll = -outputs.log_probs.float()  # zero where the target is ignored
        noisy_num, clean_num, local_den = normalised_sums(nll[:, :n], nll[:, n:], targets != -100, seq,
                                                          args.loss_normalization)
        den = local_den.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = (noisy_num + args.ar_weight * clean_num) / den
        if router is not None and router.logits:
            # MoE load balancing, exactly as the model's forward computes it for an SFT batch, over the clean stream
            # only: that stream is the ordinary SFT input (so clean CE + aux is the model's own MoE SFT loss), while
            # the noisy stream is mostly one token, the mask, whose routing would dominate the balance statistics
            aux = router.clean_stream_loss(unwrapped, n, valid)
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
            trl_metrics(self, mode)["aux_loss"].append(float(aux.detach()))
        if model.training and not bool(torch.isfinite(loss)):  # stop before the optimizer spreads NaN to every weight
            raise self._not_finite(noisy_num, clean_num)
        # like Trainer/SFTTrainer: the denominator counts every rank, and DDP averages the gradients across ranks
        if args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())

        self._record_metrics(mode, inputs, outputs, position_ids, labels, targets, noisy_num, clean_num, local_den,
                             valid)

        if return_outputs:
            with torch.no_grad():  # plain AR logits for compute_metrics / preprocess_logits_for_metrics
                plain = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
                if inputs.get("attention_mask") is not None:
                    plain["attention_mask"] = inputs["attention_mask"]
                outputs = model(**plain)
            return loss, outputs
        return loss

    def _mars_forward(self, model, unwrapped, input_ids, labels, position_ids, valid, targets):
        """One forward over ``[z ; x]`` under the MARS mask, returning per-token log-probabilities of the targets
        (and the router-logit recorder of a MoE model whose aux loss is on, else None)."""
        noisy_ids = build_noisy_input_ids(input_ids, labels, self.mask_token_id)
        attn = attn_implementation(unwrapped.config)
        emb_dtype = unwrapped.get_input_embeddings().weight.dtype
        # one mask per attention layer type: sliding-window layers see the same rule inside their window
        mask = build_model_mars_mask(unwrapped.config, position_ids, self.args.block_size, valid, attn, emb_dtype)
        moe_aux = getattr(self, "aux_loss_enabled", False)  # SFTTrainer: MoE config with a router aux coefficient
        router = RouterLogits(unwrapped) if moe_aux else None
        try:
            with fused_head_on_targets_only():  # (the prompt's positions have no target)
                outputs = model(
                    input_ids=torch.cat([noisy_ids, input_ids], dim=1),
                    attention_mask=mask,
                    position_ids=torch.cat([position_ids, position_ids], dim=1),
                    shift_labels=torch.cat([targets, targets], dim=1),
                    fused_lm_head=True,
                    use_cache=False,
                    # the model's own aux loss reads a 2D padding mask; MARS adds it below, on the clean stream
                    **({"output_router_logits": False} if moe_aux else {}),
                )
        finally:
            if router is not None:
                router.close()
        return outputs, router

    def _not_finite(self, noisy_num, clean_num) -> FloatingPointError:
        bad = [name for name, v in (("noisy (mask) stream", noisy_num), ("clean (AR) stream", clean_num))
               if not bool(torch.isfinite(v))] or ["the normaliser"]
        return FloatingPointError(
            f"MARS loss is not finite at step {self.state.global_step} ({' and '.join(bad)}: noisy={float(noisy_num.detach())}, "
            f"clean={float(clean_num.detach())}). Lower the learning rate, check the data for empty targets, or train in "
            "float32; the last saved checkpoint is intact (resume_from_checkpoint)."
        )

    @torch.no_grad()
    def _record_metrics(self, mode, inputs, outputs, position_ids, labels, targets, noisy_num, clean_num, local_den,
                        valid):
        block_size = self.args.block_size
        b, n = targets.shape
        is_target = targets != -100
        top1 = outputs.is_top1
        entropy = outputs.entropy
        # Offset j of a noisy prediction at p: its distance from the last real token it sees (the clean prefix
        # before its block, or an unmasked token inside it). Mask j predicts the token j+1 after that context,
        # i.e. candidate j of inference (docs/method.md, section 2). Offset 0 (p itself unmasked) is an AR-like prediction.
        idx = torch.arange(n, device=targets.device).expand(b, n)
        block_start = idx - torch.remainder(position_ids, block_size)
        real = (labels == -100) & valid
        last_real = torch.where(real, idx, torch.full_like(idx, -1)).cummax(dim=1).values
        context_end = torch.maximum(last_real, block_start - 1)
        offset = idx - context_end  # 0..B
        noisy_hit = (top1[:, :n] > 0) & is_target
        one_hot = torch.nn.functional.one_hot(offset.clamp(max=block_size), block_size + 1)[..., 1:]  # (b, n, B)
        counted = (is_target & (offset > 0))[..., None] & one_hot.bool()
        mask_total = counted.sum(dim=(0, 1)).float()
        mask_correct = (counted & noisy_hit[..., None]).sum(dim=(0, 1)).float()
        clean_hits = ((top1[:, n:] > 0) & is_target).sum().float()
        clean_entropy = (entropy[:, n:].float() * is_target).sum() if entropy is not None else torch.zeros(())
        if "attention_mask" in inputs:
            num_tokens = inputs["attention_mask"].sum().float()
        else:
            num_tokens = torch.tensor(float(inputs["input_ids"].size(1)))
        device = targets.device
        vec = torch.cat([
            torch.stack([noisy_num.detach().float(), clean_num.detach().float(), local_den.float(),
                         is_target.sum().float(), clean_hits, clean_entropy.to(device), num_tokens.to(device)]),
            mask_correct, mask_total,
        ])
        vec = self.accelerator.gather(vec[None]).sum(dim=0).cpu()
        if mode == "train":
            trl_count_train_tokens(self, int(vec[6].item()))
        prev = self._mars_sums[mode]
        self._mars_sums[mode] = vec if prev is None else prev + vec

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        sums = self._mars_sums.get(mode)
        if sums is not None:
            block_size = self.args.block_size
            den = max(sums[2].item(), 1.0)
            targets = max(sums[3].item(), 1.0)
            metrics = trl_metrics(self, mode)
            metrics["mars_loss"] = [sums[0].item() / den]
            metrics["ar_loss"] = [sums[1].item() / den]
            metrics["mean_token_accuracy"] = [sums[4].item() / targets]
            metrics["entropy"] = [sums[5].item() / targets]
            correct, total = sums[7:7 + block_size], sums[7 + block_size:7 + 2 * block_size]
            metrics["mask_accuracy"] = [correct.sum().item() / max(total.sum().item(), 1.0)]
            for j in range(block_size):
                metrics[f"mask_accuracy_{j + 1}"] = [correct[j].item() / max(total[j].item(), 1.0)]
            if mode == "train":
                metrics["num_tokens"] = [trl_count_train_tokens(self, 0)]
            self._mars_sums[mode] = None
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys: list[str] | None = None):
        # the logits cost an extra forward; only produce them when something consumes them
        if self.compute_metrics is None and self.preprocess_logits_for_metrics is None:
            prediction_loss_only = True
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def train(self, *args, **kwargs):
        """SFTTrainer.train; afterwards ``config.mars["trained_steps"]`` records that the mask token was trained."""
        output = super().train(*args, **kwargs)
        if self.state.global_step > 0:
            set_mars_metadata(self.accelerator.unwrap_model(self.model).config,
                              trained_steps=int(self.state.global_step))
        return output

    # ------------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save as SFTTrainer does, then make sure the folder is a complete MARS checkpoint.

        config.json carries ``mars`` (it is in ``model.config``; re-written here for save paths that skip
        ``save_pretrained``, e.g. sharded FSDP state dicts) and `hf_mars.hub.write_mars_extras` adds the
        generation defaults, custom_generate/ and the model card.
        """
        if self.state.global_step > 0:  # the mask token has been trained: MARS decoding is meaningful
            set_mars_metadata(self.accelerator.unwrap_model(self.model).config,
                              trained_steps=int(self.state.global_step))
        super().save_model(output_dir, _internal_call=True)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            from .. import hub

            model = self.accelerator.unwrap_model(self.model)
            self._ensure_config_metadata(output_dir, model)
            self._training_args_as_json(output_dir)
            hub.write_mars_extras(output_dir, model=model, tokenizer=self.processing_class, training_args=self.args)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def push_to_hub(self, *args, **kwargs):
        """Trainer.push_to_hub, keeping the MARS model card (Trainer writes TRL's card right before uploading)."""
        self._mars_pushing = True
        try:
            return super().push_to_hub(*args, **kwargs)
        finally:
            self._mars_pushing = False

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, **kwargs):
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        # during push_to_hub, output_dir was just saved by save_model: put the MARS card (and extras) back
        if getattr(self, "_mars_pushing", False) and self.is_world_process_zero():
            from .. import hub

            fields = {"model_name": model_name} if model_name else {}
            if dataset_name:
                fields["datasets"] = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name)
            hub.write_mars_extras(self.args.output_dir, model=self.accelerator.unwrap_model(self.model),
                                  tokenizer=self.processing_class, training_args=self.args, **fields)

    def _training_args_as_json(self, output_dir: str) -> None:
        """Trainer pickles its arguments as training_args.bin; a Hub checkpoint should hold no pickle at all.

        Nothing reads that file back (resuming uses trainer_state.json, optimizer and scheduler states), so it is
        replaced by the same arguments as JSON.
        """
        pickled = os.path.join(output_dir, "training_args.bin")
        if os.path.isfile(pickled):
            os.remove(pickled)
        with open(os.path.join(output_dir, "training_args.json"), "w", encoding="utf-8") as f:
            f.write(self.args.to_json_string())

    def _ensure_config_metadata(self, output_dir: str, model) -> None:
        import json

        meta = dict(getattr(model.config, "mars", None) or {})
        path = os.path.join(output_dir, "config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            if config.get("mars") != meta:
                config["mars"] = meta
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(config, f, indent=2, sort_keys=True)
                    f.write("\n")
        else:
            model.config.save_pretrained(output_dir)

