"""What a request may ask for, checked in full before it is queued.

A request is parsed by a strict schema per route (types are not coerced: ``"10"``, ``5.7`` and ``true`` are not a
``max_tokens``; unknown fields are refused), then against the server's limits and the model's context once it is
tokenized. Every refusal is an `HTTPError` the app answers as an OpenAI error (400, 404, 413); nothing reaches
the decode thread that could fail a batch for the others. Fields the server cannot honour are refused with a
400 when they would change the answer (``n > 1``, ``logprobs``, penalties, a forced tool choice, JSON mode) and
ignored when they do not (``user``, ``metadata``, ``store``, ``stream_options``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..generation import ACCEPTANCE_MODES, check_threshold
from .errors import HTTPError

# --------------------------------------------------------------------------------------------- the schemas
Number = Annotated[float, Field(allow_inf_nan=False)]
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Tokens = Annotated[int, Field(ge=1)]
Text = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Lenient(BaseModel):  # parts of messages that clients echo back with extra (ignored) fields
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Lenient):
    type: Literal["text", "input_text", "output_text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Strict):
    name: Text
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class _Common(_Strict):
    """Fields every generating route shares."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    stream: bool | None = None
    stop: str | Annotated[list[Text], Field(max_length=4)] | None = None
    n: int | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    user: str | None = None
    generation_config: str | dict[str, Any] | None = None
    mars_threshold: Number | None = None


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_Common):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: Tokens | None = None
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None


class InputMessage(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class ResponseTool(_Strict):
    type: Literal["function"]
    name: Text
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseRequest(_Common):
    input: Text | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Tokens | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None


SCHEMAS = {"chat": ChatRequest, "completion": CompletionRequest, "response": ResponseRequest}
MAX_TOKENS_FIELDS = {"chat": ("max_completion_tokens", "max_tokens"), "completion": ("max_tokens",),
                     "response": ("max_output_tokens",)}
# a request's generation_config may set these (the sampling and length knobs, and MARS's own options); anything
# else (beam search, caches, output formats) would change what the server does for every request of its batch
GENERATION_CONFIG_FIELDS = {
    "max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p",
    "repetition_penalty", "no_repeat_ngram_size", "mars", "mars_threshold", "mars_acceptance", "mars_max_accept",
    "mars_verify", "mars_use_last_mask"}


# --------------------------------------------------------------------------------------------- checks
class Admission:
    """The server's request limits, applied by the handlers before a request is queued."""

    def __init__(self, *, served_names: set[str], max_prompt_tokens: int, max_tokens_limit: int,
                 trust_request_chat_template: bool = False, template_timeout: float = 10.0, workers: int = 2):
        self.served_names, self.max_prompt_tokens, self.max_tokens_limit = served_names, max_prompt_tokens, \
            max_tokens_limit
        self.trust_request_chat_template, self.template_timeout = trust_request_chat_template, template_timeout
        self.workers = workers
        self._limiter: asyncio.Semaphore | None = None

    # ---- the body, before anything else
    def parse(self, route: str, raw: bytes) -> dict:
        """The request body as the handlers read it: JSON, one schema, the server's field rules."""
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"The request body is not valid JSON: {e}", "invalid_json") from None
        except RecursionError:
            raise HTTPError(400, "The request body is nested too deeply.", "invalid_json") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "The request body must be a JSON object.", "invalid_request")
        _check_strings(body, "")
        try:
            parsed = SCHEMAS[route].model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("function-", "str", "list[")))
            kind = "unknown_field" if first["type"] == "extra_forbidden" else "invalid_value"
            what = "is not a field of this request" if kind == "unknown_field" else first["msg"].lower()
            raise HTTPError(400, f"`{param}`: {what}.", kind, param or None) from None
        body = parsed.model_dump(exclude_none=True)
        self._check_fields(route, body)
        return body

    def _check_fields(self, route: str, body: dict) -> None:
        if body.get("model") is not None and body["model"] not in self.served_names:
            raise HTTPError(404, f"The model {body['model']!r} does not exist on this server; it serves "
                            f"{sorted(self.served_names)[0]!r} (GET /v1/models).", "model_not_found", "model")
        refuse = [("n", lambda v: v != 1, "this server returns one choice per request (n=1)"),
                  ("presence_penalty", bool, "penalties are not supported; use generation_config's "
                                             "repetition_penalty"),
                  ("frequency_penalty", bool, "penalties are not supported; use generation_config's "
                                              "repetition_penalty"),
                  ("logprobs", bool, "log probabilities are not returned by this server"),
                  ("top_logprobs", bool, "log probabilities are not returned by this server"),
                  ("echo", bool, "echo is not supported"),
                  ("best_of", lambda v: v != 1, "best_of is not supported"),
                  ("response_format", lambda v: v != {"type": "text"}, "only {\"type\": \"text\"} is supported "
                                                                         "(constrained decoding is not served)")]
        for field, is_refused, why in refuse:
            if field in body and is_refused(body[field]):
                raise HTTPError(400, f"`{field}`: {why}.", "unsupported_value", field)
        for i, message in enumerate(body.get("messages") or []):
            if message.get("content") is None and not message.get("tool_calls"):
                raise HTTPError(400, f"`messages.{i}.content` is missing.", "invalid_value", f"messages.{i}.content")
        if isinstance(body.get("prompt"), list):
            body["prompt"] = body["prompt"][0]
        for field in ("stop", "logit_bias"):  # empty: none (transformers would refuse an empty one)
            if field in body and not body[field]:
                del body[field]
        for key in body.get("logit_bias") or {}:
            if not key.isdigit():
                raise HTTPError(400, f"`logit_bias`: keys are token ids, got {key!r}.", "invalid_value", "logit_bias")
        kwargs = body.get("chat_template_kwargs") or {}
        if "chat_template" in kwargs and not self.trust_request_chat_template:
            raise HTTPError(400, "`chat_template_kwargs.chat_template`: this server uses the checkpoint's chat "
                            "template (start it with --trust-request-chat-template to allow a request's own).",
                            "untrusted_chat_template", "chat_template_kwargs")
        if "generation_config" in body:
            body["generation_config"] = self._generation_config(body["generation_config"])
        for value, param in ((body.get("mars_threshold"), "mars_threshold"),
                             (_gc_field(body, "mars_threshold"), "generation_config")):
            if value is not None:
                try:
                    check_threshold(value)
                except (TypeError, ValueError) as e:
                    raise HTTPError(400, str(e), "invalid_threshold", param) from None
        asked = self.asked_tokens(route, body)
        if asked is not None and asked > self.max_tokens_limit:
            raise HTTPError(400, f"max_tokens={asked} is over this server's limit of {self.max_tokens_limit} "
                            "(--max-tokens-limit).", "max_tokens_too_large", MAX_TOKENS_FIELDS[route][-1])
        body["_route"] = route

    def _generation_config(self, raw) -> str:
        """A request's `generation_config` (a JSON string, as transformers serve reads it, or an object)."""
        from transformers import GenerationConfig

        try:
            data = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as e:
            raise HTTPError(400, f"`generation_config` is not valid JSON: {e}", "invalid_generation_config",
                            "generation_config") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "`generation_config` must be a JSON object.", "invalid_generation_config",
                            "generation_config")
        extra = sorted(set(data) - GENERATION_CONFIG_FIELDS)
        if extra:
            raise HTTPError(400, f"`generation_config`: {extra} may not be set by a request; allowed: "
                            f"{sorted(GENERATION_CONFIG_FIELDS)}.", "invalid_generation_config", "generation_config")
        rules = {**dict.fromkeys(("max_new_tokens", "min_new_tokens", "top_k", "no_repeat_ngram_size"),
                                 (lambda v: type(v) is int and v >= 0, "an integer >= 0")),
                 **dict.fromkeys(("do_sample", "mars", "mars_verify", "mars_use_last_mask"),
                                 (lambda v: type(v) is bool, "true or false")),
                 **dict.fromkeys(("temperature", "top_p", "min_p", "typical_p", "repetition_penalty"),
                                 (lambda v: type(v) in (int, float) and 0 < v < float("inf"), "a number > 0")),
                 "mars_acceptance": (lambda v: v in ACCEPTANCE_MODES, f"one of {list(ACCEPTANCE_MODES)}"),
                 "mars_max_accept": (lambda v: v is None or (type(v) is int and v >= 1), "null or an integer >= 1")}
        for key, value in data.items():
            is_valid, what = rules.get(key, (lambda v: True, ""))
            if not is_valid(value):
                raise HTTPError(400, f"`generation_config.{key}` must be {what}, got {value!r}.",
                                "invalid_generation_config", "generation_config")
        try:
            GenerationConfig(**data).validate(strict=True)
        except Exception as e:  # noqa: BLE001 - any inconsistency the config itself reports
            raise HTTPError(400, f"`generation_config`: {e}", "invalid_generation_config",
                            "generation_config") from None
        return json.dumps(data)

    @staticmethod
    def asked_tokens(route: str, body: dict) -> int | None:
        for field in MAX_TOKENS_FIELDS[route]:
            if body.get(field) is not None:
                return body[field]
        return _gc_field(body, "max_new_tokens")

    # ---- once the prompt is tokenized (the handlers call these)
    def max_new_tokens(self, body: dict, model, prompt_tokens: int) -> int:
        """How many tokens to generate: asked (or the server's default), within the model's context."""
        if prompt_tokens == 0:
            raise HTTPError(400, "The prompt is empty.", "empty_prompt", "prompt")
        if prompt_tokens > self.max_prompt_tokens:
            raise HTTPError(413, f"The prompt has {prompt_tokens} tokens; this server accepts at most "
                            f"{self.max_prompt_tokens} (--max-prompt-tokens). Shorten the conversation.",
                            "prompt_too_long", "messages")
        vocab = model.config.get_text_config().vocab_size
        for key in body.get("logit_bias") or {}:
            if int(key) >= vocab:
                raise HTTPError(400, f"`logit_bias`: token id {key} is outside the vocabulary ({vocab}).",
                                "invalid_value", "logit_bias")
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        asked = self.asked_tokens(body["_route"], body)
        room = self.max_tokens_limit if context is None else min(self.max_tokens_limit, context - prompt_tokens)
        min_new = _gc_field(body, "min_new_tokens") or 0
        if context is not None and prompt_tokens + (asked or max(1, min_new)) > context:
            raise HTTPError(400, f"This model's maximum context length is {context} tokens; the prompt has "
                            f"{prompt_tokens} and {asked or max(1, min_new)} more were asked for. Shorten the "
                            "prompt or ask for fewer tokens.", "context_length_exceeded", "messages")
        max_new = asked if asked is not None else room
        if min_new > max_new:
            raise HTTPError(400, f"`generation_config.min_new_tokens`={min_new} is over the {max_new} tokens this "
                            "request may generate.", "invalid_generation_config", "generation_config")
        return max_new

    @staticmethod
    def sampling(gc, body: dict):
        """OpenAI's sampling fields on a generation config: ``temperature`` 0 is greedy, above 0 samples;
        ``top_p`` below 1 samples; the request's seed and τ travel with it to the decode thread."""
        if body.get("temperature") is not None:
            gc.do_sample = body["temperature"] > 0
            if gc.do_sample:
                gc.temperature = body["temperature"]
        if body.get("top_p") is not None:
            gc.top_p = body["top_p"]
            if body["top_p"] < 1 and body.get("temperature") is None:
                gc.do_sample = True
        gc._hf_mars_seed = body.get("seed")
        tau = body.get("mars_threshold", _gc_field(body, "mars_threshold"))
        gc._hf_mars_request_tau = None if tau is None else float(tau)
        return gc

    async def run_off_loop(self, fn):
        """``fn()`` in a worker thread (at most ``workers`` at once, ``template_timeout`` seconds each): templates
        and tokenizers never stall the event loop, so /health and every other request keep being answered."""
        if self._limiter is None:
            self._limiter = asyncio.Semaphore(self.workers)
        async def limited():
            async with self._limiter:
                return await asyncio.to_thread(fn)

        try:
            return await asyncio.wait_for(limited(), self.template_timeout)
        except asyncio.TimeoutError:
            raise HTTPError(503, f"Preparing the prompt took over {self.template_timeout:g} s (--template-timeout);"
                            " retry later.", "server_busy", retry_after=1) from None


def _gc_field(body: dict, name: str):
    raw = body.get("generation_config")
    if raw is None:
        return None
    return (json.loads(raw) if isinstance(raw, str) else raw).get(name)


def _check_strings(value, path: str) -> None:
    """Every string of the body encodes as UTF-8 (JSON allows a lone surrogate such as ``"\\ud800"``; the
    tokenizer would fail on it later, as a 500)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise HTTPError(400, f"`{path or 'body'}` holds a lone UTF-16 surrogate, which is not text.",
                            "invalid_string", path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path)
            _check_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{path}.{i}")
