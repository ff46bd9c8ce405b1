"""`hf-mars bench`: wall-clock and tokens per forward of MARS decoding against plain `generate`.

Why a dedicated benchmark: tokens per forward alone does not predict a speed-up.
A MARS step forwards ``1 + B`` (or more) positions where an AR step forwards one,
and the decoding loop does more Python work per step. So every MARS figure is
printed next to the limit it should be read against,

    limit = (tokens per forward call, MARS / AR) x cost(1) / cost(1 + B),

with ``cost(w)`` the measured time of one cached forward of ``w`` new positions
at the same batch size and cache length, and ``efficiency = speed-up / limit``
(the share of that limit the loop reaches). ``ideal`` is the speed-up the run
would reach if neither loop had any overhead outside the model's forward
(measured by timing every forward with hooks), and ``ovh ms/step`` is the loop's
own time per step — the part a faster loop can win back.

AR and MARS run in the same process, on the same batches, interleaved per batch
size, after a warm-up; each figure is the median over ``repeats``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_mars.generation import DEFAULT_VERIFY_THRESHOLD

CACHE_MODES = ("sliding", "block", "block_trained")  # mars_cache values of hf_mars.generation

# Small built-in prompt set, used when no prompt file is given and the demo data is not available.
BUILTIN_PROMPTS = [
    "What is 12 + 35?",
    "Reverse the word 'banana'.",
    "List the first five even numbers.",
    "Spell 'decoding' backwards.",
    "What is 7 times 8?",
    "Write the alphabet from a to j.",
    "Count from 1 to 10.",
    "Repeat the word 'mask' three times.",
    "Sort the letters of 'python'.",
    "What is 100 minus 37?",
    "Name the days of the week.",
    "Write 'hello world' in upper case.",
    "What is 9 squared?",
    "Copy this: the quick brown fox.",
    "Add 250 and 250.",
    "Give the months of the year.",
]


# ----------------------------------------------------------------------------------------------- prompts


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
    the demo's held-out prompts (`hf_mars.demo.data`, with answers, so accuracy is reported), else a small
    built-in list."""
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
    """The demo's held-out split (tasks interleaved, answers known) when hf_mars.demo.data is present, else built-ins."""
    try:
        from hf_mars.demo.data import generate_examples
    except ImportError:  # pragma: no cover - depends on which modules exist
        return [to_record(p) for p in BUILTIN_PROMPTS]
    return [to_record(ex, "hf_mars.demo.data") for ex in generate_examples(n, seed=0, split="eval")]


def _score(record: dict, prediction: str) -> bool:
    """Exact whole-answer match (the demo's own scorer when the task is one of its tasks)."""
    try:
        from hf_mars.demo.data import TASKS, score

        if record["task"] in TASKS:
            return bool(score(record["task"], prediction, record["answer"]))
    except ImportError:  # pragma: no cover
        pass
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


# ----------------------------------------------------------------------------------------------- counting


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def count_emitted(new_tokens: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """Real emitted tokens per row: up to and including the first EOS, nothing after it (padding)."""
    b, n = new_tokens.shape
    if n == 0:
        return torch.zeros(b, dtype=torch.long)
    if not eos_ids:
        return torch.full((b,), n, dtype=torch.long)
    is_eos = torch.isin(new_tokens, torch.tensor(eos_ids, device=new_tokens.device))
    any_eos = is_eos.any(dim=1)
    first = is_eos.int().argmax(dim=1)
    return torch.where(any_eos, first + 1, torch.full_like(first, n)).cpu()


class ForwardRecorder:
    """Counts and times the model's forward calls during generate (hooks; no change to the model).

    Hooks sit on the top module (time includes the LM head) and on the decoder stack, so a loop that
    calls the decoder and the head separately is still counted. Widths are the new positions per call.
    ``sync`` makes per-forward times exact on CUDA at the cost of a sync per call.

    A compiled forward (``model.get_compiled_call``, what generate uses with a compile config) traces the module
    hooks into its graph, where a clock or a counter would be a constant or a guard (a recompile per call): the
    hooks do nothing while Dynamo traces, and the compiled call itself is counted and timed from outside.
    """

    def __init__(self, model, sync: bool = False):
        self.model = model
        self.sync = sync
        self.handles = []
        self._wrapped = None  # (the compiled call, the counting wrapper around it)
        self.reset()

    def reset(self):
        self.top_calls = 0
        self.dec_calls = 0
        self.widths: list[int] = []
        self.top_time = 0.0
        self.dec_time = 0.0
        self._t0 = {}

    def _width(self, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        return int(x.shape[1]) if torch.is_tensor(x) and x.dim() >= 2 else 0

    def _start(self, which, args, kwargs):
        if self.sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t0[which] = time.perf_counter()
        if which == "dec":
            self.dec_calls += 1
            self.widths.append(self._width(args, kwargs))
        else:
            self.top_calls += 1

    def _stop(self, which):
        if self.sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - self._t0.pop(which, time.perf_counter())
        if which == "dec":
            self.dec_time += dt
        else:
            self.top_time += dt

    def _pre(self, which):
        def hook(module, args, kwargs):
            if not torch.compiler.is_compiling():
                self._start(which, args, kwargs)

        return hook

    def _post(self, which):
        def hook(module, args, kwargs, output):
            if not torch.compiler.is_compiling():
                self._stop(which)

        return hook

    def _get_compiled_call(self, compile_config):
        compiled = type(self.model).get_compiled_call(self.model, compile_config)
        if self._wrapped is None or self._wrapped[0] is not compiled:
            def call(*args, **kwargs):
                for which in self._targets:
                    self._start(which, args, kwargs)
                try:
                    return compiled(*args, **kwargs)
                finally:
                    for which in self._targets:
                        self._stop(which)

            self._wrapped = (compiled, call)
        return self._wrapped[1]

    def __enter__(self):
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        targets = [("top", self.model)] + ([("dec", decoder)] if decoder is not None and decoder is not self.model else [])
        if len(targets) == 1:  # no separate decoder: the top module is the one counted
            targets = [("dec", self.model)]
        self._targets = [which for which, _ in targets]
        for which, mod in targets:
            self.handles.append(mod.register_forward_pre_hook(self._pre(which), with_kwargs=True))
            self.handles.append(mod.register_forward_hook(self._post(which), with_kwargs=True))
        if hasattr(self.model, "get_compiled_call"):
            self.model.get_compiled_call = self._get_compiled_call  # instance attribute: removed on exit
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        self.model.__dict__.pop("get_compiled_call", None)
        self._wrapped = None

    @property
    def calls(self) -> int:
        return self.dec_calls

    @property
    def model_time(self) -> float:
        return self.top_time if self.top_calls else self.dec_time


# ----------------------------------------------------------------------------------------------- step costs


@torch.no_grad()
def measure_step_costs(model, batch_size: int, widths, past_len: int, repeats: int = 30, block_size: int = 4,
                       device=None, statistic: str = "min") -> dict[int, float]:
    """Seconds of one cached forward of ``w`` new positions over a ``past_len`` cache, for each width.

    Widths are timed interleaved (round-robin over the same cache, cropped back after each call), so load
    drift on a shared machine affects every width alike. ``statistic`` "min" (default) is the fastest of
    ``repeats`` calls: a single forward is short enough for preemption to dominate a median on a loaded
    machine, and the least disturbed call is the stable estimate of what a step costs. The LM head is
    charged as a lean loop would pay it: 1 position for a 1-token step, else the ``block_size + 1``
    candidate positions (``logits_to_keep``).
    """
    from transformers import DynamicCache

    device = device or next(model.parameters()).device
    widths = sorted({int(w) for w in widths})
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, vocab - 1, (batch_size, past_len), generator=gen).to(device)
    new = torch.randint(3, vocab - 1, (batch_size, max(widths)), generator=gen).to(device)
    cache = DynamicCache(config=model.config) if _takes(DynamicCache.__init__, "config") else DynamicCache()
    cache_kw = "cache" if _takes(model.forward, "cache") else "past_key_values"  # renamed in transformers 5.x
    model(input_ids=prefix, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
    times = {w: [] for w in widths}
    for i in range(repeats + 2):
        for w in widths:
            mask = torch.ones(batch_size, past_len + w, dtype=torch.long, device=device)
            pos = torch.arange(past_len, past_len + w, device=device).unsqueeze(0).expand(batch_size, -1)
            keep = 1 if w == 1 else min(w, block_size + 1)
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=new[:, :w], attention_mask=mask, position_ids=pos, use_cache=True,
                        logits_to_keep=keep, **{cache_kw: cache})
            out.logits.float().argmax(-1)  # a step reads its tokens; keep the same work
            _sync(device)
            if i >= 2:  # two warm-up rounds
                times[w].append(time.perf_counter() - t0)
            cache.crop(-w)  # negative: remove that many positions (works across transformers versions)
    if statistic not in ("min", "median"):
        raise ValueError("statistic must be 'min' or 'median'.")
    pick = min if statistic == "min" else statistics.median
    return {w: pick(t) for w, t in times.items()}


def measure_step_cost(model, batch_size: int, width: int, past_len: int, repeats: int = 30, block_size: int = 4,
                      device=None, statistic: str = "min") -> float:
    """`measure_step_costs` for one width."""
    return measure_step_costs(model, batch_size, [width], past_len, repeats, block_size, device, statistic)[int(width)]


def _takes(fn, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------- the benchmark


@dataclass
class RunSpec:
    """One decoding configuration of the benchmark."""

    mode: str  # "ar" | "ar_static_compile" | "prompt_lookup" (plain generate and its peers) | "mars" | "verify"
    threshold: float | None = None
    cache: str | None = None
    kwargs: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.mode in PLAIN_MODES:
            return self.mode
        return f"{self.mode}(tau={self.threshold:g},cache={self.cache})"


PEERS = ("prompt_lookup", "static_compile")  # what a user would run instead of MARS
PLAIN_MODES = ("ar", "ar_static_compile", "prompt_lookup")
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens


def build_specs(thresholds, caches, verify_thresholds, block_size, cache_block, verify_cache="sliding", peers=()):
    """Plain `generate`, the peers asked for, then every MARS configuration."""
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"Unknown peer(s) {unknown}: use any of {PEERS}.")
    specs = [RunSpec("ar")]
    if "static_compile" in peers:  # transformers' documented fast path: static cache + torch.compile
        from transformers import CompileConfig

        from hf_mars._compat import compile_on_any_device

        specs.append(RunSpec("ar_static_compile", kwargs={
            "cache_implementation": "static", "compile_config": compile_on_any_device(CompileConfig())}))
    if "prompt_lookup" in peers:  # lossless, no training, built in (batch 1 only in transformers)
        specs.append(RunSpec("prompt_lookup", kwargs={"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}))
    for cache in caches:
        if cache not in CACHE_MODES:
            raise ValueError(f"Unknown cache mode {cache!r}: use one of {CACHE_MODES}.")
        for tau in thresholds:
            kw = {"mars": True, "mars_threshold": float(tau), "mars_cache": cache}
            if block_size is not None:
                kw["mars_block_size"] = int(block_size)
            if cache != "sliding":
                kw["mars_cache_block"] = int(cache_block)
            specs.append(RunSpec("mars", float(tau), cache, kw))
    for tau in verify_thresholds or ():
        kw = {"mars": True, "mars_threshold": float(tau), "mars_verify": True, "mars_cache": verify_cache}
        if block_size is not None:
            kw["mars_block_size"] = int(block_size)
        specs.append(RunSpec("verify", float(tau), verify_cache, kw))
        if "static_compile" in peers:  # MARS on the same fast path as the compiled plain peer
            specs.append(RunSpec("verify", float(tau), "static+compile", {**kw, **specs[1].kwargs}))
    for spec in specs:
        if spec.mode in PLAIN_MODES:
            continue
        if not 0.0 <= spec.threshold <= 1.0:
            raise ValueError(f"Thresholds must lie in [0, 1], got {spec.threshold}.")
    return specs


def _generate_once(model, batch, spec: RunSpec, max_new_tokens: int, eos_ids, recorder: ForwardRecorder, device):
    ids, mask = (t.to(device) for t in batch)
    recorder.reset()
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         return_dict_in_generate=True, **spec.kwargs)
    _sync(device)
    elapsed = time.perf_counter() - t0
    seqs = out.sequences if hasattr(out, "sequences") else out
    new = seqs[:, ids.shape[1]:]
    emitted = count_emitted(new, eos_ids)
    stats_fwd = getattr(out, "mars_forward_passes", None)
    stats_emit = getattr(out, "mars_emitted_tokens", None)
    if spec.mode in ("ar", "ar_static_compile"):
        # each forward emits one token per active row: a row is active for its first `emitted` calls
        row_fwd = torch.clamp(emitted, max=recorder.calls)
    elif spec.mode == "prompt_lookup":  # batch 1: every call is this row's
        row_fwd = torch.full_like(emitted, recorder.calls)
    elif stats_fwd is not None:
        row_fwd = torch.as_tensor(stats_fwd).cpu().long()
    else:  # no statistics returned: the batch's calls bound every row's forwards
        row_fwd = torch.full_like(emitted, recorder.calls)
    return {
        "time": elapsed,
        "calls": recorder.calls,
        "widths": list(recorder.widths),
        "model_time": recorder.model_time,
        "emitted": emitted,
        "row_forwards": row_fwd,
        "stats_emitted": None if stats_emit is None else torch.as_tensor(stats_emit).cpu().long(),
        "new_tokens": [new[i, : int(emitted[i])].tolist() for i in range(new.shape[0])],
    }


def _generate_batch(model, batch, max_new_tokens, **gen_kwargs):
    return model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                          **gen_kwargs)


def time_interleaved(model, batches, runs: dict, repeats: int, progress=None, max_new_tokens: int = 64) -> dict:
    """Wall-clock seconds of each named generate setting over ``batches``.

    Settings are interleaved batch by batch (in rotating order) and each batch keeps its fastest repeat, so a
    shared, noisy machine slows every setting alike instead of favouring whichever ran in a quiet moment.
    """
    names = list(runs)
    best = [[float("inf")] * len(batches) for _ in names]
    with torch.inference_mode():
        for kwargs in runs.values():  # warm-up (first-call allocations, lazy imports)
            _generate_batch(model, batches[0], max_new_tokens, **kwargs)
        for rep in range(repeats):
            for b, batch in enumerate(batches):
                shift = (rep + b) % len(names)
                for k in names[shift:] + names[:shift]:
                    i = names.index(k)
                    t0 = time.perf_counter()
                    _generate_batch(model, batch, max_new_tokens, **runs[k])
                    best[i][b] = min(best[i][b], time.perf_counter() - t0)
            if progress is not None:
                progress.update(len(names))
    return {name: sum(best[i]) for i, name in enumerate(names)}


def machine_info(device) -> dict:
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # pragma: no cover
        pass
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:  # pragma: no cover
        pass
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _model_size(model) -> dict:
    cfg = model.config
    return {
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "dtype": str(next(model.parameters()).dtype),
    }


def resolve_block_size(model, block_size=None) -> int:
    """The B the loop uses: explicit, else generation_config.mars_block_size, else config.mars['block_size'], else 4."""
    if block_size is not None:
        return int(block_size)
    gb = getattr(model.generation_config, "mars_block_size", None)
    if gb is not None:
        return int(gb)
    meta = getattr(model.config, "mars", None) or {}
    return int(meta.get("block_size", 4))


def benchmark_generation(model, tokenizer, prompts=None, thresholds=(1.0, 0.95, 0.9), batch_sizes=(1, 4, 16),
                         caches=("sliding", "block"), verify_thresholds=(DEFAULT_VERIFY_THRESHOLD,), max_new_tokens=64, block_size=None,
                         cache_block=16, num_prompts=16, repeats=3, warmup=1, num_threads=None, cost_repeats=30,
                         chat_template=None, progress=True, log=None, peers=("prompt_lookup",)) -> dict:
    """Benchmark MARS decoding against plain greedy `generate` (KV cache) on one model, in one process.

    ``model`` must have `enable_mars` applied (done here when it is not). Returns a JSON-able dict with
    the machine, the model, the step costs per batch size and one row per (batch size, configuration):
    tokens (real emitted tokens, padding after EOS excluded), time (median over ``repeats``), tok/s,
    tok/fwd (per row, the paper's measure), tokens per forward call (batch), speed-up over AR, the
    limit and the efficiency described in the module docstring, the zero-overhead ``ideal`` speed-up,
    the loop's own overhead per step, and the share of rows whose output equals AR's.
    """
    if num_threads:
        torch.set_num_threads(int(num_threads))
    if repeats < 1:
        raise ValueError("repeats must be >= 1.")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1.")
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise ValueError("batch_sizes must be a non-empty list of positive integers.")
    from hf_mars.generation import enable_mars

    enable_mars(model)  # idempotent
    device = next(model.parameters()).device
    records = [to_record(p, f"prompts[{i}]") for i, p in enumerate(prompts)] if prompts is not None else load_prompts()
    if not records:
        raise ValueError("The prompt set is empty.")
    encoded = encode_prompts(tokenizer, [r["prompt"] for r in records], chat_template=chat_template)
    scored = any(r["answer"] is not None for r in records)  # accuracy over the prompts that carry an answer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (_eos_ids(model) or [0])[0]
    eos_ids = _eos_ids(model)
    bsz = resolve_block_size(model, block_size)
    specs = build_specs(thresholds, caches, verify_thresholds, block_size, cache_block, peers=peers)
    sync = device.type == "cuda"
    info = machine_info(device)
    result = {
        "machine": info,
        "model": _model_size(model),
        "settings": {
            "max_new_tokens": max_new_tokens, "block_size": bsz, "cache_block": cache_block, "repeats": repeats,
            "warmup": warmup, "num_prompts": num_prompts, "prompts_available": len(records),
            "accuracy_reported": scored,
            "mean_prompt_tokens": statistics.mean(len(e) for e in encoded), "batch_sizes": list(batch_sizes),
            "thresholds": list(thresholds), "caches": list(caches), "verify_thresholds": list(verify_thresholds or ()),
            "peers": list(peers),
            "eos_token_ids": eos_ids,
        },
        "step_costs": {},
        "rows": [],
    }
    say = log or (lambda msg: None)
    total = len(batch_sizes) * len(specs) * repeats
    bar = _tqdm(total=total, disable=not progress, desc="bench")
    past_len = int(result["settings"]["mean_prompt_tokens"] + max_new_tokens / 2)
    for b in batch_sizes:
        b = int(b)
        batches = make_batches(encoded, b, pad_id, num_prompts)
        recorder = ForwardRecorder(model, sync=False)
        batch_specs = [spec for spec in specs if not (spec.mode == "prompt_lookup" and b > 1)]  # batch 1 only
        per_spec = {spec.label: (spec, []) for spec in batch_specs}
        with recorder:
            for spec in batch_specs:
                # a compiled forward compiles once per shape: warm it on every batch, so no timed call compiles
                warm = batches if "compile_config" in spec.kwargs else batches[:1]
                for _ in range(warmup):
                    for bt in warm:
                        _generate_once(model, bt, spec, max_new_tokens, eos_ids, recorder, device)
            # repeats interleaved across configurations: load drift on a shared machine hits all of them alike
            for _ in range(repeats):
                for spec in batch_specs:
                    bar.set_postfix_str(f"b={b} {spec.label}")
                    runs = [_generate_once(model, bt, spec, max_new_tokens, eos_ids, recorder, device) for bt in batches]
                    per_spec[spec.label][1].append(runs)
                    bar.update(1)
        if sync:  # exact per-forward times need a sync per call: one extra instrumented pass on CUDA
            with ForwardRecorder(model, sync=True) as rec2:
                for spec, reps in per_spec.values():
                    for j, bt in enumerate(batches):
                        r = _generate_once(model, bt, spec, max_new_tokens, eos_ids, rec2, device)
                        for runs in reps:
                            runs[j]["model_time"] = r["model_time"]
        # step costs at this batch size, same cache-length scale as the runs (prompt + half the reply):
        # 1 and 1 + B (the limit), the block-cache chunk, and every decode width the runs used (width limit)
        used = {w for _, reps in per_spec.values() for run in reps[0] for w in run["widths"][1:]}
        widths = {1, 1 + bsz} | ({cache_block} if any(c != "sliding" for c in caches) else set()) | used
        table = measure_step_costs(model, b, widths, past_len, cost_repeats, block_size=bsz, device=device)
        c1, cB = table[1], table[1 + bsz]
        costs = {"past_len": past_len, "cost_1_ms": c1 * 1e3, f"cost_{1 + bsz}_ms": cB * 1e3, "ratio": cB / c1,
                 "table_ms": {str(w): t * 1e3 for w, t in sorted(table.items())}}
        if cache_block in table:
            costs[f"cost_{cache_block}_ms"] = table[cache_block] * 1e3
        result["step_costs"][str(b)] = costs
        say(f"batch {b}: cost(1) {c1 * 1e3:.2f} ms, cost({1 + bsz}) {cB * 1e3:.2f} ms")
        ar_row = None
        ar_tokens = None
        for label, (spec, reps) in per_spec.items():
            row = _summarise(b, spec, reps, costs, bsz)
            row["_predicted_s"] = sum(table[w] for run in reps[0] for w in run["widths"][1:])
            toks = [t for run in reps[0] for t in run["new_tokens"]]  # row g of the run is records[g % len]
            if spec.mode == "ar":
                ar_row, ar_tokens = row, toks
            else:
                row["matches_ar"] = sum(x == y for x, y in zip(toks, ar_tokens)) / len(toks)
            if scored:
                texts = tokenizer.batch_decode(toks, skip_special_tokens=True)
                hits = [_score(records[g % len(records)], t) for g, t in enumerate(texts)
                        if records[g % len(records)]["answer"] is not None]
                row["accuracy"] = sum(hits) / len(hits) if hits else None
                row["accuracy_n"] = len(hits)
            result["rows"].append(row)
        for row in result["rows"]:
            if row["batch_size"] == b:
                _relative(row, ar_row, costs)
        # against the fastest plain path a user can already have (plain generate, static cache + compile)
        plain = [r["tokens_per_s"] for r in result["rows"] if r["batch_size"] == b and r["mode"] in ("ar", "ar_static_compile")]
        for row in result["rows"]:
            if row["batch_size"] == b:
                row["speedup_vs_best_plain"] = row["tokens_per_s"] / max(plain)
        for row in result["rows"]:
            if row["batch_size"] == b:
                row.pop("_predicted_s", None)
    bar.close()
    if hasattr(os, "getloadavg"):
        info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _summarise(b, spec, reps, costs, bsz):
    times = [sum(r["time"] for r in runs) for runs in reps]
    model_times = [sum(r["model_time"] for r in runs) for runs in reps]
    runs = reps[0]  # greedy: token counts are the same on every repeat
    tokens = int(sum(int(r["emitted"].sum()) for r in runs))
    row_fwd = int(sum(int(r["row_forwards"].sum()) for r in runs))
    calls = int(sum(r["calls"] for r in runs))
    widths = [w for r in runs for w in r["widths"][1:]]  # decode steps (the first call is the prefill)
    t = statistics.median(times)
    mt = statistics.median(model_times)
    # best-of-repeats per generate call: on a shared machine the least disturbed estimate
    t_min = sum(min(reps[k][j]["time"] for k in range(len(reps))) for j in range(len(runs)))
    row = {
        "batch_size": b,
        "mode": spec.mode,
        "threshold": spec.threshold,
        "cache": spec.cache,
        "generate_kwargs": spec.kwargs,
        "tokens": tokens,
        "time_s": t,
        "times_s": times,
        "tokens_per_s": tokens / t if t > 0 else float("nan"),
        "time_min_s": t_min,
        "tokens_per_s_min": tokens / t_min if t_min > 0 else float("nan"),
        "tokens_per_forward": tokens / row_fwd if row_fwd else float("nan"),
        "forward_calls": calls,
        "tokens_per_call": tokens / calls if calls else float("nan"),
        "mean_decode_width": statistics.mean(widths) if widths else float("nan"),
        "model_time_s": mt,
        "overhead_ms_per_step": (t - mt) / calls * 1e3 if calls else float("nan"),
        "model_ms_per_step": mt / calls * 1e3 if calls else float("nan"),
    }
    stats_emit = [r["stats_emitted"] for r in runs]
    if all(s is not None for s in stats_emit):
        row["stats_emitted_tokens"] = int(sum(int(s.sum()) for s in stats_emit))
    if spec.mode == "ar":
        # sanity: plain generate runs exactly one forward per step until the longest row stops
        row["forward_calls_consistent"] = all(r["calls"] == int(r["emitted"].max()) for r in runs)
    return row


def _relative(row, ar, costs):
    """Speed-up over AR, the limit tok/fwd x cost(1)/cost(1+B), efficiency and the zero-overhead ideal."""
    if row["mode"] == "ar":
        row.update(speedup_vs_ar=1.0, speedup_min=1.0, limit=None, efficiency=None, limit_w=None, ideal=1.0)
        return
    speedup = row["tokens_per_s"] / ar["tokens_per_s"]
    row["speedup_min"] = row["tokens_per_s_min"] / ar["tokens_per_s_min"]
    per_call_gain = row["tokens_per_call"] / ar["tokens_per_call"]
    # a loop that appends no masks (tau = 1 one-token mode) runs 1-wide steps: its bound is the token gain alone
    one_wide = not (row["mean_decode_width"] > 1)  # also when there was no decode step at all (NaN)
    limit = per_call_gain if one_wide else per_call_gain / costs["ratio"]
    # the same bound with the widths the loop really forwarded (a sliding step re-feeds the k tokens it
    # accepted last step plus B masks, so it is k + B wide, not 1 + B), from the measured cost table
    if row["_predicted_s"] > 0 and ar["_predicted_s"] > 0:
        row["limit_w"] = (row["tokens"] / ar["tokens"]) * ar["_predicted_s"] / row["_predicted_s"]
    ar_rate_model = ar["tokens"] / ar["model_time_s"] if ar["model_time_s"] > 0 else float("nan")
    mars_rate_model = row["tokens"] / row["model_time_s"] if row["model_time_s"] > 0 else float("nan")
    row.update(
        speedup_vs_ar=speedup,
        limit=limit,
        efficiency=speedup / limit if limit > 0 else float("nan"),
        ideal=mars_rate_model / ar_rate_model,
    )


# ----------------------------------------------------------------------------------------------- output


COLUMNS = [
    ("batch", "batch_size", "{:d}"),
    ("mode", "mode", "{}"),
    ("tau", "threshold", "{:g}"),
    ("cache", "cache", "{}"),
    ("tok/fwd", "tokens_per_forward", "{:.2f}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("speedup", "speedup_vs_ar", "{:.2f}x"),
    ("(best)", "speedup_min", "{:.2f}x"),
    ("vs best plain", "speedup_vs_best_plain", "{:.2f}x"),
    ("limit", "limit", "{:.2f}x"),
    ("eff", "efficiency", "{:.0%}"),
    ("lim(w)", "limit_w", "{:.2f}x"),
    ("ideal", "ideal", "{:.2f}x"),
    ("ovh ms/step", "overhead_ms_per_step", "{:.2f}"),
    ("model ms/step", "model_ms_per_step", "{:.2f}"),
    ("=AR", "matches_ar", "{:.0%}"),
    ("acc", "accuracy", "{:.0%}"),
]


def format_table(result: dict) -> str:
    """A plain-text table of the result rows plus the step costs and the machine."""
    header = [c[0] for c in COLUMNS]
    lines = []
    for row in result["rows"]:
        cells = []
        for _, key, fmt in COLUMNS:
            v = row.get(key)
            cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
        lines.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    prev_b = None
    for row, cells in zip(result["rows"], lines):
        if prev_b is not None and row["batch_size"] != prev_b:
            out.append("")
        prev_b = row["batch_size"]
        out.append("  ".join(c.rjust(w) for c, w in zip(cells, widths)))
    bsz = result["settings"]["block_size"]
    out.append("")
    out.append(f"step costs (one cached forward, cache length ~{next(iter(result['step_costs'].values()))['past_len']}, "
               "fastest of the cost repeats):")
    for b, c in result["step_costs"].items():
        extra = "".join(f", cost({k[5:-3]}) {v:.2f} ms" for k, v in c.items() if k.startswith("cost_") and k not in ("cost_1_ms", f"cost_{1 + bsz}_ms"))
        out.append(f"  batch {b}: cost(1) {c['cost_1_ms']:.2f} ms, cost({1 + bsz}) {c[f'cost_{1 + bsz}_ms']:.2f} ms "
                   f"(ratio {c['ratio']:.2f}){extra}")
    out.append("speedup: median over repeats of the total time; (best): from each generate call's fastest repeat; "
               f"tok/s and times are medians over {result['settings']['repeats']} interleaved repeats")
    out.append("limit = (tokens per forward call, MARS/AR) x cost(1)/cost(1+B); eff = speedup/limit; "
               "lim(w) = the same with the cost of the widths actually forwarded; "
               "ideal = speed-up with zero loop overhead (in-loop model time only); ovh = loop time outside forwards")
    out.append("=AR = share of answers identical token for token to plain greedy generate's (100% for tau = 1 and "
               "verify); acc = exact-match accuracy against the prompts' reference answers (- without them)")
    m = result["machine"]
    out.append(f"machine: {m.get('cpu_model', m['processor'])}, {m['cpu_count']} CPUs, torch threads {m['torch_threads']}, "
               f"device {m['device']}{', ' + m['gpu'] if 'gpu' in m else ''}; load avg {m.get('load_average_start')} -> "
               f"{m.get('load_average_end')}; torch {m['torch']}, transformers {m.get('transformers')}")
    md = result["model"]
    out.append(f"model: {md['class']}, {md['parameters'] / 1e6:.2f}M parameters, hidden {md['hidden_size']}, "
               f"{md['num_hidden_layers']} layers, {md['dtype']}; B={bsz}, max_new_tokens={result['settings']['max_new_tokens']}")
    return "\n".join(out)


def _tqdm(**kw):
    try:
        from tqdm.auto import tqdm

        return tqdm(**kw)
    except ImportError:  # pragma: no cover
        class _Null:
            def update(self, *a):
                pass

            def set_postfix_str(self, *a):
                pass

            def close(self):
                pass

        return _Null()


# ----------------------------------------------------------------------------------------------- CLI


def add_arguments(parser):
    parser.add_argument("--model", required=True, help="Checkpoint folder (AutoModelForCausalLM + AutoTokenizer, with the MARS mask token).")
    parser.add_argument("--prompts", default=None,
                        help="Prompt file: .txt (one per line), .jsonl or .json (strings, {'prompt': ...}, {'messages': [...]}). "
                             "Default: the demo's held-out prompts if available, else a built-in list.")
    parser.add_argument("--num-prompts", type=int, default=16, help="Prompts per configuration and batch size (cycled if fewer).")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[1.0, 0.95, 0.9], help="MARS tau values.")
    parser.add_argument("--caches", nargs="+", default=["sliding", "block"], choices=list(CACHE_MODES),
                        help="MARS cache modes: sliding window, the paper's block cache, or block_trained "
                             "(block chunks fed as [accepted | B masks]).")
    parser.add_argument("--verify-thresholds", type=float, nargs="*", default=[DEFAULT_VERIFY_THRESHOLD],
                        help="tau values for lossless verify mode (none: skip verify).")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS),
                        help="What a user would run instead, timed in the same run: prompt-lookup decoding (batch 1) and "
                             "plain generate with the static cache + torch.compile (warm-up compiles; none: skip).")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=None, help="MARS B (default: the checkpoint's).")
    parser.add_argument("--cache-block", type=int, default=16, help="Block cache chunk (mars_cache_block).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed repeats; the median is reported.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed warm-up generates per configuration.")
    parser.add_argument("--cost-repeats", type=int, default=30,
                        help="Timed calls per width in the step-cost table (the fastest is kept).")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--no-chat-template", action="store_true", help="Feed text prompts raw instead of as a user turn.")
    parser.add_argument("--output", default=None, help="Write the JSON result here.")
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")


def run(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    for flag in ("num_prompts", "max_new_tokens", "repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    if not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model!r} is not a folder; pass a saved checkpoint directory.")
    from transformers import AutoConfig

    meta = getattr(AutoConfig.from_pretrained(args.model), "mars", None) or {}  # before loading any weights
    if "mask_token_id" not in meta:
        raise ValueError(f"{args.model} has no MARS mask token in config.json ('mars': {{'mask_token_id': ...}}); "
                         "train it with MARSTrainer or call hf_mars.add_mask_token first.")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    from hf_mars.generation import enable_mars

    enable_mars(model)
    prompts = load_prompts(args.prompts)
    result = benchmark_generation(
        model, tokenizer, prompts, thresholds=args.thresholds, batch_sizes=args.batch_sizes, caches=args.caches,
        verify_thresholds=args.verify_thresholds, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
        cache_block=args.cache_block, num_prompts=args.num_prompts, repeats=args.repeats, warmup=args.warmup,
        num_threads=args.threads, cost_repeats=args.cost_repeats, chat_template=False if args.no_chat_template else None, progress=not args.quiet,
        peers=tuple(args.peers),
    )
    result["settings"]["model_path"] = str(args.model)
    result["settings"]["prompts_path"] = args.prompts
    print(format_table(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2, default=_json_default) + "\n")
        print(f"wrote {args.output}")
    return 0


def _json_default(o):
    if torch.is_tensor(o):
        return o.tolist()
    if hasattr(o, "to_dict"):  # e.g. a CompileConfig among the generate arguments
        return o.to_dict()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
