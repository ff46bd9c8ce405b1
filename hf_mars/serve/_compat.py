"""Every part of `transformers serve` (``transformers.cli.serving``) that `hf-mars serve` touches, in one module.

We reuse its request handlers (chat templates, response parsers for tools and reasoning, the OpenAI response
objects, SSE chunks) and its model loading, and replace how a handler reaches the model: every request goes to our
in-flight batching manager (`hf_mars.serve.batching`), in this process. Our handlers override ``handle_request``
(templating and tokenizing off the event loop, every length checked before a request is queued, the served name
never the local path, OpenAI's sampling semantics, the seed applied on the decode thread).

transformers serve comes in two generations, told apart by what the installed release has (``EngineClient``),
never by its version string:

- **in-process** (5.17 to 5.24): handlers take ``(model, processor, model_id, inputs, gen_config, gen_manager)``;
  a ``ModelManager`` loads the model; a ``DirectStreamer`` decodes a stream's tokens from any thread.
- **engine** (5.25): handlers take an ``engine`` (transformers' ``EngineClient``: the model in a process of its
  own) and ``generation_kwargs``; a ``ModelLoader`` loads the model; a ``Detokenizer`` decodes on the event loop.
  We hand the handlers `_Engine`, an in-process engine with the fields they read, which queues the request on the
  batching manager.

`tests/test_serve_contract.py` checks every name, signature and engine field used here against the installed
release (`serve_contract_problems`), and `hf-mars serve` refuses to start where one moved (`serve_refusal`).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import re
import threading

TESTED_TRANSFORMERS = ("5.17.0", "5.25.0")
# what transformers' SSE generators write for a `_StreamError`: `data: {"error": "<message>"}`
STREAM_ERROR_PREFIX = 'data: {"error": '

# The private methods we call or override, with the parameters we rely on (leading ones), per generation
IN_PROCESS_SIGNATURES = {
    ("utils", "BaseHandler", "__init__"): ["self", "model_manager", "generation_state"],
    ("utils", "BaseHandler", "_build_generation_config"): ["self", "body", "model_generation_config", "use_cb"],
    ("utils", "BaseHandler", "get_processor_inputs_from_messages"): ["messages", "modality"],
    ("utils", "DirectStreamer", "__init__"): ["self", "tokenizer", "loop", "queue", "response_parser"],
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
    ("model_manager", "ModelManager", "__init__"): ["self", "device", "dtype", "trust_remote_code"],
    ("model_manager", "ModelManager", "load_model_and_processor"): ["self", "model_id_and_revision"],
    ("model_manager", "ModelManager", "process_model_name"): ["model_id"],
    ("model_manager", "ModelManager", "get_model_modality"): ["model", "processor"],
    ("model_manager", "ModelManager", "shutdown"): ["self"],
}
ENGINE_SIGNATURES = {
    ("utils", "BaseHandler", "__init__"): ["self", "model_manager", "generation_state"],
    ("utils", "BaseHandler", "_build_generation_kwargs"): ["self", "body", "model_generation_config"],
    ("utils", "BaseHandler", "render_messages"): ["self", "engine", "messages", "body"],
    ("utils", "BaseHandler", "_normalize_tools"): ["tools"],
    ("utils", "Detokenizer", "__init__"): ["self", "tokenizer", "queue", "response_parser"],
    ("utils", "Detokenizer", "put_token"): ["self", "token_id"],
    ("utils", "Detokenizer", "end"): ["self"],
    ("chat_completion", "ChatCompletionHandler", "_streaming"): [
        "self", "request_id", "engine", "inputs", "generation_kwargs", "tools", "stream_options"],
    ("chat_completion", "ChatCompletionHandler", "_non_streaming"): [
        "self", "request_id", "engine", "inputs", "generation_kwargs", "tools"],
    ("completion", "CompletionHandler", "_streaming"): [
        "self", "request_id", "engine", "inputs", "generation_kwargs", "suffix", "stream_options"],
    ("completion", "CompletionHandler", "_non_streaming"): [
        "self", "request_id", "engine", "inputs", "generation_kwargs", "suffix"],
    ("response", "ResponseHandler", "_streaming"): [
        "self", "request_id", "engine", "body", "inputs", "generation_kwargs"],
    ("response", "ResponseHandler", "_non_streaming"): [
        "self", "request_id", "engine", "body", "inputs", "generation_kwargs"],
    ("response", "ResponseHandler", "_normalize_input"): ["body"],
    ("model_manager", "ModelLoader", "__init__"): ["self", "device", "dtype", "trust_remote_code"],
    ("model_manager", "ModelLoader", "load_model_and_processor"): ["self", "model_id"],
    ("model_manager", "ModelLoader", "get_model_modality"): ["config", "processor"],
}
# keyword parameters we pass, wherever they are in the signature
KEYWORDS = {("model_manager", "ModelManager", "__init__"): {"force_model", "model_timeout"}}
# the modules whose handlers read an engine's fields (`engine.<name>`): every one must be an `_Engine` field
ENGINE_READERS = ("utils", "chat_completion", "completion", "response")


def _serving(module: str):
    return importlib.import_module(f"transformers.cli.serving.{module}")


def engine_generation() -> bool:
    """Whether the installed transformers serve is the engine generation (5.25 on), not the in-process one."""
    return hasattr(_serving("model_manager"), "EngineClient")


def serve_contract_problems() -> list[str]:
    """What of transformers serve's internals, as `hf-mars serve` uses them, the installed transformers lacks
    (empty: all there). `tests/test_serve_contract.py` asserts it empty on the tested versions; `hf-mars serve`
    refuses to start on a non-empty list (`serve_refusal`) rather than fail on the first request."""
    try:
        engine = engine_generation()
    except ImportError as e:
        return [f"transformers.cli.serving: {e}"]
    problems = []
    for (module, cls_name, name), params in (ENGINE_SIGNATURES if engine else IN_PROCESS_SIGNATURES).items():
        try:
            fn = getattr(getattr(_serving(module), cls_name), name, None)
        except (ImportError, AttributeError) as e:
            problems.append(f"transformers.cli.serving.{module}.{cls_name}: {e}")
            continue
        got = None if fn is None else list(inspect.signature(fn).parameters)
        keywords = KEYWORDS.get((module, cls_name, name), set())
        if got is None or got[:len(params)] != params or not keywords <= set(got):
            problems.append(f"{cls_name}.{name}{tuple(params)} -> {got}")
    if engine:
        read = set()
        for module in ENGINE_READERS:
            read |= set(re.findall(r"\bengine\.(\w+)", inspect.getsource(_serving(module))))
        unknown = sorted(read - _Engine.FIELDS)
        if unknown:
            problems.append(f"the handlers read engine fields hf-mars's engine lacks: {unknown}")
    return problems


def _tested_range() -> str:
    return f"{TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[1].rsplit('.', 1)[0]}.x"


def _pin() -> str:
    major, minor = TESTED_TRANSFORMERS[1].split(".")[:2]
    return f"transformers>={TESTED_TRANSFORMERS[0]},<{major}.{int(minor) + 1}"


def serve_refusal() -> str | None:
    """Why `hf-mars serve` cannot run on the installed transformers (None: it can): what moved and what to
    install."""
    moved = serve_contract_problems()
    if not moved:
        return None
    import transformers

    return (f"hf-mars serve builds on transformers serve's internals, which transformers {transformers.__version__} "
            f"changed ({'; '.join(moved[:3])}{'; ...' if len(moved) > 3 else ''}). It is tested with transformers "
            f"{_tested_range()}: pip install '{_pin()}' (the serve extra pins it). MARS decoding itself "
            "(generate(..., mars=True)) and training are not affected.")


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
class _LoopDetokenizer:
    """The engine generation's `Detokenizer` (it lives on the event loop), fed from the decode thread, with the
    in-process generation's `DirectStreamer` interface: the first ``put`` is the prompt (skipped), each next one a
    tensor of new tokens; ``end``; a cancellation flag, which makes ``put`` raise. The handlers read
    ``total_tokens`` once the stream has ended and call ``cancel`` when it closes."""

    def __init__(self, detokenizer, loop, queue):
        self.detokenizer, self.loop, self.queue = detokenizer, loop, queue
        self._cancelled = threading.Event()
        self._prompt_skipped = False

    @property
    def total_tokens(self) -> int:
        return self.detokenizer.total_tokens

    def put(self, value) -> None:
        if self._cancelled.is_set():
            raise generation_cancelled_error()()
        if not self._prompt_skipped:
            self._prompt_skipped = True
            return
        self.loop.call_soon_threadsafe(self._put_ids, value.reshape(-1).tolist())

    def _put_ids(self, ids) -> None:
        for token_id in ids:
            self.detokenizer.put_token(token_id)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.detokenizer.end)

    def fail(self, message: str) -> None:
        from transformers.cli.serving.utils import _StreamError

        self.loop.call_soon_threadsafe(self.queue.put_nowait, _StreamError(message))

    def cancel(self) -> None:
        self._cancelled.set()


def make_streamer(processor, loop, queue, response_parser=None):
    """A streamer decoding a request's token ids incrementally into ``queue`` (on ``loop``), fed from any thread."""
    tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
    if engine_generation():
        from transformers.cli.serving.utils import Detokenizer

        return _LoopDetokenizer(Detokenizer(tokenizer, queue, response_parser=response_parser), loop, queue)
    from transformers.cli.serving.utils import DirectStreamer

    return DirectStreamer(tokenizer, loop, queue, response_parser=response_parser)


def stream_cancelled(streamer) -> bool:
    """Whether the client of a stream went away (the handler sets ``_cancelled`` when the stream closes early)."""
    return streamer._cancelled.is_set()


def stream_fail(streamer, message: str) -> None:
    """End a stream with an error item; the handler turns it into a ``STREAM_ERROR_PREFIX`` line."""
    if isinstance(streamer, _LoopDetokenizer):
        return streamer.fail(message)
    from transformers.cli.serving.utils import _StreamError

    streamer._enqueue(_StreamError(message))


def generation_cancelled_error():
    """The exception a cancelled in-process streamer raises from ``put`` (the engine one never raises)."""
    from transformers.cli.serving.utils import _GenerationCancelled

    return _GenerationCancelled


# --------------------------------------------------------------------------------------------- the model
class ServedModel:
    """The one model `hf-mars serve` serves, loaded by transformers' loader with the server's device and dtype,
    ``prepare``d (MARS switched on), loaded at start-up (no request pays for it), never unloaded on a timer."""

    def __init__(self, model: str, *, device: str, dtype: str, trust_remote_code: bool, prepare):
        self.name, self.prepare = model, prepare
        self._lock, self._loaded = threading.Lock(), None
        options = dict(device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        if engine_generation():
            self.loader = _serving("model_manager").ModelLoader(**options)
        else:  # its ModelManager caches the model; model_timeout=-1: never unloaded
            self.loader = _serving("model_manager").ModelManager(**options, force_model=model, model_timeout=-1)
        self.load()

    def load(self):
        """``(model, processor)``, loading them again after `unload`."""
        with self._lock:
            if self._loaded is None:
                if isinstance(self.loader, _serving("model_manager").ModelManager):
                    model, processor = self.loader.load_model_and_processor(self.loader.process_model_name(self.name))
                else:
                    model, processor = self.loader.load_model_and_processor(self.name)
                self._loaded = self.prepare(model), processor
            return self._loaded

    def unload(self) -> None:
        """Free the model (the next request loads it again)."""
        with self._lock:
            self._loaded = None
            if hasattr(self.loader, "shutdown"):
                self.loader.shutdown()

    def modality(self, model, processor):
        if isinstance(self.loader, _serving("model_manager").ModelManager):
            return self.loader.get_model_modality(model, processor=processor)
        return self.loader.get_model_modality(model.config, processor=processor)


class _Engine:
    """One request's view of the served model, as the engine generation's handlers read an ``EngineClient``:
    its fields, and ``generate_*`` queueing the request on our batching manager with its generation config."""

    FIELDS = frozenset({"model_id", "processor", "model_config", "generation_config", "modality", "use_cb",
                        "generate_streaming", "generate_non_streaming"})

    def __init__(self, served_name, model, processor, modality):
        self.model, self.processor, self.modality = model, processor, modality
        self.model_id, self.model_config, self.generation_config = served_name, model.config, model.generation_config
        self.use_cb = False
        self.request = None  # (request_id, gen_config, manager): set by the handler once the request is admitted

    def generate_streaming(self, inputs, generation_kwargs, response_parser=None):
        request_id, gen_config, manager = self.request
        return manager.generate_streaming(self.model, self.processor, inputs, gen_config, request_id,
                                          response_parser=response_parser)

    async def generate_non_streaming(self, inputs, generation_kwargs):
        request_id, gen_config, manager = self.request
        return await manager.generate_non_streaming(self.model, self.processor, inputs, gen_config, request_id)


# --------------------------------------------------------------------------------------------- handlers
def build_handlers(served: ServedModel, generation_state, *, served_name: str, admit) -> dict:
    """``{"chat": ..., "completion": ..., "response": ...}``: transformers' handlers, ours overriding how a request
    reaches the model. ``admit``: the server's `Admission` (length limits, sampling fields, the worker threads);
    ``generation_state.get_manager`` gives the batching manager."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler

    make = _engine_handler if engine_generation() else _in_process_handler
    classes = {"chat": ChatCompletionHandler, "completion": CompletionHandler, "response": ResponseHandler}
    return {route: make(base, route)(served=served, generation_state=generation_state, served_name=served_name,
                                     admit=admit) for route, base in classes.items()}


def _prompt(handler, route, body, processor, modality):
    """The request's model inputs: the chat template (chat, Responses) or the tokenizer (completions)."""
    if route == "completion":
        return getattr(processor, "tokenizer", processor)(body["prompt"], return_tensors="pt")
    if route == "chat":  # chat completions send tools nested already, as the template takes them
        messages, tools = body["messages"], body.get("tools")
    else:
        messages, tools = handler._normalize_input(body), handler._normalize_tools(body.get("tools"))
    return processor.apply_chat_template(handler.get_processor_inputs_from_messages(messages, modality),
                                         add_generation_prompt=True, tools=tools, return_tensors="pt",
                                         return_dict=True, tokenize=True, **(body.get("chat_template_kwargs") or {}))


def _unseeded(body: dict) -> dict:
    # OpenAI's sampling fields and the seed are applied by `Admission.sampling` (the seed on the decode thread, right
    # before its own generate call: transformers would seed the global generator on the event loop, under every
    # other request)
    return {k: v for k, v in body.items() if k not in ("seed", "temperature", "top_p")}


class _Admitted:
    """What our handlers share: the request admitted off the event loop, then handed to the base class's path."""

    def _init(self, served, served_name, admit):
        self.served, self.served_name, self.admit = served, served_name, admit

    async def _admitted(self, route, body):
        def prepare():  # model loading, the chat template (it may be slow) and the tokenizer: off the loop
            model, processor = self.served.load()
            modality = self.served.modality(model, processor)
            return model, processor, modality, _prompt(self, route, body, processor, modality)

        model, processor, modality, inputs = await self.admit.run_off_loop(prepare)
        max_new = self.admit.max_new_tokens(body, model, inputs["input_ids"].shape[-1])
        return model, processor, modality, inputs.to(model.device), max_new


def _in_process_handler(base, route):
    class Handler(_Admitted, base):
        def __init__(self, *, served, generation_state, served_name, admit):
            base.__init__(self, model_manager=served.loader, generation_state=generation_state)
            self._init(served, served_name, admit)

        async def handle_request(self, body: dict, request_id: str):
            model, processor, _, inputs, max_new = await self._admitted(route, body)
            gc = self._build_generation_config(_unseeded(body), model.generation_config)
            gc = self.admit.sampling(gc, body)
            gc.max_new_tokens = max_new
            manager = self.generation_state.get_manager(self.served_name)
            stream = body.get("stream", route == "response")
            run = self._streaming if stream else self._non_streaming
            args = (request_id, model, processor, self.served_name)
            if route == "completion":
                result = run(*args, inputs, gc, manager, body.get("suffix"))
            elif route == "chat":
                result = run(*args, inputs, gc, gen_manager=manager, **_if_accepted(run, tools=body.get("tools")))
            else:
                result = run(*args, body, inputs, gc, gen_manager=manager,
                             **_if_accepted(run, tools=self._normalize_tools(body.get("tools"))))
            return await result if inspect.isawaitable(result) else result

    Handler.__name__ = Handler.__qualname__ = f"MARS{base.__name__}"
    return Handler


def _engine_handler(base, route):
    class Handler(_Admitted, base):
        def __init__(self, *, served, generation_state, served_name, admit):
            base.__init__(self, model_manager=None, generation_state=generation_state)
            self._init(served, served_name, admit)

        async def handle_request(self, body: dict, request_id: str):
            model, processor, modality, inputs, max_new = await self._admitted(route, body)
            kwargs = self._build_generation_kwargs(_unseeded(body), model.generation_config)
            gc = copy.deepcopy(model.generation_config)
            for key, value in kwargs.items():  # setattr, not `update`: it drops MARS's own fields
                setattr(gc, key, value)
            gc = self.admit.sampling(gc, body)
            gc.max_new_tokens = kwargs["max_new_tokens"] = max_new
            engine = _Engine(self.served_name, model, processor, modality)
            engine.request = (request_id, gc, self.generation_state.get_manager(self.served_name))
            stream = body.get("stream", route == "response")
            if route == "response":
                args = (request_id, engine, body, inputs, kwargs)
            elif route == "completion":
                args = (request_id, engine, inputs, kwargs, body.get("suffix"))
            else:
                args = (request_id, engine, inputs, kwargs, body.get("tools"))
            if stream:
                return self._streaming(*args, *(() if route == "response" else (body.get("stream_options"),)))
            return await self._non_streaming(*args)

    Handler.__name__ = Handler.__qualname__ = f"MARS{base.__name__}"
    return Handler


def _if_accepted(fn, **kwargs) -> dict:
    """The keyword arguments ``fn`` takes (``tools=`` arrived in transformers 5.2x)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}
