"""Real text for a pretrained base, offline: the prose of Python's language reference (``pydoc_data.topics``),
which ships with every Python and which nobody on this project wrote.

Why it, for ``hf-mars demo --base gemma3-270m``: a pretrained base has no chat template and the bundled
synthetic tasks say nothing about real text. Prompts are paragraph openings; the training answers are the base
model's own greedy continuations (self-distillation, ``distill``), so verify mode's drafts learn the very
distribution they are checked against; held-out prompts and the perplexity text come from *other topics*, so
nothing evaluated was trained on, not even its subject.
"""

from __future__ import annotations

import re
import zlib

HELD_OUT_SHARE = 5  # one topic in five is held out (chosen by a hash of its name: stable across Pythons)


def paragraphs() -> list[tuple[str, str]]:
    """(topic, paragraph) for every prose paragraph of at least 200 characters; code and grammar blocks (indented
    lines) are skipped, wrapped lines joined."""
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        for block in topics[topic].split("\n\n"):
            if not block.strip() or block.startswith((" ", "*", "-", "=")) or "\n   " in block or "::=" in block:
                continue
            text = re.sub(r"\s+", " ", block).strip()
            if len(text) >= 200:
                out.append((topic, text))
    return out


def is_held_out(topic: str) -> bool:
    return zlib.crc32(topic.encode()) % HELD_OUT_SHARE == 0


def split() -> tuple[list[str], list[str]]:
    """(train paragraphs, held-out paragraphs), split by topic. The reference repeats some paragraphs under several
    topics: each appears once, held out if any of its topics is."""
    topics_of: dict[str, list[str]] = {}
    for topic, text in paragraphs():
        topics_of.setdefault(text, []).append(topic)
    train, held = [], []
    for text, topics in topics_of.items():
        (held if any(map(is_held_out, topics)) else train).append(text)
    return train, held


def opening(text: str, words: int = 16) -> str:
    """A paragraph's first ``words`` words: the prompt the base continues."""
    return " ".join(text.split()[:words])


def distill(model, tokenizer, prompts, max_new_tokens: int, batch_size: int = 16, progress=None):
    """The base model's own greedy continuations, batched (left padding): a list of (prompt ids, completion ids),
    token ids as generated (no decode / re-encode round trip, which could change them). A completion stops at the
    model's EOS (kept) or at ``max_new_tokens``."""
    import torch

    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    out = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
            for row, mask in zip(gen.tolist(), enc["attention_mask"].tolist()):
                width = len(mask)
                prompt_ids = [t for t, m in zip(row[:width], mask) if m]
                completion = []
                for t in row[width:]:
                    completion.append(t)
                    if t in eos:
                        break
                out.append((prompt_ids, completion))
            if progress is not None:
                progress.update(min(batch_size, len(prompts) - i))
    return out


def token_rows(pairs, cut_fraction: float = 0.0, seed: int = 0) -> list[dict]:
    """Pre-tokenized TRL rows (``input_ids`` + ``completion_mask``) from (prompt, completion) ids; a share cut at a
    random completion token, whose prefix then joins the prompt (untrained), as the tiny demo does: decoding feeds
    masks after any committed length, so the masks must see real tokens before them inside a block."""
    import random

    rng = random.Random(f"hf-mars-cut|{seed}")
    rows = []
    for prompt, completion in pairs:
        r = rng.randint(1, len(completion) - 1) if len(completion) > 1 and rng.random() < cut_fraction else 0
        rows.append({"input_ids": prompt + completion,
                     "completion_mask": [0] * (len(prompt) + r) + [1] * (len(completion) - r)})
    return rows
