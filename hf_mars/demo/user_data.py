"""Your own data for the real-model demo (`hf-mars demo --base ... --dataset ...`), in any of TRL's dataset formats.

By default the real-model pipeline trains on the base's own greedy continuations of Python's language reference
(self-distillation: the masks learn the distribution verify checks them against). ``--dataset`` trains MARS and
the SFT baseline on your rows instead, measured the same way. What each format becomes (a prompt, which is not
trained, and a completion, which is):

- language modeling, ``{"text": ...}``: the opening words are the prompt, the rest the completion (as the default
  data is built);
- prompt-completion, ``{"prompt": ..., "completion": ...}``, strings;
- conversational, ``{"messages": [...]}`` (the last message, the assistant's, is the completion) or prompt and
  completion as message lists: rendered by the base's chat template (TRL's ``maybe_apply_chat_template``); a base
  without one is refused.

The dataset's ``test`` split, if it has one, is held out; otherwise its last ``--num-eval`` rows. The held-out
prompts are what the decoding and timing runs continue, and their full texts (prompt and completion) what held-out
perplexity reads. Rows are cut to ``MAX_TOKENS`` tokens (a CPU budget); a row with an empty completion is skipped.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

MAX_TOKENS = 512
OPENING_WORDS = 16  # a language-modeling row's prompt: its first words, as the default data's openings
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def load(spec: str):
    """``(train rows, held-out rows or None)`` from a data file (json / jsonl / csv / parquet / txt), a folder
    written by ``Dataset.save_to_disk``, or anything ``datasets.load_dataset`` takes (a Hub id, read from the
    local cache when offline, or a folder of data files)."""
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    path = Path(spec)
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise ValueError(f"--dataset {spec}: a data file must be one of {sorted(FILE_BUILDERS)}")
        loaded = load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path))
    elif (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        loaded = load_from_disk(str(path))
    else:
        try:
            loaded = load_dataset(spec)
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds; one clear message
            raise ValueError(f"--dataset {spec!r} could not be loaded ({type(e).__name__}: {e})") from e
    if isinstance(loaded, Dataset):
        return loaded, None
    if not isinstance(loaded, DatasetDict) or "train" not in loaded:
        raise ValueError(f"--dataset {spec!r} has no 'train' split (splits: {list(loaded)})")
    return loaded["train"], loaded.get("test")


def _without_template_bos(text: str, tokenizer) -> str:
    """A chat template that writes the BOS token itself, for a tokenizer that adds it too: the tokenizer's is kept
    (prompts are encoded with special tokens, as the decoding runs encode them)."""
    bos = tokenizer.bos_token
    adds_bos = bos is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    return text[len(bos):] if adds_bos and text.startswith(bos) else text


def as_prompt_completion(row: dict, tokenizer) -> tuple[str, str]:
    """One row of any TRL format as (prompt text, completion text); see the module's docstring."""
    from trl.data_utils import is_conversational, maybe_apply_chat_template

    if "messages" in row and row["messages"]:
        row = {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]}
    if is_conversational(row):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("--dataset has conversational rows (lists of messages), and the base has no chat "
                             "template to render them: give it rows of text, or prompt and completion strings.")
        if set(row) >= {"prompt", "completion"}:
            rendered = maybe_apply_chat_template({"prompt": row["prompt"], "completion": row["completion"]},
                                                 tokenizer)
            return _without_template_bos(rendered["prompt"], tokenizer), rendered["completion"]
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        return row["prompt"], row["completion"]
    if isinstance(row.get("text"), str):
        opening = re.match(rf"\s*(?:\S+\s+){{0,{OPENING_WORDS - 1}}}\S*", row["text"])
        return row["text"][:opening.end()], row["text"][opening.end():]
    raise ValueError(f"--dataset: a row with columns {sorted(row)} is in none of TRL's formats: 'text', "
                     "'prompt' + 'completion' (strings or message lists), or 'messages'.")


def encode(prompt: str, completion: str, tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids with the tokenizer's special tokens, completion ids + EOS), cut to ``MAX_TOKENS`` in all."""
    prompt_ids = tokenizer(prompt)["input_ids"][-(MAX_TOKENS // 2):]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    return prompt_ids, completion_ids[:MAX_TOKENS - len(prompt_ids)]


def data(tokenizer, args, draft_vocab) -> dict:
    """The real-model pipeline's data (`real._data`'s fields) from ``args.dataset``: up to steps x batch / 2
    training pairs (each seen twice, as the default data), ``args.num_eval`` held-out prompts and texts."""
    t0 = time.time()
    train, held = load(args.dataset)
    if held is None:
        if len(train) <= args.num_eval:
            raise ValueError(f"--dataset {args.dataset!r} has {len(train)} rows: more than --num-eval "
                             f"({args.num_eval}) are needed, the last {args.num_eval} being held out.")
        train, held = train.select(range(len(train) - args.num_eval)), train.select(range(len(train) - args.num_eval,
                                                                                          len(train)))
    pairs = []
    for row in train:
        prompt, completion = as_prompt_completion(row, tokenizer)
        prompt_ids, completion_ids = encode(prompt, completion, tokenizer)
        if completion_ids and prompt_ids:
            pairs.append((prompt_ids, completion_ids))
        if len(pairs) >= max(args.steps * args.batch_size // 2, 1):
            break
    if not pairs:
        raise ValueError(f"--dataset {args.dataset!r}: no training row has both a prompt and a completion.")
    held_rows = [as_prompt_completion(row, tokenizer) for row in held.select(range(min(args.num_eval, len(held))))]
    return {"train": pairs, "seconds": time.time() - t0, "held_prompts": [p for p, _ in held_rows],
            "held_text": [p + c for p, c in held_rows], "draft_vocab": draft_vocab(pairs),
            "source": f"--dataset {args.dataset}"}
