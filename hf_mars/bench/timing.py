"""The one timing harness (`hf-mars bench` and `hf-mars demo`): what a generate call cost, and on what.

- `ForwardRecorder` counts and times the model's forward calls inside ``generate`` (hooks, no change to the model);
- `measure_step_costs` times one cached forward of ``w`` new positions, the ``cost(w)`` of the speed-up limit;
- `time_interleaved` times named generate settings batch by batch in rotating order, so a shared, noisy machine
  slows every setting alike;
- `machine_info` records the machine a figure was measured on.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import torch

__all__ = ["ForwardRecorder", "count_emitted", "machine_info", "measure_step_cost", "measure_step_costs",
           "time_interleaved"]


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

    A compiled forward (``model.get_compiled_call``, what generate uses with a compile config, and MARS's
    ``compiled_decode_call``) traces the module hooks into its graph, where a clock or a counter would be a
    constant or a guard (a recompile per call): the hooks do nothing while Dynamo traces, and the compiled call
    itself is counted and timed from outside.
    """

    def __init__(self, model, sync: bool = False):
        self.model = model
        self.sync = sync
        self.handles = []
        self._wrapped = {}  # id(compiled call) -> (the compiled call, the counting wrapper around it)
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

    def _counted(self, compiled):
        """The compiled call, counted and timed from outside (one wrapper per compiled call)."""
        wrapped = self._wrapped.get(id(compiled))
        if wrapped is None or wrapped[0] is not compiled:
            def call(*args, **kwargs):
                for which in self._targets:
                    self._start(which, args, kwargs)
                try:
                    return compiled(*args, **kwargs)
                finally:
                    for which in self._targets:
                        self._stop(which)

            wrapped = self._wrapped[id(compiled)] = (compiled, call)
        return wrapped[1]

    def _get_compiled_call(self, compile_config):
        return self._counted(type(self.model).get_compiled_call(self.model, compile_config))

    def _compiled_decode_call(self, model, compile_config):
        compiled = self._original_decode_call(model, compile_config)
        return self._counted(compiled) if model is self.model else compiled

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
        from hf_mars.generation import model_calls as mars_calls  # MARS's compiled decode steps: counted alike

        self._original_decode_call = mars_calls.compiled_decode_call
        mars_calls.compiled_decode_call = self._compiled_decode_call
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        self.model.__dict__.pop("get_compiled_call", None)
        from hf_mars.generation import model_calls as mars_calls

        mars_calls.compiled_decode_call = self._original_decode_call
        self._wrapped = {}

    @property
    def calls(self) -> int:
        return self.dec_calls

    @property
    def model_time(self) -> float:
        return self.top_time if self.top_calls else self.dec_time


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

    from hf_mars.generation._compat import record_sliding_past
    from hf_mars.generation.cache import has_sliding_layers

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
    sliding = has_sliding_layers(cache)  # (a window's pushed-out columns are kept until the crop, as in decoding)
    for i in range(repeats + 2):
        for w in widths:
            if sliding:
                record_sliding_past(cache)
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

