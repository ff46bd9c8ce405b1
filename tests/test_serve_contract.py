"""The `transformers serve` and uvicorn internals `hf-mars serve` touches, checked against the installed versions.

A failure here means an upgrade moved one: fix `hf_mars/serve/_compat.py` (or the uvicorn protocol in
`hf_mars/serve/command.py`), nowhere else, and widen `TESTED_TRANSFORMERS` once the suite passes. Both generations
of transformers serve are covered: the in-process one (5.17 to 5.24) and the engine one (5.25).
"""

import asyncio
import inspect
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hf_mars.serve import _compat as tf  # noqa: E402


def _params(fn):
    return list(inspect.signature(fn).parameters)


def _signatures():
    return tf.ENGINE_SIGNATURES if tf.engine_generation() else tf.IN_PROCESS_SIGNATURES


def test_handler_methods_we_call_or_override():
    moved = tf.serve_contract_problems()
    assert not moved, "transformers serve moved what hf_mars/serve/_compat.py uses:\n" + "\n".join(moved)
    from transformers.cli.serving import utils

    assert issubclass(tf.generation_cancelled_error(), Exception) and hasattr(utils, "_StreamError")
    if tf.engine_generation():
        assert {"put_token", "end", "cancel"} <= set(dir(utils.Detokenizer))
    else:
        assert {"_enqueue", "put", "end", "cancel"} <= set(dir(utils.DirectStreamer))


def test_the_contract_check_sees_a_moved_signature_and_an_engine_field_we_lack(monkeypatch):
    key = ("utils", "BaseHandler", "__init__")
    monkeypatch.setitem(_signatures(), key, ["self", "moved"])
    assert [p for p in tf.serve_contract_problems() if p.startswith("BaseHandler.__init__")]
    if tf.engine_generation():  # a release whose handlers read an engine field our `_Engine` does not have
        monkeypatch.setattr(tf._Engine, "FIELDS", tf._Engine.FIELDS - {"model_config"})
        assert [p for p in tf.serve_contract_problems() if "['model_config']" in p]


def test_serve_refuses_to_start_where_transformers_serve_moved(monkeypatch, capsys):
    """A transformers whose serve internals moved: one clear error naming what moved and the versions to install,
    exit status 2, before any model is loaded - not a TypeError from deep inside."""
    from hf_mars.cli import main

    monkeypatch.setitem(_signatures(), ("utils", "BaseHandler", "__init__"), ["self", "moved"])
    monkeypatch.setattr(tf, "ServedModel", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["serve", "no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "BaseHandler.__init__" in err and "pip install 'transformers>=5.17.0,<5.26'" in err, err


def test_the_engine_streamer_skips_the_prompt_and_feeds_the_loop_from_another_thread():
    """`_LoopDetokenizer`: the decode thread's `put`s reach transformers' `Detokenizer` on the event loop, the
    prompt (the first `put`) skipped; a failure is an error item; once cancelled, `put` raises."""
    if not tf.engine_generation():
        pytest.skip("the engine generation of transformers serve (5.25) is not installed")
    import threading

    import torch

    from hf_mars.testing_utils import build_char_tokenizer

    tok = build_char_tokenizer()
    ids = tok("abc")["input_ids"]

    async def run(fail):
        queue = asyncio.Queue()
        streamer = tf.make_streamer(tok, asyncio.get_running_loop(), queue)

        def decode():
            streamer.put(torch.tensor([[7, 7, 7]]))  # the prompt
            streamer.put(torch.tensor(ids[:1]))
            streamer.put(torch.tensor(ids[1:]))
            streamer.fail("broke") if fail else streamer.end()

        thread = threading.Thread(target=decode)
        thread.start()
        items = [await asyncio.wait_for(queue.get(), 10)]
        while isinstance(items[-1], str):  # text until the end (None) or an error item
            items.append(await asyncio.wait_for(queue.get(), 10))
        thread.join()
        return streamer, items

    streamer, items = asyncio.run(run(fail=False))
    assert "".join(i for i in items if isinstance(i, str)) == "abc" and items[-1] is None
    assert streamer.total_tokens == len(ids) and not tf.stream_cancelled(streamer)
    streamer.cancel()
    assert tf.stream_cancelled(streamer)
    with pytest.raises(tf.generation_cancelled_error()):
        streamer.put(torch.tensor(ids))
    _, items = asyncio.run(run(fail=True))
    assert type(items[-1]).__name__ == "_StreamError" and items[-1].msg == "broke"


def test_a_stream_error_is_written_as_we_rewrite_it():
    """transformers writes a stream's error item as `data: {"error": "<message>"}`; the app replaces that line
    with an OpenAI error event. This runs the real chat handler's SSE generator on a queue holding the error."""
    import torch
    from transformers import GenerationConfig
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.utils import _StreamError

    from hf_mars.testing_utils import build_char_tokenizer

    tok = build_char_tokenizer()

    def generate_streaming(*args, **kwargs):
        queue = asyncio.Queue()
        queue.put_nowait(_StreamError('broke "here"'))
        return queue, type("S", (), {"total_tokens": 0, "cancel": lambda self: None})()

    class Model:
        config = type("C", (), {"model_type": "gpt2"})()

    async def run():
        handler = ChatCompletionHandler.__new__(ChatCompletionHandler)
        inputs = {"input_ids": torch.tensor([[5, 6]])}
        if tf.engine_generation():
            engine = type("E", (), {"processor": tok, "model_id": "m", "model_config": Model.config,
                                    "generate_streaming": staticmethod(generate_streaming)})()
            response = handler._streaming("id", engine, inputs, {"max_new_tokens": 4})
        else:
            manager = type("M", (), {"generate_streaming": staticmethod(generate_streaming)})()
            response = handler._streaming("id", Model(), tok, "m", inputs, GenerationConfig(max_new_tokens=4),
                                          gen_manager=manager)
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
