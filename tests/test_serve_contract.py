"""The `transformers serve` and uvicorn internals `hf-mars serve` touches, checked against the installed versions.

A failure here means an upgrade moved one: fix the serve section of `hf_mars/_compat.py` (or the uvicorn protocol in
`hf_mars/serve/command.py`), nowhere else, and widen `TESTED_TRANSFORMERS` once the suite passes.
"""

import asyncio
import inspect
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hf_mars import _compat as tf  # noqa: E402


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_handler_methods_we_call_or_override():
    moved = tf.serve_contract_problems()
    assert not moved, "transformers serve moved what hf_mars/_compat.py uses:\n" + "\n".join(moved)
    from transformers.cli.serving.utils import DirectStreamer, _StreamError  # noqa: F401 - stream_fail builds one

    assert issubclass(tf.generation_cancelled_error(), Exception)
    assert {"_enqueue", "put", "end", "cancel"} <= set(dir(DirectStreamer))


def test_serve_refuses_to_start_where_transformers_serve_moved(monkeypatch, capsys):
    """A transformers whose serve internals moved (5.25 rewrote them): one clear error naming what moved and the
    versions to install, exit status 2, before any model is loaded - not a TypeError from deep inside."""
    from hf_mars.cli import main

    monkeypatch.setitem(tf.SERVE_SIGNATURES, ("utils", "BaseHandler", "_resolve_model"), ["self", "moved"])
    monkeypatch.setattr(tf, "model_manager", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["serve", "no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "BaseHandler._resolve_model" in err and "pip install 'transformers>=5.17.0,<5.25'" in err, err


def test_a_stream_error_is_written_as_we_rewrite_it():
    """transformers writes a stream's error item as `data: {"error": "<unescaped>"}`; the app replaces that line
    with an OpenAI error event. This runs the real chat handler's SSE generator on a queue holding the error."""
    from transformers import GenerationConfig
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.utils import _StreamError

    from hf_mars.testing_utils import build_char_tokenizer

    tok = build_char_tokenizer()

    class Manager:
        def generate_streaming(self, *args, **kwargs):
            queue = asyncio.Queue()
            queue.put_nowait(_StreamError('broke "here"'))
            return queue, type("S", (), {"total_tokens": 0, "cancel": lambda self: None})()

    class Model:
        config = type("C", (), {"model_type": "gpt2"})()

    async def run():
        handler = ChatCompletionHandler.__new__(ChatCompletionHandler)
        import torch

        response = handler._streaming("id", Model(), tok, "m", {"input_ids": torch.tensor([[5, 6]])},
                                      GenerationConfig(max_new_tokens=4), gen_manager=Manager())
        return [chunk async for chunk in response.body_iterator]

    chunks = asyncio.run(run())
    assert any(tf.STREAM_ERROR_PREFIX in chunk for chunk in chunks), chunks
    assert json.loads(chunks[0][len("data: "):])["choices"][0]["delta"]["role"] == "assistant"


def test_uvicorn_protocol_hooks():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from hf_mars.serve.command import header_deadline_protocol

    for name in ("connection_made", "handle_events", "on_response_complete", "connection_lost"):
        assert name in vars(H11Protocol), f"uvicorn's H11Protocol.{name} moved"
    assert issubclass(header_deadline_protocol(5.0), H11Protocol)
    source = inspect.getsource(H11Protocol)
    assert "self.cycle" in source and "response_complete" in source, "uvicorn's request cycle moved"


def test_the_tested_versions_are_declared():
    assert tf.untested_version() is None or "tested with transformers" in tf.untested_version()
    low, high = tf.TESTED_TRANSFORMERS
    import re

    floor = re.search(r'"transformers>=([0-9.]+)', open("pyproject.toml").read()).group(1)
    assert low == floor, "the serving layer's lowest tested transformers is the package's floor"
