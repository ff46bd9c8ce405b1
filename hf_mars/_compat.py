"""Every private API of transformers and TRL that hf-mars relies on, in one place.

Each accessor says what it reads and why no public API does the job, and a test checks each one against the
installed versions (`tests/test_compat.py`; the `transformers serve` part, below, `tests/test_serve_contract.py`),
so an upgrade that moves one fails loudly there instead of silently elsewhere. (`hf_mars/generation/` ships
standalone inside checkpoints, so it cannot import this module.)
"""

from __future__ import annotations

import inspect

# TRL's fused LM-head forward (``model(..., fused_lm_head=True, shift_labels=...)``) returns these per-token fields
# instead of logits; the MARS loss and metrics read them.
FUSED_OUTPUT_FIELDS = ("log_probs", "is_top1", "entropy")


def attn_implementation(config) -> str:
    """The attention backend a loaded model uses (``config._attn_implementation``; transformers documents it, but
    it has no public getter)."""
    return getattr(config, "_attn_implementation", None) or "eager"


def router_logits_recorder(model):
    """``(module class, output index)`` transformers hooks to collect router logits (``_can_record_outputs``), or
    None for a dense model. MARS records them itself to compute the MoE loss on the clean stream only."""
    base = getattr(model, "model", model)
    recorder = (getattr(type(base), "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    return None if target is None else (target, getattr(recorder, "index", 0))


def trl_metrics(trainer, mode: str) -> dict:
    """SFTTrainer's per-mode metric store (``_metrics``), which its ``log`` averages and reports."""
    return trainer._metrics[mode]


def trl_count_train_tokens(trainer, tokens: int) -> int:
    """Add to SFTTrainer's ``num_tokens`` counter (``_total_train_tokens``, divided by its ``_tp_size``) and return it."""
    trainer._total_train_tokens += int(tokens) // trainer._tp_size
    return trainer._total_train_tokens


def keep_generation_extras(generation_config) -> None:
    """A generation config flagged as derived from the model config (``_from_model_config``) drops unknown
    attributes — the MARS defaults — when loaded; clear the flag before saving."""
    generation_config._from_model_config = False


def compile_on_any_device(compile_config):
    """Let ``generate`` compile the forward on CPU too (``CompileConfig._compile_all_devices``; transformers keeps
    auto-compilation to accelerators otherwise)."""
    compile_config._compile_all_devices = True
    return compile_config


def load_balancing_loss(model):
    """A MoE model's own router load-balancing loss (``load_balancing_loss_func`` of its modeling module; transformers
    exports no public one). MARSTrainer applies it to the clean stream's router logits only."""
    import sys

    return getattr(sys.modules[type(model).__module__], "load_balancing_loss_func")


def trl_lm_collator():
    """TRL's ``DataCollatorForLanguageModeling``, SFTTrainer's default collator, which `MARSDataCollator` extends and
    `MARSTrainer` replaces; TRL exports it only from ``trl.trainer.sft_trainer``."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling


def trl_load_model(model_id: str, args, quantization_config=None):
    """Load a model given by name as SFTTrainer does (``trl.trainer.utils.create_model_from_path`` with
    ``args.model_init_kwargs``); return ``(model, revision)``.

    SFTTrainer loads a named model inside ``__init__`` and hands it to PEFT a few lines later, with no overridable
    method in between, while the mask token must be in the embeddings before PEFT wraps them. So `MARSTrainer` loads
    the model here first and gives SFTTrainer the instance; ``args.model_init_kwargs`` is consumed (SFTTrainer would
    warn that it is ignored for an instance)."""
    from transformers import set_seed
    from trl.trainer.utils import create_model_from_path

    set_seed(args.seed)  # as SFTTrainer: a PEFT adapter is initialised at random right after
    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs["device_map"] = None  # a device map of "auto" fails under a distributed launcher
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    model = create_model_from_path(model_id, **kwargs)
    args.model_init_kwargs = None
    return model, kwargs.get("revision")


def trl_processing_class(model, args, revision=None):
    """The processing class SFTTrainer loads when none is given: ``AutoProcessor`` of the model's name or path
    (``trl.trainer.utils.get_config_model_id``). The mask token goes into it before SFTTrainer sees it."""
    from transformers import AutoProcessor
    from trl.trainer.utils import get_config_model_id

    return AutoProcessor.from_pretrained(get_config_model_id(model.config), revision=revision,
                                         trust_remote_code=args.trust_remote_code)


# ============================================================================================= transformers serve
# Every part of `transformers serve` (``transformers.cli.serving``) that `hf-mars serve` touches, in one place.
#
# We reuse its request handlers (chat templates, response parsers for tools and reasoning, the OpenAI response
# objects, SSE chunks) and its model manager, and override four of their private methods: ``handle_request`` (so
# templating and tokenizing run off the event loop and every length is checked before a request is queued),
# ``_resolve_model`` (the served model name, never its local path), ``_build_generation_config`` (OpenAI's
# sampling semantics, the seed per call) and ``ModelManager._load_model`` (MARS switched on). The batching manager
# reads a streamer's cancellation flag and writes errors into its queue.
#
# Tested with transformers ``TESTED_TRANSFORMERS`` (the floor and the latest release); `tests/test_serve_contract.py`
# checks every name and signature used here, so a release that moves one fails there with the name, not elsewhere.


TESTED_TRANSFORMERS = ("5.17.0", "5.24.0")
# what transformers' SSE generators write for a `_StreamError` (unescaped): `data: {"error": "<message>"}`
STREAM_ERROR_PREFIX = 'data: {"error": '


# the private methods of transformers serve we call or override, with the parameters we rely on (leading ones)
SERVE_SIGNATURES = {
    ("utils", "BaseHandler", "__init__"): ["self", "model_manager", "generation_state"],
    ("utils", "BaseHandler", "_resolve_model"): ["self", "body"],
    ("utils", "BaseHandler", "_build_generation_config"): ["self", "body", "model_generation_config", "use_cb"],
    ("utils", "BaseHandler", "get_processor_inputs_from_messages"): ["messages", "modality"],
    ("chat_completion", "ChatCompletionHandler", "_streaming"): [
        "self", "request_id", "model", "processor", "model_id", "inputs", "gen_config", "gen_manager"],
    ("chat_completion", "ChatCompletionHandler", "_non_streaming"): [
        "self", "request_id", "model", "processor", "model_id", "inputs", "gen_config", "gen_manager"],
    ("completion", "CompletionHandler", "_streaming"): [
        "self", "request_id", "model", "processor", "model_id", "inputs", "gen_config", "gen_manager", "suffix"],
    ("completion", "CompletionHandler", "_non_streaming"): [
        "self", "request_id", "model", "processor", "model_id", "inputs", "gen_config", "gen_manager", "suffix"],
    ("response", "ResponseHandler", "_streaming"): [
        "self", "request_id", "model", "processor", "model_id", "body", "inputs", "gen_config", "gen_manager"],
    ("response", "ResponseHandler", "_non_streaming"): [
        "self", "request_id", "model", "processor", "model_id", "body", "inputs", "gen_config", "gen_manager"],
    ("response", "ResponseHandler", "_normalize_input"): ["body"],
    ("response", "ResponseHandler", "_normalize_tools"): ["tools"],
}
# `model_manager` passes these keywords to ModelManager and reads these of its methods
SERVE_MANAGER_ARGS = {"device", "dtype", "force_model", "model_timeout", "trust_remote_code"}
SERVE_MANAGER_METHODS = ("_load_model", "load_model_and_processor", "process_model_name", "shutdown",
                         "get_model_modality")


def _serving_attr(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(f"transformers.cli.serving.{module}"), name)


def serve_contract_problems() -> list[str]:
    """What of transformers serve's internals, as `hf-mars serve` uses them, the installed transformers lacks
    (empty: all there). `tests/test_serve_contract.py` asserts it empty on the tested versions; `hf-mars serve`
    refuses to start on a non-empty list (`serve_refusal`) rather than fail on the first request."""
    import inspect

    problems = []
    for (module, cls_name, name), params in SERVE_SIGNATURES.items():
        try:
            fn = getattr(_serving_attr(module, cls_name), name, None)
        except (ImportError, AttributeError) as e:
            problems.append(f"transformers.cli.serving.{module}.{cls_name}: {e}")
            continue
        got = None if fn is None else list(inspect.signature(fn).parameters)
        if got is None or got[:len(params)] != params:
            problems.append(f"{cls_name}.{name}{tuple(params)} -> {got}")
    try:
        manager = _serving_attr("model_manager", "ModelManager")
    except (ImportError, AttributeError) as e:
        return problems + [f"transformers.cli.serving.model_manager.ModelManager: {e}"]
    missing = sorted(SERVE_MANAGER_ARGS - set(inspect.signature(manager.__init__).parameters))
    gone = [m for m in SERVE_MANAGER_METHODS if not hasattr(manager, m)]
    return problems + ([f"ModelManager.__init__ lacks {missing}"] if missing else []) \
        + ([f"ModelManager lacks {gone}"] if gone else [])


def _tested_range() -> str:
    return f"{TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[1].rsplit('.', 1)[0]}.x"


def serve_refusal() -> str | None:
    """Why `hf-mars serve` cannot run on the installed transformers (None: it can): what moved and what to
    install."""
    moved = serve_contract_problems()
    if not moved:
        return None
    import transformers

    major, minor = TESTED_TRANSFORMERS[1].split(".")[:2]
    return (f"hf-mars serve builds on transformers serve's internals, which transformers {transformers.__version__} "
            f"changed ({'; '.join(moved[:3])}{'; ...' if len(moved) > 3 else ''}). It is tested with transformers "
            f"{_tested_range()}: pip install 'transformers>={TESTED_TRANSFORMERS[0]},<{major}.{int(minor) + 1}' "
            "(the serve extra pins it). MARS decoding itself (generate(..., mars=True)) and training are not "
            "affected.")


def untested_version() -> str | None:
    """A warning when the installed transformers is outside ``TESTED_TRANSFORMERS`` (None inside)."""
    import transformers
    from packaging.version import Version

    low, high = (Version(v) for v in TESTED_TRANSFORMERS)
    installed = Version(transformers.__version__)
    if low <= installed and installed.release[:2] <= high.release[:2]:
        return None
    return (f"hf-mars serve is tested with transformers {_tested_range()}; "
            f"{installed} is installed: its serving internals may have moved (tests/test_serve_contract.py checks)")


# --------------------------------------------------------------------------------------------- streamers
def make_streamer(processor, loop, queue, response_parser=None):
    """transformers' `DirectStreamer`: decodes token ids incrementally into ``queue`` on ``loop``."""
    from transformers.cli.serving.utils import DirectStreamer

    tokenizer = getattr(processor, "tokenizer", processor)
    return DirectStreamer(tokenizer._tokenizer, loop, queue, response_parser=response_parser)


def stream_cancelled(streamer) -> bool:
    """Whether the client of a stream went away (the handler sets ``_cancelled`` on disconnect)."""
    return streamer._cancelled.is_set()


def stream_fail(streamer, message: str) -> None:
    """End a stream with an error item; the handler turns it into a ``STREAM_ERROR_PREFIX`` line."""
    from transformers.cli.serving.utils import _StreamError

    streamer._enqueue(_StreamError(message))


def generation_cancelled_error():
    """The exception a cancelled streamer raises from ``put``."""
    from transformers.cli.serving.utils import _GenerationCancelled

    return _GenerationCancelled


# --------------------------------------------------------------------------------------------- model manager
def model_manager(model: str, *, device: str, dtype: str, trust_remote_code: bool, prepare):
    """transformers' `ModelManager` serving ``model`` only, never unloading it, ``prepare(model)`` on load."""
    from transformers.cli.serving.model_manager import ModelManager

    class MARSModelManager(ModelManager):
        def _load_model(self, *args, **kwargs):
            return prepare(super()._load_model(*args, **kwargs))

    return MARSModelManager(device=device, dtype=dtype, trust_remote_code=trust_remote_code, force_model=model,
                            model_timeout=-1)


# --------------------------------------------------------------------------------------------- handlers
def handler_classes():
    """``{"chat": ..., "completion": ..., "response": ...}``: transformers' handlers with our four overrides.

    Each subclass is built by `_handler` around two small hooks: how a validated body becomes model inputs
    (run in a worker thread) and how the inputs are dispatched to the base class's streaming / non-streaming path.
    """
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler

    def chat_inputs(self, body, model, processor):
        modality = self.model_manager.get_model_modality(model, processor=processor)
        messages = self.get_processor_inputs_from_messages(body["messages"], modality)
        return processor.apply_chat_template(messages, add_generation_prompt=True, tools=body.get("tools"),
                                             return_tensors="pt", return_dict=True, tokenize=True,
                                             **(body.get("chat_template_kwargs") or {}))

    def chat_dispatch(self, request_id, model, processor, model_id, body, inputs, gc, manager):
        run = self._streaming if body.get("stream") else self._non_streaming
        return run(request_id, model, processor, model_id, inputs, gc, gen_manager=manager,
                   **_if_accepted(run, tools=body.get("tools")))

    def completion_inputs(self, body, model, processor):
        return getattr(processor, "tokenizer", processor)(body["prompt"], return_tensors="pt")

    def completion_dispatch(self, request_id, model, processor, model_id, body, inputs, gc, manager):
        run = self._streaming if body.get("stream") else self._non_streaming
        return run(request_id, model, processor, model_id, inputs, gc, manager, body.get("suffix"))

    def response_inputs(self, body, model, processor):
        modality = self.model_manager.get_model_modality(model, processor=processor)
        messages = self.get_processor_inputs_from_messages(self._normalize_input(body), modality)
        return processor.apply_chat_template(messages, add_generation_prompt=True,
                                             tools=self._normalize_tools(body.get("tools")), return_tensors="pt",
                                             return_dict=True, tokenize=True,
                                             **(body.get("chat_template_kwargs") or {}))

    def response_dispatch(self, request_id, model, processor, model_id, body, inputs, gc, manager):
        run = self._streaming if body.get("stream", True) else self._non_streaming
        return run(request_id, model, processor, model_id, body, inputs, gc, gen_manager=manager,
                   **_if_accepted(run, tools=self._normalize_tools(body.get("tools"))))

    return {"chat": _handler(ChatCompletionHandler, chat_inputs, chat_dispatch),
            "completion": _handler(CompletionHandler, completion_inputs, completion_dispatch),
            "response": _handler(ResponseHandler, response_inputs, response_dispatch)}


def _if_accepted(fn, **kwargs) -> dict:
    """The keyword arguments ``fn`` takes (``tools=`` arrived in transformers 5.2x)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _handler(base, inputs_fn, dispatch_fn):
    class Handler(base):
        """``base`` with every request checked before it is queued (see `hf_mars.serve.requests`)."""

        def __init__(self, *args, served_name: str, admit, **kwargs):
            super().__init__(*args, **kwargs)
            # admit: the server's `Admission` (length limits, sampling fields, the worker threads)
            self.served_name, self.admit = served_name, admit

        async def handle_request(self, body: dict, request_id: str):
            def prepare():  # model loading, the chat template (it may be slow) and the tokenizer: off the loop
                _, model, processor = self._resolve_model(body)
                return model, processor, inputs_fn(self, body, model, processor)

            model, processor, inputs = await self.admit.run_off_loop(prepare)
            max_new = self.admit.max_new_tokens(body, model, inputs["input_ids"].shape[-1])
            inputs = inputs.to(model.device)
            gc = self._build_generation_config(body, model.generation_config)
            gc.max_new_tokens = max_new
            manager = self.generation_state.get_manager(self.served_name)
            result = dispatch_fn(self, request_id, model, processor, self.served_name, body, inputs, gc, manager)
            return await result if inspect.isawaitable(result) else result

        def _resolve_model(self, body):
            mm = self.model_manager
            model, processor = mm.load_model_and_processor(mm.process_model_name(mm.force_model))
            return self.served_name, model, processor

        def _build_generation_config(self, body, model_generation_config, use_cb=False):
            # OpenAI's sampling fields and the seed are applied by `Admission.sampling` (the seed on the decode
            # thread, right before its own generate call: transformers would seed the global generator here, on
            # the event loop, under every other request)
            passed = {k: v for k, v in body.items() if k not in ("seed", "temperature", "top_p")}
            gc = super()._build_generation_config(passed, model_generation_config, use_cb=use_cb)
            return self.admit.sampling(gc, body)

    Handler.__name__ = Handler.__qualname__ = f"MARS{base.__name__}"
    return Handler
