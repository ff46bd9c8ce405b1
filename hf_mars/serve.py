"""`hf-mars serve`: transformers' OpenAI-compatible server with MARS batching and a load-adaptive τ.

The HTTP layer, request parsing, chat templates, streaming and response objects are `transformers serve`'s own
(`transformers.cli.serving`); this module replaces only its generation manager. Requests that wait at the same
time are decoded together in one left-padded MARS `generate` call, and the τ of that call is read off a declared
ladder from the load at the moment it starts (requests waiting + in flight): an idle server answers at τ = 1
(exactly the AR model), a loaded one lowers τ and emits more tokens per forward. `--lossless` decodes every rung
in verify mode instead (output equal to greedy; the speed comes from drafts and batching). Prometheus metrics,
an optional API key, request limits answered with OpenAI-style JSON errors, and a graceful shutdown (every
accepted request is finished) make it a server, not a demo.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import inspect
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .generation import DEFAULT_VERIFY_THRESHOLD, check_threshold

MARS_BODY_FIELDS = ("mars_threshold",)  # extra top-level request fields (openai: extra_body={...})
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


# --------------------------------------------------------------------------------------------- the τ ladder
class TauLadder:
    """``"0:1.0,2:0.99,6:0.95"``: from a load of 0 requests τ = 1.0, from 2 τ = 0.99, from 6 τ = 0.95."""

    def __init__(self, spec: str):
        rungs = []
        for part in str(spec).split(","):
            load, sep, tau = part.strip().partition(":")
            try:
                if not sep:
                    raise ValueError
                load_i, tau_f = int(load), float(tau)
            except ValueError:
                raise ValueError(f"--tau-ladder: {part.strip()!r} is not LOAD:TAU (e.g. '0:1.0,4:0.99')") from None
            if load_i < 0:
                raise ValueError(f"--tau-ladder: load {load_i} is negative; loads count requests (0, 1, 2, ...)")
            check_threshold(tau_f, name="--tau-ladder τ")
            rungs.append((load_i, tau_f))
        loads = [load for load, _ in rungs]
        if loads != sorted(set(loads)):
            raise ValueError(f"--tau-ladder: loads must increase strictly, got {loads}")
        if loads[0] != 0:
            raise ValueError("--tau-ladder: the first rung must start at load 0 (what an idle server uses)")
        self.rungs = rungs

    def tau_for(self, load: int) -> float:
        return [tau for start, tau in self.rungs if load >= start][-1]

    def __str__(self):
        return ",".join(f"{load}:{tau:g}" for load, tau in self.rungs)


# --------------------------------------------------------------------------------------------- metrics
class Metrics:
    """The server's Prometheus metrics, in a registry of its own (several servers can live in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("hf_mars_requests", "HTTP requests answered, by path and status code.",
                                ["path", "status"], registry=r)
        self.cancelled = Counter("hf_mars_requests_cancelled", "Requests whose client went away before the end.",
                                 registry=r)
        self.queue_depth = Gauge("hf_mars_queue_depth", "Requests waiting to be decoded.", registry=r)
        self.in_flight = Gauge("hf_mars_requests_in_flight", "Requests being decoded now.", registry=r)
        self.tau = Gauge("hf_mars_tau", "τ of the latest batch (verify mode: its draft threshold).", registry=r)
        self.batches = Counter("hf_mars_batches", "MARS generate calls, by the τ they ran at.", ["tau"], registry=r)
        self.batch_size = Histogram("hf_mars_batch_size", "Requests decoded together in one generate call.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.tokens = Counter("hf_mars_generated_tokens", "Tokens generated.", registry=r)
        self.forwards = Counter("hf_mars_row_forwards", "Forward passes, summed over the rows that took part.",
                                registry=r)
        self.tokens_per_forward = Gauge("hf_mars_tokens_per_forward", "Tokens per forward of the latest batch.",
                                        registry=r)
        self.decode_seconds = Counter("hf_mars_decode_seconds", "Time the decode thread spent in generate calls "
                                      "(its rate is the decoder's utilisation).", registry=r)
        self.tokens_per_second = Gauge("hf_mars_tokens_per_second", "Tokens/s of the latest batch.", registry=r)
        self.latency = Histogram("hf_mars_request_latency_seconds", "Arrival to last token, per request.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("hf_mars_queue_wait_seconds", "Arrival to start of decoding, per request.",
                                    buckets=LATENCY_BUCKETS, registry=r)


# --------------------------------------------------------------------------------------------- the batching manager
@dataclass
class _Job:
    input_ids: list | None
    gen_config: object
    key: str
    tau: float | None  # the request's own mars_threshold (overrides the ladder)
    mars: bool
    streamer: object = None  # transformers' DirectStreamer (streaming requests)
    future: object = None  # non-streaming requests: an asyncio future; plain calls: a concurrent.futures one
    loop: object = None  # the asyncio future's event loop (None: resolve from this thread)
    call: tuple | None = None  # (fn, args, kwargs): a plain call to run on the model's thread
    arrived: float = field(default_factory=time.perf_counter)

    def cancelled(self) -> bool:
        return self.streamer is not None and self.streamer._cancelled.is_set()

    def resolve(self, result=None, error=None):
        """Hand a non-streaming (or call) result back to its event loop; a streamed one ends its stream."""
        if self.future is not None:
            def done():
                if not self.future.done():
                    self.future.set_exception(error) if error is not None else self.future.set_result(result)
            self.loop.call_soon_threadsafe(done) if self.loop is not None else done()
        elif self.streamer is not None:
            if error is not None:
                from transformers.cli.serving.utils import _StreamError

                self.streamer._enqueue(_StreamError(str(error)))
            else:
                self.streamer.end()


class _RowStreamer:
    """Fans a batched MARS call's new tokens out to each request's own transformers streamer."""

    def __init__(self, jobs):
        self.jobs, self.first = jobs, True

    def put(self, value):
        if self.first:  # the prompt
            self.first = False
            return
        if len(self.jobs) != 1:
            raise RuntimeError("a batched call must stream through put_rows")
        self.put_rows([value.reshape(-1)])

    def put_rows(self, rows):
        from transformers.cli.serving.utils import _GenerationCancelled

        for job, tokens in zip(self.jobs, rows):
            if job.streamer is None or len(tokens) == 0 or job.cancelled():
                continue
            try:
                job.streamer.put(tokens)
            except _GenerationCancelled:
                pass  # the row is stopped by _CancelledRows at its next check

    def end(self):
        pass  # each request's stream is ended once its row's result is known


class _CancelledRows:
    """Stops the rows whose client disconnected, so a batch does not decode for nobody."""

    mars_stateless = True  # depends on the clients, not on which positions it has seen: the fast path may call it

    def __init__(self, jobs):
        self.jobs = jobs

    def __call__(self, input_ids, scores=None, **kwargs):
        return torch.tensor([job.cancelled() for job in self.jobs], dtype=torch.bool, device=input_ids.device)


def _http_error(status: int, message: str, code: str, param: str | None = None):
    from fastapi import HTTPException

    return HTTPException(status_code=status, detail={"message": message, "code": code, "param": param})


class MARSBatchingManager:
    """transformers serve's generation-manager interface, decoding waiting requests together with MARS.

    One worker thread owns the model (as transformers' `InferenceThread` does); requests queue in arrival
    order; each generate call takes the oldest request and every waiting request with the same generation
    settings (up to ``max_batch_size``), so load raises throughput twice: by batching and by a lower τ.
    """

    def __init__(self, ladder: TauLadder, lossless: bool = False, max_batch_size: int = 8, max_queue: int = 256,
                 max_prompt_tokens: int = 4096, mars_options: dict | None = None, metrics: Metrics | None = None):
        if max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {max_batch_size}")
        if max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {max_queue}")
        self.ladder, self.lossless = ladder, lossless
        self.max_batch_size, self.max_queue, self.max_prompt_tokens = max_batch_size, max_queue, max_prompt_tokens
        self.mars_options = dict(mars_options or {})
        self.metrics = metrics or Metrics()
        self.model = self.processor = None
        self._waiting: deque[_Job] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="hf-mars-decode", daemon=True)
        self._thread.start()

    # ---- the interface transformers' handlers call
    def init_cb(self, model, gen_config):
        pass

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        from transformers.cli.serving.utils import DirectStreamer

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        tokenizer = getattr(processor, "tokenizer", processor)
        streamer = DirectStreamer(tokenizer._tokenizer, loop, queue, response_parser=response_parser)
        self._submit(self._job(model, processor, inputs, gen_config, streamer=streamer))
        return queue, streamer

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        loop = asyncio.get_running_loop()
        job = self._job(model, processor, inputs, gen_config, future=loop.create_future(), loop=loop)
        self._submit(job)
        generated_ids = await job.future
        text = processor.decode(generated_ids, skip_special_tokens=True)
        return text, len(job.input_ids), generated_ids

    def submit(self, fn, *args, **kwargs):
        from concurrent.futures import Future

        job = _Job(None, None, key="call", tau=None, mars=False, call=(fn, args, kwargs), future=Future())
        self._submit(job, check_queue=False)
        return job.future

    def async_submit(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        job = _Job(None, None, key="call", tau=None, mars=False, call=(fn, args, kwargs), future=loop.create_future(),
                   loop=loop)
        self._submit(job, check_queue=False)
        return job.future

    def stop(self):
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # ---- queueing
    def _job(self, model, processor, inputs, gen_config, **kw) -> _Job:
        self.model, self.processor = model, processor
        ids = inputs["input_ids"]
        ids = (ids[0] if ids.ndim == 2 else ids).tolist() if torch.is_tensor(ids) else list(ids)
        if len(ids) > self.max_prompt_tokens:
            raise _http_error(413, f"The prompt has {len(ids)} tokens; this server accepts at most "
                              f"{self.max_prompt_tokens} (--max-prompt-tokens). Shorten the conversation.",
                              "prompt_too_long", "messages")
        tau = getattr(gen_config, "_hf_mars_request_tau", None)
        mars = getattr(gen_config, "mars", True) is not False
        settings = gen_config.to_json_string(use_diff=True)
        # plain (non-MARS) requests decode one per call: transformers' batched streamer output cannot tell a
        # finished row's padding from its tokens
        key = json.dumps([settings, tau, mars]) if mars else f"plain-{id(gen_config)}"
        return _Job(ids, gen_config, key=key, tau=tau, mars=mars, **kw)

    def _submit(self, job: _Job, check_queue: bool = True):
        with self._cond:
            if self._stopping:
                raise _http_error(503, "The server is shutting down.", "shutting_down")
            if check_queue and len(self._waiting) >= self.max_queue:
                raise _http_error(429, f"The server is at capacity ({self.max_queue} requests waiting, --max-queue); "
                                  "retry later.", "queue_full")
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def _take(self):
        """The next group of requests to decode together, and the load when it starts."""
        with self._cond:
            while not self._waiting:
                if self._stopping:
                    return None, 0
                self._cond.wait()
            load = len(self._waiting) + self._in_flight
            first = self._waiting[0]
            group = [j for j in self._waiting if j.key == first.key][: 1 if first.call else self.max_batch_size]
            for job in group:
                self._waiting.remove(job)
            self._in_flight = len(group)
            self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.in_flight.set(self._in_flight)
            return group, load

    def _work(self):
        while True:
            group, load = self._take()
            if group is None:
                return
            try:
                if group[0].call is not None:
                    fn, args, kwargs = group[0].call
                    try:
                        group[0].resolve(fn(*args, **kwargs))
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        group[0].resolve(error=e)
                else:
                    self._decode(group, load)
            finally:
                with self._cond:
                    self._in_flight = 0
                    self.metrics.in_flight.set(0)

    # ---- one batched generate call
    def _decode(self, group, load):
        m = self.metrics
        started = time.perf_counter()
        for job in group:
            m.queue_wait.observe(started - job.arrived)
        jobs = []
        for job in group:
            if job.cancelled():
                m.cancelled.inc()
                job.resolve()
            else:
                jobs.append(job)
        if not jobs:
            return
        model, processor = self.model, self.processor
        tokenizer = getattr(processor, "tokenizer", processor)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        width = max(len(job.input_ids) for job in jobs)
        input_ids = torch.full((len(jobs), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for r, job in enumerate(jobs):
            input_ids[r, width - len(job.input_ids):] = torch.tensor(job.input_ids)
            attention_mask[r, width - len(job.input_ids):] = 1
        gc = copy.deepcopy(jobs[0].gen_config)
        gc.return_dict_in_generate = True
        kwargs = dict(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                      generation_config=gc, tokenizer=processor)
        streaming = any(job.streamer is not None for job in jobs)
        if streaming:
            from transformers import StoppingCriteriaList

            for job in jobs:
                if job.streamer is not None:
                    job.streamer.put(torch.tensor(job.input_ids))  # transformers' streamer skips the prompt
            kwargs["streamer"] = _RowStreamer(jobs)
            kwargs["stopping_criteria"] = StoppingCriteriaList([_CancelledRows(jobs)])
        tau = None
        if jobs[0].mars:
            tau = jobs[0].tau if jobs[0].tau is not None else self.ladder.tau_for(load)
            kwargs.update(mars=True, mars_threshold=tau, **self.mars_options)
            if self.lossless:
                kwargs["mars_verify"] = True
                if jobs[0].tau is None:  # verify's own draft threshold
                    kwargs.pop("mars_threshold")
                    tau = DEFAULT_VERIFY_THRESHOLD
        else:
            kwargs["mars"] = False
        try:
            with torch.inference_mode():
                out = model.generate(**kwargs)
        except Exception as e:  # noqa: BLE001 - every request of the batch gets the error, the server goes on
            for job in jobs:
                job.resolve(error=e)
            return
        elapsed = time.perf_counter() - started
        seq = out.sequences[:, width:].cpu()
        if getattr(out, "mars_emitted_tokens", None) is not None:
            emitted = out.mars_emitted_tokens.tolist()
            forwards = out.mars_forward_passes.tolist()
        else:  # plain generate, one request
            emitted = [seq.shape[1]]
            forwards = [seq.shape[1]]
        done = time.perf_counter()
        for r, job in enumerate(jobs):
            if job.cancelled():
                m.cancelled.inc()
            job.resolve(seq[r, : emitted[r]])
            m.latency.observe(done - job.arrived)
        total, fwd = sum(emitted), sum(forwards)
        m.tokens.inc(total)
        m.decode_seconds.inc(elapsed)
        m.forwards.inc(fwd)
        m.tokens_per_forward.set(total / max(fwd, 1))
        m.tokens_per_second.set(total / max(elapsed, 1e-9))
        m.batch_size.observe(len(jobs))
        if jobs[0].mars:
            m.batches.labels(tau=f"verify {tau:g}" if self.lossless else f"{tau:g}").inc()
            m.tau.set(tau)


class _State:
    """transformers serve's `GenerationState`, with every model served by the one batching manager."""

    _compile = False

    def __init__(self, manager):
        self.manager = manager

    def use_continuous_batching(self, model, modality):
        return False

    def get_manager(self, model_id, use_cb=False):
        return self.manager

    def shutdown(self):
        self.manager.stop()

    def is_cb_alive(self):
        return True


# --------------------------------------------------------------------------------------------- handlers and app
def _mars_handler(base, served_names: set, max_tokens_limit: int):
    """A transformers serve handler class that reads `mars_threshold` and enforces the server's limits."""

    class Handler(base):
        def _validate_request(self, body):
            if not isinstance(body.get("model", ""), str):
                raise _http_error(400, "`model` must be a string.", "invalid_model", "model")
            super()._validate_request({k: v for k, v in body.items() if k not in MARS_BODY_FIELDS})
            messages = body.get("messages", [{}]) if base.__name__ == "ChatCompletionHandler" else [{}]
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise _http_error(400, "`messages` must be a non-empty list of {\"role\": ..., \"content\": ...} "
                                  "objects.", "invalid_messages", "messages")
            for value, param in ((body.get("mars_threshold"), "mars_threshold"),
                                 (_generation_config_field(body, "mars_threshold"), "generation_config")):
                if value is not None:
                    try:
                        check_threshold(value)
                    except (TypeError, ValueError) as e:
                        raise _http_error(400, str(e), "invalid_threshold", param) from None
            requested = body.get("model")
            if requested is not None and requested not in served_names:
                raise _http_error(404, f"The model {requested!r} does not exist on this server; it serves "
                                  f"{sorted(served_names)} (GET /v1/models).", "model_not_found", "model")
            body["model"] = self.model_manager.force_model

        def _build_generation_config(self, body, model_generation_config, use_cb=False):
            asked = next((body.get(k) for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                          if body.get(k) is not None), None)
            if asked is None:
                asked = _generation_config_field(body, "max_new_tokens")
            if asked is not None and int(asked) > max_tokens_limit:
                raise _http_error(400, f"max_tokens={asked} is over this server's limit of {max_tokens_limit} "
                                  "(--max-tokens-limit).", "max_tokens_too_large", "max_tokens")
            gc = super()._build_generation_config(body, model_generation_config, use_cb=use_cb)
            if gc.max_new_tokens is None or gc.max_new_tokens > max_tokens_limit:
                gc.max_new_tokens = max_tokens_limit
            tau = body.get("mars_threshold", _generation_config_field(body, "mars_threshold"))
            gc._hf_mars_request_tau = None if tau is None else float(tau)
            return gc

    Handler.__name__ = f"MARS{base.__name__}"
    return Handler


def _generation_config_field(body, name):
    raw = body.get("generation_config")
    if raw is None:
        return None
    try:
        data = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        raise _http_error(400, f"`generation_config` is not valid JSON: {e}", "invalid_generation_config",
                          "generation_config") from None
    if not isinstance(data, dict):
        raise _http_error(400, "`generation_config` must be a JSON object.", "invalid_generation_config",
                          "generation_config")
    return data.get(name)


def _openai_error(status: int, message: str, code: str | None = None, param: str | None = None):
    from fastapi.responses import JSONResponse

    kind = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
            503: "server_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def build_app(model: str, ladder: TauLadder, *, served_model_name: str | None = None, lossless: bool = False,
              max_batch_size: int = 8, max_queue: int = 256, max_prompt_tokens: int = 4096,
              max_tokens_limit: int = 1024, api_key: str | None = None, device: str = "auto", dtype: str = "auto",
              trust_remote_code: bool = False, mars_options: dict | None = None):
    """The FastAPI app: transformers serve's routes and handlers on a `MARSBatchingManager`, plus /metrics."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.transcription import TranscriptionHandler

    from .generation import enable_mars

    class MARSModelManager(ModelManager):
        def _load_model(self, *args, **kwargs):
            return enable_mars(super()._load_model(*args, **kwargs))

    metrics = Metrics()
    manager = MARSBatchingManager(ladder, lossless=lossless, max_batch_size=max_batch_size, max_queue=max_queue,
                                  max_prompt_tokens=max_prompt_tokens, mars_options=mars_options, metrics=metrics)
    models = MARSModelManager(device=device, dtype=dtype, trust_remote_code=trust_remote_code, force_model=model)
    state = _State(manager)
    names = {model, models.process_model_name(model)} | ({served_model_name} if served_model_name else set())
    handlers = {name: _mars_handler(base, names, max_tokens_limit)(model_manager=models, generation_state=state)
                for name, base in (("chat", ChatCompletionHandler), ("completion", CompletionHandler),
                                   ("response", ResponseHandler))}
    extra = {}
    if "systemone_handler" in inspect.signature(build_server).parameters:  # /v1/systemone: transformers >= 5.2x
        from transformers.cli.serving.systemone import SystemOneHandler

        extra["systemone_handler"] = SystemOneHandler(model_manager=models, generation_state=state)
    app = build_server(models, handlers["chat"], completion_handler=handlers["completion"],
                       response_handler=handlers["response"],
                       transcription_handler=TranscriptionHandler(models, state), generation_state=state, **extra)
    app.state.mars_manager, app.state.metrics = manager, metrics

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(_request, exc):
        detail = exc.detail
        if isinstance(detail, dict):
            return _openai_error(exc.status_code, detail["message"], detail.get("code"), detail.get("param"))
        return _openai_error(exc.status_code, str(detail))

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_request, exc):
        first = (exc.errors() or [{}])[0]
        if first.get("type") == "json_invalid":
            return _openai_error(400, f"The request body is not valid JSON: {first.get('msg', '')}", "invalid_json")
        return _openai_error(400, f"Invalid request: {first.get('msg', exc)}", "invalid_request")

    @app.exception_handler(ValueError)
    async def _value_error(_request, exc):  # a generation setting the model cannot honour
        return _openai_error(400, str(exc), "invalid_request")

    @app.exception_handler(Exception)
    async def _internal(_request, exc):
        return _openai_error(500, f"{type(exc).__name__}: {exc}", "internal_error")

    @app.middleware("http")
    async def _guard_and_count(request: Request, call_next):
        path = request.url.path
        if api_key and path.startswith("/v1") or api_key and path in ("/load_model", "/reset"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                metrics.requests.labels(path=path, status="401").inc()
                return _openai_error(401, "Missing or wrong API key: send `Authorization: Bearer <key>`.",
                                     "invalid_api_key")
        try:
            response = await call_next(request)
        except Exception as exc:  # noqa: BLE001 - never let one request take the server down
            response = _openai_error(500, f"{type(exc).__name__}: {exc}", "internal_error")
        if path != "/metrics":
            metrics.requests.labels(path=path, status=str(response.status_code)).inc()
        return response

    # /v1/models: the one model this server serves, under each name it answers to (transformers' own route
    # scans the local Hub cache, which may not exist for a local checkpoint)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/v1/models"]

    @app.get("/v1/models")
    def _models():
        listed = [served_model_name] if served_model_name else []
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "hf-mars"}
                                           for name in listed + [model]]}

    @app.get("/metrics")
    def _metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# --------------------------------------------------------------------------------------------- the command
def add_arguments(p):
    p.add_argument("model", help="A MARS checkpoint: a Hub repo id or a local folder.")
    p.add_argument("--host", default="127.0.0.1", help="Listen address (default loopback; 0.0.0.0 exposes it).")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="Another name clients may send as `model`.")
    p.add_argument("--api-key", default=None,
                   help="Require `Authorization: Bearer KEY` on /v1/* (the openai client's api_key).")
    p.add_argument("--tau-ladder", default="0:1.0,2:0.99",
                   help="LOAD:TAU rungs: a generate call starting with LOAD requests waiting + in flight runs at "
                        "the τ of the highest rung <= LOAD (default '0:1.0,2:0.99': exact AR when idle).")
    p.add_argument("--lossless", action="store_true",
                   help="Verify mode at every rung: answers equal greedy decoding; load still raises throughput.")
    p.add_argument("--mars-acceptance", choices=["probability", "entropy", "margin"], default=None,
                   help="Confidence rule τ is compared with (default: the checkpoint's, else probability).")
    p.add_argument("--mars-block-size", type=int, default=None, help="Masks per step (default: the checkpoint's).")
    p.add_argument("--max-batch-size", type=int, default=8, help="Requests decoded together in one call.")
    p.add_argument("--max-queue", type=int, default=256, help="Waiting requests beyond which new ones get 429.")
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="Longer prompts get 413.")
    p.add_argument("--max-tokens-limit", type=int, default=1024,
                   help="Largest max_tokens a request may ask for (400 above); the default for requests without.")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", default="warning")


def run(args):
    missing = [m for m in ("fastapi", "uvicorn", "openai", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"hf-mars serve needs {', '.join(missing)}: pip install 'hf-mars[serve]'")
    import uvicorn

    ladder = TauLadder(args.tau_ladder)
    for name in ("max_batch_size", "max_queue", "max_prompt_tokens", "max_tokens_limit"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    options = {k: v for k, v in (("mars_acceptance", args.mars_acceptance),
                                 ("mars_block_size", args.mars_block_size)) if v is not None}
    app = build_app(args.model, ladder, served_model_name=args.served_model_name, lossless=args.lossless,
                    max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                    max_prompt_tokens=args.max_prompt_tokens, max_tokens_limit=args.max_tokens_limit,
                    api_key=args.api_key, device=args.device, dtype=args.dtype,
                    trust_remote_code=args.trust_remote_code, mars_options=options)
    mode = "lossless (verify)" if args.lossless else f"τ ladder {ladder}"
    print(f"hf-mars serve: {args.model} on http://{args.host}:{args.port}/v1, {mode}, batches of up to "
          f"{args.max_batch_size}; metrics at /metrics", flush=True)
    # uvicorn's shutdown (SIGINT / SIGTERM) stops accepting, then waits for every open request to finish: the
    # decode thread keeps draining the queue until then
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                  timeout_graceful_shutdown=None)).run()
    return 0
