"""Prompt sets for `hf-mars bench`: a prompt file, or the bundled tasks' held-out split, normalised to records, tokenised, and batched.

A record is ``{"prompt": str | messages, "answer": str | None, "task": str | None}``: the answer, when there is
one, lets the benchmark report accuracy next to speed, so a TRL conversational data set doubles as a prompt set.
Batches are left-padded and full, and every batch size sees the same prompts.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

__all__ = ["encode_prompts", "load_prompts", "make_batches", "score_record", "to_record"]


def to_record(item, where: str = "prompt") -> dict:
    """Normalise one prompt to ``{"prompt": str | messages, "answer": str | None, "task": str | None}``.

    Accepts a string, a list of chat messages, or an object with ``messages`` / ``prompt`` / ``text`` /
    ``question`` / ``instruction`` (plus optional ``answer``/``completion`` and ``task``). A trailing
    assistant turn is dropped from the prompt and kept as the reference answer, so a TRL conversational
    data set doubles as a prompt set with accuracy.
    """
    if isinstance(item, dict) and "prompt" in item and ("answer" in item or "task" in item) and set(item) <= {"prompt", "answer", "task"}:
        rec = to_record(item["prompt"], where)
        rec["answer"] = item.get("answer", rec["answer"])
        rec["task"] = item.get("task", rec["task"])
        return rec
    if isinstance(item, str):
        return {"prompt": item, "answer": None, "task": None}
    if isinstance(item, dict):
        for key in ("messages", "prompt", "conversations", "text", "question", "instruction", "input"):
            if key in item:
                rec = to_record(item[key], where)
                answer = item.get("answer", item.get("completion"))
                if isinstance(answer, list) and answer and isinstance(answer[-1], dict):
                    answer = answer[-1].get("content")
                if answer is not None:
                    rec["answer"] = str(answer)
                if item.get("task") is not None:
                    rec["task"] = str(item["task"])
                return rec
        raise ValueError(
            f"{where}: a prompt record needs one of the keys 'messages', 'prompt', 'text', 'question' "
            f"or 'instruction'; got keys {sorted(item)}."
        )
    if not isinstance(item, list):
        raise ValueError(f"{where}: a prompt must be a string, a list of chat messages or an object, got {type(item).__name__}.")
    msgs = list(item)
    if not msgs or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
        raise ValueError(f"{where}: chat messages must be a non-empty list of {{'role': ..., 'content': ...}} objects.")
    answer = None
    while msgs and msgs[-1]["role"] == "assistant":
        answer = msgs[-1]["content"] if answer is None else answer
        msgs = msgs[:-1]  # generate the reply, don't read it
    if not msgs:
        raise ValueError(f"{where}: the conversation holds only assistant turns; there is nothing to prompt with.")
    return {"prompt": msgs, "answer": answer, "task": None}


def load_prompts(path: str | os.PathLike | None = None, limit: int | None = None) -> list[dict]:
    """Prompt records (see `to_record`) from a .txt (one per line), .jsonl or .json file; without a path
    the bundled tasks' held-out prompts (`hf_mars.bench.tasks`, with answers, so accuracy is reported)."""
    if path is None:
        records = _default_prompts()
    else:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"Prompt file {str(p)!r} does not exist; pass a .txt, .jsonl or .json file of prompts.")
        text = p.read_text(encoding="utf-8")
        if p.suffix == ".txt":
            records = [to_record(line) for line in text.splitlines() if line.strip()]
        elif p.suffix == ".jsonl":
            records = [to_record(json.loads(line), f"{p}:{i + 1}") for i, line in enumerate(text.splitlines()) if line.strip()]
        elif p.suffix == ".json":
            data = json.loads(text)
            if not isinstance(data, list):
                raise ValueError(f"{p}: a .json prompt file must hold a list of prompts.")
            records = [to_record(x, f"{p}[{i}]") for i, x in enumerate(data)]
        else:
            raise ValueError(f"Unknown prompt file type {p.suffix!r}: use .txt (one prompt per line), .jsonl or .json.")
    if not records:
        raise ValueError("The prompt set is empty.")
    return records[:limit] if limit else records


def _default_prompts(n: int = 64) -> list[dict]:
    """The bundled tasks' held-out split: tasks interleaved, answers known."""
    from hf_mars.bench.tasks import generate_examples

    return [to_record(ex, "hf_mars.bench.tasks") for ex in generate_examples(n, seed=0, split="eval")]


def score_record(record: dict, prediction: str) -> bool:
    """Exact whole-answer match (the bundled tasks' own scorer when the task is one of theirs)."""
    from hf_mars.bench.tasks import TASKS, score

    if record["task"] in TASKS:
        return bool(score(record["task"], prediction, record["answer"]))
    return prediction.strip() == str(record["answer"]).strip()


def encode_prompts(tokenizer, prompts, chat_template: bool | None = None) -> list[list[int]]:
    """Token ids per prompt. Strings are wrapped as a user turn when the tokenizer has a chat template
    (``chat_template=None``: automatic), chat messages always go through the template."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_template = has_template if chat_template is None else chat_template
    out = []
    for prompt in prompts:
        if isinstance(prompt, list) or use_template:
            if not has_template:
                raise ValueError("Chat-message prompts need a tokenizer with a chat template; pass plain text prompts instead.")
            msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        out.append(list(ids))
    return out


def make_batches(encoded: list[list[int]], batch_size: int, pad_id: int, num_prompts: int | None = None):
    """Left-padded (input_ids, attention_mask) batches of exactly ``batch_size`` rows.

    The prompt list is cycled when it is shorter than ``num_prompts`` (or one batch), so every batch
    size sees the same prompts and every batch is full.
    """
    n = max(num_prompts or len(encoded), batch_size)
    n = int(math.ceil(n / batch_size) * batch_size)
    rows = [encoded[i % len(encoded)] for i in range(n)]
    batches = []
    for start in range(0, n, batch_size):
        chunk = rows[start : start + batch_size]
        width = max(len(r) for r in chunk)
        ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
        batches.append((ids, mask))
    return batches

