"""The FastAPI app of `hf-mars serve`: routes, the request guard, OpenAI-shaped errors, streams.

A request goes: the guard (API key, body size and read deadline, metrics by route template) → the route (strict
schema, `Admission`) → transformers' handler (chat template and tokenizer in a worker thread, lengths checked
against the model's context) → the batching manager. A stream's HTTP status waits for its first tokens, so a
request that fails before answering gets a real 4xx/5xx, not a 200 with an error inside; a stream that fails later
ends with an OpenAI error event; every chat/completions stream ends with ``data: [DONE]``. A non-streaming request
whose client goes away is cancelled, and its row stops decoding.
"""

import asyncio
import hmac
import json
import logging
import os
import uuid
from contextlib import asynccontextmanager

from . import _compat as tf
from .batching import MARSBatchingManager
from .errors import HTTPError
from .ladder import TauLadder
from .metrics import Metrics
from .requests import Admission

logger = logging.getLogger(__name__)
ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-", "response": ""}  # transformers prefixes resp_
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "response"}
OPEN_PATHS = ("/health",)  # answered without the API key (a load balancer's probe)


def served_name(model: str, served_model_name: str | None = None) -> str:
    """The name clients see: ``--served-model-name``, else a local folder's own name (never its path), else the
    Hub repo id."""
    if served_model_name:
        return served_model_name
    return os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model


def openai_error(status: int, message: str, code: str | None = None, param: str | None = None,
                 retry_after: int | None = None):
    from fastapi.responses import JSONResponse

    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"
            }.get(status, "invalid_request_error" if status < 500 else "server_error")
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if status in (408, 413):  # the rest of the body is not read: the connection cannot be reused
        headers["Connection"] = "close"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _as_http_error(exc: BaseException) -> HTTPError:
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, ValueError):  # a generation setting the model cannot honour
        return HTTPError(400, str(exc), "invalid_request")
    logger.error("request failed", exc_info=exc)
    return HTTPError(500, f"Internal error ({type(exc).__name__}); the server logged it.", "internal_error")


def _error_event(exc: BaseException) -> str:
    err = _as_http_error(exc)
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    return "data: " + json.dumps({"error": {"message": err.message, "type": kind, "param": err.param,
                                            "code": err.code}}) + "\n\n"


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


class Guard:
    """ASGI middleware before every route: the API key, the body's size and read deadline, the metrics."""

    def __init__(self, app, *, api_key, public_metrics, max_body_bytes, read_timeout, metrics, route_of):
        self.app, self.api_key, self.public_metrics = app, api_key, public_metrics
        self.max_body_bytes, self.read_timeout, self.metrics, self.route_of = max_body_bytes, read_timeout, \
            metrics, route_of

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        label, status = self.route_of(scope), []

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await openai_error(*refusal)(scope, receive, counted_send)
                return
            await self.app(scope, self._limited(receive), counted_send)
        finally:
            self.metrics.requests.labels(path=label, status=str(status[0] if status else 500)).inc()

    def _refusal(self, scope):
        path, headers = scope["path"], dict(scope["headers"])
        needs_key = self.api_key and path not in OPEN_PATHS and not (self.public_metrics and path == "/metrics")
        if needs_key and not hmac.compare_digest(headers.get(b"authorization", b""),
                                                 f"Bearer {self.api_key}".encode()):
            return 401, "Missing or wrong API key: send `Authorization: Bearer <key>`.", "invalid_api_key"
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            return 400, "Invalid Content-Length.", "invalid_request"
        if int(length) > self.max_body_bytes:
            return 413, f"The request body is over {self.max_body_bytes} bytes (--max-body-bytes).", "body_too_large"
        return None

    def _limited(self, receive):
        """``receive`` with a deadline for the whole body and a size cap (chunked bodies have no length)."""
        loop = asyncio.get_running_loop()
        deadline, size, complete = loop.time() + self.read_timeout, 0, False

        async def limited():
            nonlocal size, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.001))
            except asyncio.TimeoutError:
                raise HTTPError(408, f"The request body did not arrive within {self.read_timeout:g} s "
                                "(--read-timeout).", "request_timeout") from None
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_body_bytes:
                    raise HTTPError(413, f"The request body is over {self.max_body_bytes} bytes (--max-body-bytes).",
                                    "body_too_large")
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        return limited


async def _unless_disconnected(task, request):
    """``await task``, cancelled if the client disconnects first (its result would go to nobody)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            return None
        return task.result()
    finally:
        watcher.cancel()


class _Answering:
    """The three generating routes: parse the body, hand it to transformers' handler, watch the client, and hold
    a stream's headers until its first tokens."""

    def __init__(self, handlers, admission, manager):
        self.handlers, self.admission, self.manager = handlers, admission, manager

    def endpoint(self, route: str):
        from fastapi import Request

        async def answer(request: Request):
            return await self.answer(route, request)

        return answer

    async def answer(self, route, request):
        from fastapi.responses import Response, StreamingResponse

        manager = self.manager
        request_id = ID_PREFIX[route] + uuid.uuid4().hex
        body = self.admission.parse(route, await request.body())
        try:
            task = asyncio.ensure_future(self.handlers[route].handle_request(body, request_id))
            try:
                response = await _unless_disconnected(task, request)
            except Exception as e:  # noqa: BLE001 - a refusal (4xx), or an internal error answered as a 500
                raise _as_http_error(e) from e
            job = manager.job_for(request_id)
        finally:
            manager.jobs.pop(request_id, None)
        if response is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        if isinstance(response, StreamingResponse) and job is not None:
            return await self._stream(route, response, job, request)
        return response

    @staticmethod
    async def _stream(route, response, job, request):
        """Hold the headers until the first tokens (or the failure), then stream; errors as OpenAI events."""
        from fastapi.responses import Response, StreamingResponse

        waiting = asyncio.ensure_future(job.started.wait())
        if await _unless_disconnected(waiting, request) is None:
            job.gone.set()
            await response.body_iterator.aclose()
            return Response(status_code=499)
        if job.error is not None and not job.streamed:
            await response.body_iterator.aclose()
            raise _as_http_error(job.error)
        chat_like = route != "response"  # the Responses API streams typed events, without [DONE]

        async def events():
            inner = response.body_iterator
            try:
                async for chunk in inner:
                    head, marker, _ = chunk.partition(tf.STREAM_ERROR_PREFIX)
                    if marker and chat_like:
                        yield head + _error_event(job.error or RuntimeError("generation failed"))
                        break
                    yield chunk
                if chat_like:
                    yield "data: [DONE]\n\n"
            finally:
                await inner.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")


def _install_error_handlers(app):
    """Every error the app answers is in OpenAI's shape."""
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(HTTPError)
    async def _refused(_request, exc: HTTPError):
        return openai_error(exc.status, exc.message, exc.code, exc.param, exc.retry_after)

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(_request, exc):
        what = {404: "No such route on this server.", 405: "This route does not take that method."}
        return openai_error(exc.status_code, what.get(exc.status_code, str(exc.detail)),
                            {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))

    @app.exception_handler(Exception)
    async def _internal(_request, exc):
        err = _as_http_error(exc)
        return openai_error(err.status, err.message, err.code, err.param)


def _add_admin_routes(app, manager, served, name: str, served_names: set):
    """`--enable-admin`: reload or unload the served model (on the decode thread, between batches)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    @app.post("/load_model")
    async def _load_model(request: Request):
        body = json.loads(await request.body() or b"{}")
        if not isinstance(body, dict) or body.get("model") not in served_names:
            raise HTTPError(404, f"This server serves {name!r} only.", "model_not_found", "model")
        await manager.async_submit(served.load)
        return JSONResponse({"status": "ok", "model": name})

    @app.post("/reset")
    async def _reset():
        await manager.async_submit(served.unload)  # never under a running generate
        return JSONResponse({"status": "ok"})


def _add_read_routes(app, name: str, served_names, metrics: Metrics) -> None:
    """The GET routes: the model list and card (OpenAI's ``/v1/models``), ``/health`` and ``/metrics``."""
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    def model_card():
        return {"id": name, "object": "model", "created": 0, "owned_by": "hf-mars"}

    @app.get("/v1/models")
    def _models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    def _model(model_id: str):
        if model_id not in served_names:
            raise HTTPError(404, f"The model {model_id!r} does not exist on this server.", "model_not_found")
        return model_card()

    @app.get("/health")
    def _health():
        return {"status": "ok"}

    @app.get("/metrics")
    def _metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def build_app(model: str, ladder: TauLadder, *, served_model_name: str | None = None, lossless: bool = False,
              max_batch_size: int = 8, max_queue: int = 256, max_prompt_tokens: int = 4096,
              max_tokens_limit: int = 1024, api_key: str | None = None, device: str = "auto", dtype: str = "auto",
              trust_remote_code: bool = False, mars_options: dict | None = None, enable_admin: bool = False,
              public_metrics: bool = False, max_body_bytes: int = 1 << 20, read_timeout: float = 30.0,
              template_timeout: float = 10.0, trust_request_chat_template: bool = False, kernels: str = "default"):
    """The FastAPI app: transformers serve's handlers on a `MARSBatchingManager`, behind our guard. ``kernels``:
    the served model's linear layers as loaded (``"default"``) or on oneDNN's (``"onednn"``, `use_kernels`)."""
    from fastapi import FastAPI
    from starlette.routing import Match

    from ..bench.kernels import check_kernels, use_kernels
    from ..generation import enable_mars

    check_kernels(kernels, device)  # (before the model loads)
    if api_key is not None and not api_key.strip():  # e.g. `--api-key "$KEY"` with KEY unset: not "no key"
        raise ValueError("--api-key is empty: pass a non-empty key, or leave --api-key out to serve without one")
    if enable_admin and not api_key:
        raise ValueError("--enable-admin needs --api-key: /load_model and /reset must not be open to anyone")
    name = served_name(model, served_model_name)
    metrics = Metrics()
    manager = MARSBatchingManager(ladder, lossless=lossless, max_batch_size=max_batch_size, max_queue=max_queue,
                                  mars_options=mars_options, metrics=metrics)
    served = tf.ServedModel(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                            prepare=lambda loaded: use_kernels(enable_mars(loaded), kernels))
    admission = Admission(served_names={name, model}, max_prompt_tokens=max_prompt_tokens,
                          max_tokens_limit=max_tokens_limit, template_timeout=template_timeout,
                          trust_request_chat_template=trust_request_chat_template)
    state = _State(manager)
    handlers = tf.build_handlers(served, state, served_name=name, admit=admission)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        manager.stop()  # uvicorn has waited for open requests (--graceful-timeout); the queue drains

    app = FastAPI(lifespan=lifespan, title="hf-mars serve")
    app.state.mars_manager, app.state.metrics, app.state.served_name = manager, metrics, name

    def route_of(scope) -> str:
        for route in app.router.routes:
            if route.matches(scope)[0] == Match.FULL:
                return route.path
        return "other"

    app.add_middleware(Guard, api_key=api_key, public_metrics=public_metrics, max_body_bytes=max_body_bytes,
                       read_timeout=read_timeout, metrics=metrics, route_of=route_of)

    _install_error_handlers(app)
    answering = _Answering(handlers, admission, manager)
    for path, route in ROUTES.items():
        app.add_api_route(path, answering.endpoint(route), methods=["POST"])

    _add_read_routes(app, name, admission.served_names, metrics)
    if enable_admin:
        _add_admin_routes(app, manager, served, name, admission.served_names)
    return app
