"""The transformers internals the MARS decoder touches, checked against the installed versions.

A failure here means an upgrade moved one: fix `hf_mars/generation/_compat.py` (the one module of the shipped
decoder that reads them), nowhere else. The last test keeps it that way: no other module of generation/ reads a
private name it does not define itself.
"""

import ast
import inspect
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer, StaticLayer
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc

from hf_mars.generation import _compat

GENERATION = Path(_compat.__file__).parent


def _moved(checks) -> list:
    """The names of the checks that fail (a check raising counts as failing: the attribute is gone)."""
    moved = []
    for name, check in checks.items():
        try:
            ok = check()
        except Exception as error:  # noqa: BLE001 - any failure means the internal moved
            ok = f"{type(error).__name__}: {error}"
        if ok is not True:
            moved.append(f"{name}" + ("" if ok is False else f" ({ok})"))
    return moved


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def test_model_and_compile_internals():
    model = _tiny_model()
    config = model._default_compile_config() if hasattr(model, "_default_compile_config") else None
    checks = {
        "config._attn_implementation": lambda: isinstance(model.config._attn_implementation, str)
        and _compat.attn_implementation(model.config) == model.config._attn_implementation,
        "model._default_compile_config()": lambda: type(_compat.default_compile_config(model)).__name__
        == "CompileConfig",
        "CompileConfig._compile_all_devices": lambda: hasattr(config, "_compile_all_devices")
        and _compat.compiles_on_any_device(config) is bool(config._compile_all_devices),
        "get_compiled_call's uncompiled model types": lambda: all(
            name in inspect.getsource(PreTrainedModel.get_compiled_call) for name in _compat.UNCOMPILED_MODEL_TYPES),
        "torch._dynamo.eval_frame._stance": lambda: _compat.compile_stance_is_default() is True,
        "nn.Module._modules": lambda: isinstance(model._modules, dict) and _swap_restores(model),
        "torch.utils._functools._prefetch_executor._threads": _prefetch_workers_are_helpers,
        "torch._inductor.async_compile.AsyncCompile.pool()._threads": _async_compile_workers_are_helpers,
    }
    moved = _moved(checks)
    assert not moved, (f"transformers {transformers.__version__} / torch {torch.__version__} moved what "
                       "hf_mars/generation/_compat.py reads:\n" + "\n".join(moved))


def _prefetch_workers_are_helpers() -> bool:
    """torch's prefetch executor (used by torch.compile in torch 2.15) keeps non-daemon workers alive: they must be
    recognised, or compiled steps in any process that compiled before check every guard (`forward._alone`)."""
    from torch.utils import _functools

    return _workers_are_helpers(_functools._prefetch_executor)


def _async_compile_workers_are_helpers() -> bool:
    """inductor's async-compile thread pool (``AsyncCompile.pool()``, cached for the process; used when its worker
    processes are not ready yet) keeps non-daemon workers alive: they must be recognised too."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    if get_compile_threads() <= 1:  # inductor keeps no such pool with one compile thread
        return hasattr(AsyncCompile.pool, "cache_info")
    return _workers_are_helpers(AsyncCompile.pool())


def _workers_are_helpers(pool) -> bool:
    """Whether the started workers of ``pool`` (a ThreadPoolExecutor) are among `_compat.torch_helper_threads()`."""
    pool.submit(lambda: None).result()
    return bool(pool._threads) and pool._threads <= _compat.torch_helper_threads()


def _swap_restores(model) -> bool:
    head = model.get_output_embeddings()
    name = next(n for n, child in model.named_children() if child is head)
    _compat.swap_child(model, name, torch.nn.Identity())
    swapped = isinstance(getattr(model, name), torch.nn.Identity)
    _compat.swap_child(model, name, head)
    return swapped and getattr(model, name) is head


def test_cache_layer_internals():
    static = StaticLayer(max_cache_len=8)
    keys = torch.zeros(1, 2, 3, 4)

    def static_layer():
        assert _compat.static_capacity(static) == 8 and static.is_initialized is False
        assert _compat.resize_unallocated_static([static], 16) and _compat.static_capacity(static) == 16
        static.update(keys, keys.clone())
        assert static.keys.shape[2] == 16, "an unallocated layer allocates max_cache_len positions"
        assert _compat.resize_unallocated_static([static], 32) is False, "an allocated layer is not resized"
        before = int(static.cumulative_length)
        _compat.shift_static_length(static, 1)
        return int(static.cumulative_length) == before - 1 and _compat.is_static(static)

    def dynamic_layer():
        cache = DynamicCache()
        cache.update(keys, keys.clone(), 0)
        layer = cache.layers[0]
        got = _compat.layer_tensors(layer)
        _compat.set_layer_tensors(layer, got[0][:, :, :1], got[1][:, :, :1])
        return cache.get_seq_length() == 1 and _compat.layer_tensors(layer)[0] is layer.keys

    def sliding_past():
        return callable(getattr(DynamicSlidingWindowLayer, "activate_past_recording", None)) and callable(
            getattr(DynamicCache, "activate_past_recording", None))

    def window_layer():  # a compacted window layer's mask sizes follow its cumulative_length
        layer = DynamicSlidingWindowLayer(sliding_window=8)
        layer.update(keys, keys.clone())
        _compat.set_layer_tensors(layer, keys[:, :, :2], keys[:, :, :2].clone())
        return layer.get_seq_length() == 2 and layer.get_mask_sizes(1) == (3, 0)

    moved = _moved({"StaticLayer.max_cache_len / is_initialized / cumulative_length": static_layer,
                    "DynamicLayer.keys / values": dynamic_layer,
                    "DynamicSlidingWindowLayer.cumulative_length / get_mask_sizes": window_layer,
                    "activate_past_recording": sliding_past,
                    "an empty layer reads as None": lambda: _compat.layer_tensors(DynamicCache().layers[0]
                                                                                  if DynamicCache().layers else
                                                                                  StaticLayer(4)) is None})
    assert not moved, (f"transformers {transformers.__version__} moved the cache internals "
                       "hf_mars/generation/_compat.py reads:\n" + "\n".join(moved))


def test_processor_and_criteria_attributes():
    moved = _moved({
        "SuppressTokensLogitsProcessor.suppress_tokens": lambda: _compat.suppressed_ids(
            lp.SuppressTokensLogitsProcessor([3, 5])).tolist() == [3, 5],
        "EosTokenCriteria.eos_token_id": lambda: _compat.criterion_eos_ids(sc.EosTokenCriteria(7)).tolist() == [7],
        "MaxLengthCriteria.max_length": lambda: _compat.criterion_max_length(sc.MaxLengthCriteria(12)) == 12,
    })
    assert not moved, "transformers moved what hf_mars/generation/_compat.py reads:\n" + "\n".join(moved)


def _private_names_defined_here() -> set:
    names = set()
    for path in GENERATION.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def test_no_other_generation_module_reads_a_private_name():
    """Private attributes (``x._name``, ``getattr(x, "_name")``) and hard-coded model types are read in
    `_compat.py` only; the decoder's own private names (and its ``_mars*`` attributes on the model) are its own."""
    own = _private_names_defined_here()
    found = []
    for path in sorted(GENERATION.glob("*.py")):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else (
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
            if not name or " " in name:
                continue
            private = name.startswith("_") and not name.startswith("__") and name not in own
            if (private and not name.startswith("_mars")) or name in _compat.UNCOMPILED_MODEL_TYPES:
                found.append(f"{path.name}:{node.lineno} {name}")
    assert not found, "read these through hf_mars/generation/_compat.py:\n" + "\n".join(found)
