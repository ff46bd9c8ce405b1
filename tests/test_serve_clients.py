"""`hf-mars serve` as a real process on loopback, against slow, vanishing and mixed clients.

Raw sockets play the clients uvicorn itself meets (a body that never finishes, headers sent a byte at a time, a
client that hangs up while its answer is decoded); the official `openai` client sends mixed good and bad traffic
at once. The model is a position-only GPT-2 with a long context (so one answer can take seconds at τ = 1).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from servers import free_port, save_checkpoint, start_mars_server, stop_server

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

READ_TIMEOUT = 2
FLAGS = ("--lossless", "--api-key", "sk-test", "--max-tokens-limit", "1600", "--read-timeout", str(READ_TIMEOUT),
         "--template-timeout", "1", "--trust-request-chat-template", "--max-body-bytes", "100000")


@pytest.fixture(scope="module")
def tiny():
    from test_stateful_clients import position_only_model

    from hf_mars.testing_utils import build_char_tokenizer

    tok = build_char_tokenizer()
    return position_only_model(tok, n_positions=2048), tok


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clients")
    return save_checkpoint(*tiny, tmp / "ckpt"), tmp


def _start(ckpt, tmp, *flags):
    return start_mars_server(ckpt, tmp, *flags)


@pytest.fixture(scope="module")
def server(ckpt):
    proc, port = _start(*ckpt, *FLAGS)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-test", max_retries=0, timeout=120)
    yield client, port
    stop_server(proc, timeout=60)


def _health_seconds(port):
    start = time.perf_counter()
    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30).read()
    return time.perf_counter() - start


def _metric(port, name):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer sk-test"})
    for line in urllib.request.urlopen(req, timeout=10).read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _raw(port, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(data)
    return sock


def _read_all(sock) -> bytes:
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\n"
        b"Content-Type: application/json\r\n")


@pytest.mark.timeout(300)
def test_slow_and_oversized_clients_are_cut_off(server):
    _, port = server
    # a body that never finishes: 408 and the connection closed once --read-timeout has passed
    start = time.time()
    sock = _raw(port, HEAD + b"Content-Length: 138\r\n\r\n" + b'{"model": ')
    answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in answer, answer[:300]
    assert READ_TIMEOUT <= time.time() - start < READ_TIMEOUT + 10
    # headers sent slowly: the connection is closed, nothing is answered
    start = time.time()
    sock = _raw(port, b"POST /v1/chat/comp")
    assert _read_all(sock) == b""
    assert time.time() - start < READ_TIMEOUT + 10
    # a body over --max-body-bytes, declared or chunked: 413 without reading it
    sock = _raw(port, HEAD + b"Content-Length: 2000000\r\n\r\n")
    assert _read_all(sock).startswith(b"HTTP/1.1 413")
    chunk = b"x" * 60000
    sock = _raw(port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2)
    assert b"body_too_large" in _read_all(sock)
    assert _health_seconds(port) < 5


@pytest.mark.timeout(300)
def test_a_slow_chat_template_never_stalls_the_server(server):
    client, port = server
    # a request's own template (allowed by --trust-request-chat-template) that loops for seconds
    loop = "{% for i in range(100000) %}{% for j in range(600) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
    result = {}

    def ask():
        try:
            client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                           extra_body={"chat_template_kwargs": {"chat_template": loop}})
            result["status"] = 200
        except openai.APIStatusError as e:
            result["status"], result["code"] = e.status_code, e.body.get("code") if isinstance(e.body, dict) else None

    thread = threading.Thread(target=ask)
    thread.start()
    time.sleep(0.3)
    worst = max(_health_seconds(port) for _ in range(5))
    thread.join(timeout=120)
    assert worst < 1.0, f"/health took {worst:.2f} s while a template rendered"
    assert result["status"] == 503, result  # over --template-timeout
    big = "y" * 200000  # a body over --max-body-bytes
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": big}], max_tokens=4)
    assert err.value.status_code == 413


@pytest.mark.timeout(300)
def test_a_non_streaming_request_whose_client_left_is_cancelled(server, tiny):
    client, port = server
    gen = json.dumps({"min_new_tokens": 1500, "max_new_tokens": 1500})
    body = json.dumps({"model": "ckpt", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500,
                       "mars_threshold": 1.0, "generation_config": gen}).encode()
    before = _metric(port, "hf_mars_requests_cancelled_total")
    sock = _raw(port, HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(1.0)  # decoding has started
    sock.close()  # the client goes away without reading the answer
    deadline = time.time() + 60
    while _metric(port, "hf_mars_requests_cancelled_total") < before + 1:
        assert time.time() < deadline, "the abandoned request kept decoding"
        time.sleep(0.2)
    start = time.time()
    assert client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0).choices[0].message.content
    assert time.time() - start < 30


@pytest.mark.timeout(600)
def test_mixed_good_and_bad_traffic_loses_no_good_request(server, tiny):
    client, port = server
    model, tok = tiny
    texts = [f"Question {i}: " + "ab" * (i % 5) for i in range(16)]
    bad = [dict(max_tokens=0), dict(temperature=-1), dict(n=2), dict(extra_body={"mars_threshold": 3}),
           dict(messages=[{"role": "user", "content": "x" * 3000}]), dict(extra_body={"prompt_junk": 1}),
           dict(stop=[""] * 5), dict(extra_body={"generation_config": {"num_beams": 8}})]

    def want(text):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=24, do_sample=False, mars=False)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    results, errors = {}, {}

    def good(i):
        r = client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": texts[i]}],
                                           max_tokens=24, temperature=0, stream=i % 2 == 1)
        results[i] = r.choices[0].message.content if i % 2 == 0 else \
            "".join(c.choices[0].delta.content or "" for c in r if c.choices)

    def wrong(j):
        args = dict(model="ckpt", messages=[{"role": "user", "content": "bad"}], max_tokens=8)
        args.update(bad[j % len(bad)])
        try:
            client.chat.completions.create(**args)
            errors[j] = 200
        except openai.APIStatusError as e:
            errors[j] = e.status_code

    threads = [threading.Thread(target=good, args=(i,)) for i in range(16)] + \
              [threading.Thread(target=wrong, args=(j,)) for j in range(16)]
    order = list(range(32))
    order[::2], order[1::2] = list(range(16)), list(range(16, 32))  # good and bad interleaved
    for k in order:
        threads[k].start()
    for t in threads:
        t.join(timeout=300)
    assert {i: results.get(i) for i in range(16)} == {i: want(texts[i]) for i in range(16)}
    assert len(errors) == 16 and all(400 <= s < 500 for s in errors.values()), errors


@pytest.mark.timeout(300)
def test_shutdown_is_not_held_by_a_half_sent_body(ckpt):
    proc, port = _start(*ckpt, *FLAGS, "--graceful-timeout", "30")
    sock = _raw(port, HEAD + b"Content-Length: 138\r\n\r\n" + b'{"model"')  # never finished
    time.sleep(0.3)
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert time.time() - start < READ_TIMEOUT + 10
    sock.close()
    proc.stdout.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_at_start(ckpt, key):
    """`--api-key "$KEY"` with KEY unset must not start a server with every route open."""
    cli = Path(sys.executable).with_name("hf-mars")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(ckpt[1] / "modules"), OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([str(cli), "serve", str(ckpt[0]), "--port", str(free_port()), "--api-key", key],
                              env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("hf-mars serve started with an empty --api-key")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("hf-mars serve: error: --api-key is empty")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_shut_down_alike_answering_open_requests(ckpt, sig):
    """`kill` (SIGTERM) is a clean shutdown like Ctrl+C: the open request is answered in full, one shutdown line,
    exit status 0 (uvicorn re-raises the signal once it is done: the default SIGTERM handler would kill the
    process with 143, asyncio's SIGINT one raise KeyboardInterrupt)."""
    proc, port = _start(*ckpt, *FLAGS)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-test", max_retries=0, timeout=120)
    gen = json.dumps({"min_new_tokens": 400, "max_new_tokens": 400, "do_sample": False})
    stream = client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "go"}],
                                            max_tokens=400, stream=True,
                                            extra_body={"generation_config": gen, "mars_threshold": 1.0})
    chunks = iter(stream)
    text = next(c for c in chunks if c.choices and c.choices[0].delta.content).choices[0].delta.content
    proc.send_signal(sig)  # τ = 1: one token per forward, the answer is still being decoded
    finish = None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        out = proc.stdout.read()
        proc.stdout.close()
    assert finish == "length" and len(text) == 400  # a character-level tokenizer: one character per token
    assert f"hf-mars serve: shut down on {sig.name}" in out.splitlines()
    assert "Traceback" not in out
