"""`hf-mars serve`: the batching manager in process (batching, the τ ladder, queue limit, cancellation), and a
real server process on loopback through the official `openai` client (answers, errors, metrics, shutdown).

The model is a position-only GPT-2 (all input embeddings equal): its drafts are mostly right, so verify mode
takes several tokens per forward, and its answer does not depend on the prompt's text, only on its length.
"""

import asyncio
import json
import signal
import threading
import time
import urllib.request

import pytest
import torch
from servers import save_checkpoint, start_mars_server, stop_server

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from transformers import GenerationConfig  # noqa: E402

from hf_mars.serve import MARSBatchingManager, TauLadder  # noqa: E402

PROMPTS = ["Reverse: abc", "Sort the letters: qwerty", "Copy: hello there", "Reverse: a much longer prompt here"]


@pytest.fixture(scope="module")
def tiny():
    from test_stateful_clients import position_only_model

    from hf_mars.testing_utils import build_char_tokenizer

    tok = build_char_tokenizer()
    return position_only_model(tok, n_positions=2048), tok


def _ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]


def _plain(model, tok, text, n):
    ids = _ids(tok, text)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def _gc(tok, n, **kw):
    return GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id,
                            eos_token_id=tok.eos_token_id, **kw)


async def _burst(manager, model, tok, texts, n):
    """Submit every request while the worker is held, so they are waiting together when it looks."""
    with manager._cond:  # re-entrant: submitting from this thread is allowed, the worker waits
        tasks = [asyncio.ensure_future(manager.generate_non_streaming(model, tok, {"input_ids": _ids(tok, t)},
                                                                       _gc(tok, n), "r")) for t in texts]
        await asyncio.sleep(0)  # each task submits before its first await
    return await asyncio.gather(*tasks)


def _sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_tau_ladder_parses_and_refuses_bad_specs():
    ladder = TauLadder("0:1.0, 2:0.99,6:0.95")
    assert [ladder.tau_for(n) for n in (0, 1, 2, 5, 6, 100)] == [1.0, 1.0, 0.99, 0.99, 0.95, 0.95]
    for bad, says in (("1:0.9", "load 0"), ("0:1.0,0:0.9", "increase"), ("0:1.5", "[0, 1]"), ("0-1", "LOAD:TAU"),
                      ("0:1,-2:0.5", "negative"), ("0:x", "LOAD:TAU")):
        with pytest.raises(ValueError, match=says):
            TauLadder(bad)


def test_draft_tree_flag_needs_lossless_and_a_valid_shape(capsys):
    """--mars-draft-tree is refused at start-up (exit 2, one line) without --lossless or with a bad shape."""
    from hf_mars.cli import main

    for flags, says in ((["--mars-draft-tree", "2,1"], "pass --lossless"),
                        (["--lossless", "--mars-draft-tree", "0,1"], "ints >= 1")):
        assert main(["serve", "no-such-model", *flags]) == 2
        assert says in capsys.readouterr().err


def test_waiting_requests_decode_together_lossless_equals_greedy(tiny):
    model, tok = tiny
    manager = MARSBatchingManager(TauLadder("0:1.0,2:0.5"), lossless=True, max_batch_size=8)
    results = asyncio.run(_burst(manager, model, tok, PROMPTS, 40))
    for (text, prompt_len, ids), prompt in zip(results, PROMPTS):
        assert ids.tolist() == _plain(model, tok, prompt, 40)
        assert prompt_len == _ids(tok, prompt).shape[1]
    m = manager.metrics
    steps, row_steps = _sample(m, "hf_mars_batch_size_count"), _sample(m, "hf_mars_batch_size_sum")
    assert row_steps >= 4 * 2 and row_steps > steps  # the four rows shared their steps (in flight, per step)
    assert _sample(m, "hf_mars_batches_total", tau="verify 0.3") == steps  # verify's own draft threshold
    assert _sample(m, "hf_mars_tau") == 0.3
    assert _sample(m, "hf_mars_tokens_per_forward") > 1.5  # drafts accepted: fewer forwards than tokens
    manager.stop()


def test_ladder_picks_tau_from_the_load(tiny):
    model, tok = tiny
    manager = MARSBatchingManager(TauLadder("0:1.0,3:0.5"), max_batch_size=8)
    asyncio.run(_burst(manager, model, tok, PROMPTS, 16))  # 4 decoding: the 0.5 rung, then 1 as rows finish
    m = manager.metrics
    assert _sample(m, "hf_mars_batches_total", tau="0.5") >= 1
    before = _sample(m, "hf_mars_batches_total", tau="1")
    (_, _, alone), = asyncio.run(_burst(manager, model, tok, PROMPTS[:1], 16))  # alone: τ = 1, exactly greedy
    assert alone.tolist() == _plain(model, tok, PROMPTS[0], 16)
    assert _sample(m, "hf_mars_batches_total", tau="1") > before
    assert _sample(m, "hf_mars_tau") == 1.0
    manager.stop()


def test_full_queue_answers_429(tiny):
    from hf_mars.serve.errors import HTTPError

    model, tok = tiny
    manager = MARSBatchingManager(TauLadder("0:1.0"), max_queue=2)

    async def go():
        with manager._cond:
            ok = [asyncio.ensure_future(manager.generate_non_streaming(model, tok, {"input_ids": _ids(tok, p)},
                                                                        _gc(tok, 8), "r")) for p in PROMPTS[:2]]
            await asyncio.sleep(0)
            with pytest.raises(HTTPError) as err:
                await manager.generate_non_streaming(model, tok, {"input_ids": _ids(tok, PROMPTS[2])}, _gc(tok, 8), "r")
        assert (err.value.status, err.value.code, err.value.retry_after) == (429, "queue_full", 1)
        return await asyncio.gather(*ok)

    assert len(asyncio.run(go())) == 2  # the accepted ones are still answered
    manager.stop()


def test_cancelled_stream_stops_its_row_only(tiny):
    model, tok = tiny
    manager = MARSBatchingManager(TauLadder("0:1.0"), lossless=True)

    async def go():
        with manager._cond:
            queue, streamer = manager.generate_streaming(model, tok, {"input_ids": _ids(tok, PROMPTS[0])},
                                                         _gc(tok, 1500, min_new_tokens=1500), "s")
            other = asyncio.ensure_future(manager.generate_non_streaming(
                model, tok, {"input_ids": _ids(tok, PROMPTS[1])}, _gc(tok, 300, min_new_tokens=300), "o"))
            await asyncio.sleep(0)
        await queue.get()  # first text
        streamer.cancel()  # what transformers' SSE generator does when the client goes away
        while await queue.get() is not None:
            pass
        return streamer.total_tokens, await other

    streamed, (_, _, other_ids) = asyncio.run(go())
    assert streamed < 1500
    assert len(other_ids) == 300  # the other row of the batch went on to its end
    assert _sample(manager.metrics, "hf_mars_requests_cancelled_total") == 1
    manager.stop()


# ------------------------------------------------------------------------------------------ a real server process
def _start(ckpt, tmp, *flags):
    return start_mars_server(ckpt, tmp, "--served-model-name", "tiny", *flags)


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mars-serve")
    return save_checkpoint(*tiny, tmp / "ckpt"), tmp


@pytest.fixture(scope="module")
def server(checkpoint):
    ckpt, tmp = checkpoint
    proc, port = _start(ckpt, tmp, "--lossless", "--api-key", "sk-test", "--max-prompt-tokens", "64",
                        "--max-tokens-limit", "1600")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-test", max_retries=0, timeout=120)
    yield client, port
    assert stop_server(proc, timeout=60) == 0  # SIGTERM: a clean shutdown


def _chat(client, text, n=40, stream=False, **kw):
    args = dict(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=n, temperature=0, **kw)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args)
                       if c.choices)
    return client.chat.completions.create(**args).choices[0].message.content


def _metrics(port, key="sk-test"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {key}"})
    return urllib.request.urlopen(req, timeout=10).read().decode()


@pytest.mark.timeout(300)
def test_server_answers_like_greedy_streaming_and_not(server, tiny):
    client, port = server
    model, tok = tiny
    want = tok.decode(_plain(model, tok, PROMPTS[1], 40), skip_special_tokens=True)
    assert _chat(client, PROMPTS[1]) == want
    assert _chat(client, PROMPTS[1], stream=True) == want
    assert _chat(client, PROMPTS[1], extra_body={"mars_threshold": 1.0}) == want  # per-request τ override
    assert [m.id for m in client.models.list().data][0] == "tiny"
    text = _metrics(port)
    assert 'hf_mars_requests_total{path="/v1/chat/completions",status="200"} 3.0' in text
    assert "hf_mars_tokens_per_forward" in text and "hf_mars_request_latency_seconds_bucket" in text


@pytest.mark.timeout(300)
def test_server_bad_input_is_a_4xx_json_error_and_it_keeps_serving(server, checkpoint):
    client, port = server

    def status_of(fn):
        with pytest.raises(openai.APIStatusError) as err:
            fn()
        body = err.value.response.json()
        assert set(body["error"]) >= {"message", "type", "code"}
        return err.value.status_code, body["error"]["code"]

    assert status_of(lambda: _chat(client, "x", extra_body={"mars_threshold": 1.5})) == (400, "invalid_threshold")
    assert status_of(lambda: client.chat.completions.create(
        model="nope", messages=[{"role": "user", "content": "x"}])) == (404, "model_not_found")
    assert status_of(lambda: _chat(client, "x" * 200)) == (413, "prompt_too_long")
    assert status_of(lambda: _chat(client, "x", n=5000)) == (400, "max_tokens_too_large")
    bad_key = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    assert status_of(lambda: _chat(bad_key, "x")) == (401, "invalid_api_key")
    for raw in (b'{"model": "tiny", "messages": [', b'[1, 2]', b'{"model": "tiny", "messages": "hi"}'):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=raw, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer sk-test"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400 and "message" in json.loads(err.value.read())["error"]
    assert _chat(client, PROMPTS[0], n=8)  # still serving
    text = _metrics(port)
    for status in ("400", "401", "404", "413"):
        assert f'path="/v1/chat/completions",status="{status}"' in text


@pytest.mark.timeout(300)
def test_client_disconnect_mid_stream_cancels_the_row(server):
    client, port = server
    gen = json.dumps({"min_new_tokens": 1500, "max_new_tokens": 1500, "do_sample": False})
    # τ = 1: one token per forward, so the 1500 tokens take seconds and the disconnect lands mid-generation
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                            max_tokens=1500, stream=True,
                                            extra_body={"generation_config": gen, "mars_threshold": 1.0})
    chunks = iter(stream)
    next(chunks)
    next(chunks)  # the first generated text
    stream.close()  # the client goes away
    deadline = time.time() + 60
    while "hf_mars_requests_cancelled_total 1.0" not in _metrics(port):
        assert time.time() < deadline, "the disconnected stream was never cancelled"
        time.sleep(0.2)
    assert _chat(client, PROMPTS[0], n=8)


@pytest.mark.timeout(300)
def test_queue_limit_and_graceful_shutdown(checkpoint):
    """Over the queue limit a request gets 429; on SIGTERM every accepted request is still answered in full."""
    ckpt, tmp = checkpoint
    proc, port = _start(ckpt, tmp, "--tau-ladder", "0:1.0", "--max-queue", "1", "--max-batch-size", "1",
                        "--max-tokens-limit", "1600")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    gen = json.dumps({"min_new_tokens": 1200, "max_new_tokens": 1200, "do_sample": False})
    results, done_at, retry_after = {}, {}, {}

    def ask(i):
        try:
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"q{i}"}],
                                               extra_body={"generation_config": gen})
            results[i] = r.usage.completion_tokens
        except openai.APIStatusError as e:
            results[i] = e.status_code
            retry_after[i] = e.response.headers.get("retry-after")
        done_at[i] = time.time()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    time.sleep(0.3)
    term_at = time.time()
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    assert proc.wait(timeout=60) == 0
    answered = [i for i, r in results.items() if r == 1200]
    assert len(results) == 6 and set(results.values()) <= {1200, 429}, results
    assert 429 in results.values() and len(answered) >= 2  # one decoding + one waiting, the rest refused
    assert set(retry_after.values()) == {"1"}  # every 429 says when to retry
    assert any(done_at[i] > term_at for i in answered)  # finished after SIGTERM: shutdown waited for it


@pytest.mark.timeout(300)
def test_legacy_completions_endpoint_batches_through_mars_too(server, tiny):
    client, _ = server
    model, tok = tiny
    ids = tok("Reverse: abc", return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    want = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    got = client.completions.create(model="tiny", prompt="Reverse: abc", max_tokens=20, temperature=0)
    assert got.choices[0].text == want


@pytest.fixture(scope="module")
def qwen2_onednn(tmp_path_factory):
    """The demo's shipped base (a Qwen2: nn.Linear layers, all converted; its answers are text, not blank) saved as
    a checkpoint, and its copy on oneDNN's kernels, the reference the served answers must equal."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_mars import add_mask_token
    from hf_mars.bench.kernels import to_onednn
    from hf_mars.demo.pipeline import base_model_path

    model, tok = AutoModelForCausalLM.from_pretrained(base_model_path()), AutoTokenizer.from_pretrained(base_model_path())
    add_mask_token(model, tok)
    ckpt = save_checkpoint(model, tok, tmp_path_factory.mktemp("onednn") / "ckpt")
    return ckpt, to_onednn(model.eval()), tok


def _linear_kinds(model):
    return {type(m).__name__ for m in model.modules() if type(m).__name__ in ("Linear", "MkldnnLinear")}


ONEDNN = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


@ONEDNN
@pytest.mark.timeout(300)
def test_onednn_kernels_convert_the_served_model_and_batched_rows_answer_like_its_greedy(qwen2_onednn,
                                                                                         monkeypatch):
    """`build_app(kernels="onednn")`: the model the server loads goes through `to_onednn` once (no nn.Linear left),
    and requests decoded together on those kernels, in verify mode, each equal that model's plain greedy alone."""
    from fastapi.testclient import TestClient

    from hf_mars.bench import kernels
    from hf_mars.serve.app import build_app

    ckpt, converted, tok = qwen2_onednn
    assert _linear_kinds(converted) == {"MkldnnLinear"}
    served, real = [], kernels.to_onednn
    monkeypatch.setattr(kernels, "to_onednn", lambda model: served.append(real(model)) or served[-1])
    with TestClient(build_app(str(ckpt), TauLadder("0:1.0"), lossless=True, kernels="onednn")) as client:
        body = {"model": "ckpt", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 24,
                "temperature": 0}
        got = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert len(served) == 1 and _linear_kinds(served[0]) == {"MkldnnLinear"}
    assert got == tok.decode(_plain(converted, tok, PROMPTS[0], 24), skip_special_tokens=True)
    manager = MARSBatchingManager(TauLadder("0:1.0"), lossless=True, max_batch_size=8)
    try:
        results = asyncio.run(_burst(manager, converted, tok, PROMPTS, 24))
        for (_text, _prompt_len, ids), prompt in zip(results, PROMPTS):
            assert ids.tolist() == _plain(converted, tok, prompt, 24)
        m = manager.metrics
        assert _sample(m, "hf_mars_batch_size_sum") > _sample(m, "hf_mars_batch_size_count")  # rows shared steps
    finally:
        manager.stop()


@ONEDNN
@pytest.mark.timeout(300)
def test_onednn_kernels_from_the_command_line(qwen2_onednn, tmp_path, capsys):
    """`hf-mars serve --kernels onednn`: refused at start-up off the CPU; a real server process answers like the
    converted model's greedy and names the kernels in its banner."""
    from hf_mars.cli import main

    assert main(["serve", "no-such-model", "--kernels", "onednn", "--device", "cuda"]) == 2
    assert "for a model on the CPU" in capsys.readouterr().err
    ckpt, converted, tok = qwen2_onednn
    proc, port = _start(ckpt, tmp_path, "--lossless", "--kernels", "onednn")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        want = tok.decode(_plain(converted, tok, PROMPTS[1], 24), skip_special_tokens=True)
        assert _chat(client, PROMPTS[1], n=24) == want
    finally:
        proc.terminate()
        banner = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "lossless (verify), onednn kernels" in banner
