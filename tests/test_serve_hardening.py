"""`hf-mars serve` against careless and hostile clients, in process (the real app through Starlette's TestClient).

One regression test per finding of the hardening review: requests refused in full before they are queued (schema,
ranges, the model's context), OpenAI sampling semantics, one bad request never failing the others, streams that
answer their real status and end with [DONE], closed admin doors, bounded metric labels, and a seeded fuzz of
malformed bodies. The uvicorn-level findings (read deadlines, disconnects, shutdown) are in
`test_serve_clients.py`. The model is a position-only GPT-2 with a 256-position context, like the demo's.
"""

import json
import random

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from hf_mars.serve import MARSBatchingManager, TauLadder  # noqa: E402
from hf_mars.serve.app import build_app  # noqa: E402

KEY = {"Authorization": "Bearer sk-test"}
CONTEXT = 256


@pytest.fixture(scope="module")
def tiny():
    from test_stateful_clients import position_only_model

    from hf_mars.testing_utils import build_char_tokenizer

    tok = build_char_tokenizer()
    return position_only_model(tok, n_positions=CONTEXT), tok


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory):
    from servers import save_checkpoint

    return save_checkpoint(*tiny, tmp_path_factory.mktemp("hardening") / "ckpt")


def _app(ckpt, **kw):
    args = dict(lossless=True, api_key="sk-test", max_prompt_tokens=200, max_tokens_limit=512, template_timeout=5)
    return build_app(str(ckpt), TauLadder("0:1.0,2:0.9"), **{**args, **kw})


@pytest.fixture(scope="module")
def client(ckpt):
    with TestClient(_app(ckpt, enable_admin=True)) as c:
        yield c


def _greedy(tiny, text, n, chat=True):
    model, tok = tiny
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(text, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, mars=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _chat(text="Reverse: abc", **kw):
    return {"model": "ckpt", "messages": [{"role": "user", "content": text}], "max_tokens": 12, "temperature": 0,
            **kw}


def _post(client, path, body, headers=KEY):
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(path, content=raw, headers={"Content-Type": "application/json", **headers})


def _refused(response, status, code=None):
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


# ------------------------------------------------------------------------------------- malformed bodies: 400, not 500
BAD_CHAT = [  # (the body, or raw JSON text; the param the error names)
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": 5, "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": {"a": 1}}]}, "messages.0.content"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    (_chat(max_tokens=[5]), "max_tokens"),
    (_chat(max_tokens=5.7), "max_tokens"),
    (_chat(max_tokens="10"), "max_tokens"),
    (_chat(max_tokens=True), "max_tokens"),
    (_chat(max_tokens=0), "max_tokens"),
    (json.dumps(_chat()).replace('"max_tokens": 12', '"max_tokens": 1e400'), "max_tokens"),
    (_chat(temperature=-1), "temperature"),
    (json.dumps(_chat()).replace('"temperature": 0', '"temperature": NaN'), "temperature"),
    (json.dumps(_chat()).replace('"temperature": 0', '"temperature": Infinity'), "temperature"),
    (_chat(top_p=5), "top_p"),
    (_chat(n=3), "n"),
    (_chat(n=0), "n"),
    (_chat(stop=123), "stop"),
    (_chat(stop=[None]), "stop"),
    (_chat(logit_bias=[1, 2]), "logit_bias"),
    (_chat(logit_bias={"x": 1}), "logit_bias"),
    (_chat(logit_bias={"99999": 1}), "logit_bias"),
    (_chat(chat_template_kwargs=["a"]), "chat_template_kwargs"),
    (_chat(chat_template_kwargs={"chat_template": "{{ 1 }}"}), "chat_template_kwargs"),
    (_chat(brand_new_field=1), "brand_new_field"),
    (_chat(generation_config="{not json"), "generation_config"),
    (_chat(generation_config={"num_beams": 64}), "generation_config"),
    (_chat(generation_config={"mars_acceptance": "bogus"}), "generation_config"),
    (_chat(generation_config={"max_new_tokens": "5"}), "generation_config"),
    (_chat(mars_threshold=1.5), "mars_threshold"),
    (_chat(logprobs=True), "logprobs"),
    (_chat(frequency_penalty=1.0), "frequency_penalty"),
    (_chat(response_format={"type": "json_object"}), "response_format"),
    (_chat(tool_choice="required"), "tool_choice"),
    (json.dumps(_chat("x")).replace('"x"', '"\\ud800"'), "messages.0.content"),
    (b'{"model": "ckpt", "messages": [', None),
    (b"[1, 2]", None),
    (b"[" * 100000 + b"]" * 100000, None),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=range(len(BAD_CHAT)))
def test_malformed_chat_requests_are_400_naming_the_field(client, body, param):
    error = _refused(_post(client, "/v1/chat/completions", body), 400)
    if param is not None:
        assert error["param"] == param, error


def test_other_routes_refuse_malformed_bodies(client):
    _refused(_post(client, "/v1/responses", {"model": "ckpt"}), 400)  # no input
    _refused(_post(client, "/v1/completions", {"model": "ckpt", "prompt": "", "max_tokens": 5}), 400, "empty_prompt")
    _refused(_post(client, "/v1/completions", {"prompt": "ab", "echo": True}), 400, "unsupported_value")
    _refused(_post(client, "/v1/completions", {"prompt": ["a", "b"]}), 400)
    _refused(_post(client, "/v1/audio/transcriptions", {}), 404, "not_found")
    _refused(client.get("/v1/chat/completions", headers=KEY), 405)
    _refused(_post(client, "/v1/chat/completions", _chat(model="other")), 404, "model_not_found")


def test_accepted_variants_answer_like_greedy(client, tiny):
    want = _greedy(tiny, "Reverse: abc", 12)

    def content(body):
        r = _post(client, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    assert content(_chat()) == want
    assert content(_chat(stop=[])) == want  # an empty stop list is no stop (not a tokenizer error)
    assert content(_chat(generation_config={"max_new_tokens": 12})) == want  # an object, as well as a JSON string
    assert content(_chat(n=1, user="u", metadata={"a": "b"}, store=False, stream_options={"include_usage": True},
                         presence_penalty=0, messages=[{"role": "user", "content": "Reverse: abc",
                                                        "refusal": None}])) == want


# ------------------------------------------------------------------------------------- the model's context
def test_responses_route_answers_and_names_itself(client, tiny):
    r = _post(client, "/v1/responses", {"input": [{"role": "user", "content": "Reverse: abc"}],
                                        "max_output_tokens": 12, "temperature": 0, "stream": False})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("resp_") and not out["id"].startswith("resp_resp_") and out["model"] == "ckpt"
    assert out["output"][0]["content"][0]["text"] == _greedy(tiny, "Reverse: abc", 12)


def test_lengths_are_checked_against_the_models_context(client, tiny):
    model, tok = tiny
    prompt = "Copy: " + "ab" * 40
    n_prompt = len(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"])
    room = CONTEXT - n_prompt
    _refused(_post(client, "/v1/chat/completions", _chat(prompt, max_tokens=room + 1)), 400,
             "context_length_exceeded")
    _refused(_post(client, "/v1/chat/completions", _chat("x" * 300)), 413, "prompt_too_long")
    # the whole context, exactly: prompt + max_tokens = 256 (MARS's trailing masks reach past it)
    gen = {"min_new_tokens": room, "max_new_tokens": room}
    r = _post(client, "/v1/chat/completions", _chat(prompt, max_tokens=room, generation_config=gen))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == room, r.text
    # no max_tokens: at most what the context leaves (not the server's 512)
    body = _chat(prompt, generation_config={"min_new_tokens": room})
    del body["max_tokens"]
    r = _post(client, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == room, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------------------------- sampling as OpenAI defines it
def test_temperature_turns_sampling_on_and_the_seed_reproduces_it(client, tiny):
    greedy = _greedy(tiny, "Sort: qwerty", 24)

    def answer(**kw):
        r = _post(client, "/v1/chat/completions", _chat("Sort: qwerty", max_tokens=24, **kw))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    assert answer(temperature=0) == greedy
    sampled = [answer(temperature=1.5, seed=s) for s in range(4)]
    assert any(text != greedy for text in sampled), "temperature > 0 must sample"
    assert answer(temperature=1.5, seed=2) == sampled[2]  # a seed is one request's own generator state


# ------------------------------------------------------------------------------------- one bad request fails alone
def test_a_request_that_fails_in_a_batch_fails_alone(tiny):
    import asyncio

    from transformers import GenerationConfig

    model, tok = tiny
    manager = MARSBatchingManager(TauLadder("0:1.0"), lossless=True, max_batch_size=8)
    gc = GenerationConfig(max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id)
    texts = ["Reverse: abc", "Copy: hello", "Sort: qwerty", "Copy: x", "Reverse: zz", "Sort: ba"]

    def ids(text):
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"]

    async def burst():
        with manager._cond:  # every request waits together, the empty one among them
            inputs = [ids(t) for t in texts[:3]] + [torch.zeros(1, 0, dtype=torch.long)] + [ids(t) for t in texts[3:]]
            tasks = [asyncio.ensure_future(manager.generate_non_streaming(model, tok, {"input_ids": x}, gc, f"r{i}"))
                     for i, x in enumerate(inputs)]
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(burst())
    assert isinstance(results[3], ValueError)
    good = results[:3] + results[4:]
    assert [text for text, _, _ in good] == [_greedy(tiny, t, 16) for t in texts]
    assert manager.metrics.registry.get_sample_value("hf_mars_requests_failed_alone_total") == 1
    manager.stop()


# ------------------------------------------------------------------------------------- streams
def _sse(response):
    return [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]


def test_streams_end_with_done_and_carry_our_id_and_name(client, tiny):
    r = _post(client, "/v1/chat/completions", _chat(stream=True), headers={**KEY, "X-Request-ID": "client-id"})
    assert r.status_code == 200
    events = _sse(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == _greedy(tiny, "Reverse: abc", 12)
    assert {c["model"] for c in chunks} == {"ckpt"}  # the folder's name, never its path
    assert {c["id"] for c in chunks} != {"client-id"} and chunks[0]["id"].startswith("chatcmpl-")
    r = _post(client, "/v1/completions", {"prompt": "abc", "max_tokens": 5, "stream": True})
    assert _sse(r)[-1] == "[DONE]"
    _refused(_post(client, "/v1/chat/completions", _chat(stream=True, max_tokens=0)), 400)


def test_a_stream_that_fails_answers_its_status_or_an_error_event(client, monkeypatch):
    assert _post(client, "/v1/chat/completions", _chat()).status_code == 200  # the model is loaded
    from hf_mars.generation.engine import MARSEngine

    def fails_at_once(self, *args, **kwargs):  # the request's own first step (its prefill) fails
        raise ValueError('cannot decode "this"')

    monkeypatch.setattr(MARSEngine, "add", fails_at_once)
    error = _refused(_post(client, "/v1/chat/completions", _chat(stream=True)), 400)
    assert error["message"] == 'cannot decode "this"'
    monkeypatch.undo()

    def fails_after_tokens(self, *args, **kwargs):  # tokens streamed (the prefill's), then a step fails
        raise RuntimeError('broke "mid-way"')

    monkeypatch.setattr(MARSEngine, "step", fails_after_tokens)
    r = _post(client, "/v1/chat/completions", _chat(stream=True))
    assert r.status_code == 200
    events = _sse(r)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])  # valid JSON although the message has quotes
    assert last["error"]["type"] == "server_error" and last["error"]["code"] == "internal_error"
    monkeypatch.undo()
    assert _post(client, "/v1/chat/completions", _chat()).status_code == 200


# ------------------------------------------------------------------------------------- doors and labels
def test_admin_routes_are_off_by_default_and_behind_the_key(ckpt, client):
    with pytest.raises(ValueError, match="--api-key"):
        _app(ckpt, api_key=None, enable_admin=True)
    with TestClient(_app(ckpt)) as default:
        for path in ("/reset", "/load_model"):
            _refused(_post(default, path, {"model": "ckpt"}), 404)
        for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
            _refused(default.get(path), 401, "invalid_api_key")
            assert default.get(path, headers=KEY).status_code == 200
        assert default.get("/health").status_code == 200
    with TestClient(_app(ckpt, public_metrics=True)) as public:
        assert public.get("/metrics").status_code == 200
    # --enable-admin: behind the key; /load_model names the served model only and never touches other paths
    _refused(_post(client, "/reset", {}, headers={}), 401)
    for name in ("../", "/etc", str(ckpt.parent)):
        error = _refused(_post(client, "/load_model", {"model": name}), 404, "model_not_found")
        assert name not in error["message"]
    assert _post(client, "/reset", {}).status_code == 200
    assert _post(client, "/v1/chat/completions", _chat()).status_code == 200  # loaded again on demand
    assert _post(client, "/load_model", {"model": "ckpt"}).status_code == 200


def test_metric_labels_come_from_a_fixed_set(client):
    rng = random.Random(0)
    for _ in range(40):
        client.get("/" + "".join(rng.choice("abcdef/") for _ in range(12)), headers=KEY)
    for tau in (0.91, 0.92, 0.93, 0.5, 0.05, 1.0):
        assert _post(client, "/v1/chat/completions", _chat(max_tokens=4, mars_threshold=tau)).status_code == 200
    text = client.get("/metrics", headers=KEY).text
    paths = {line.split('path="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("hf_mars_requests_total{")}
    routes = {route.path for route in client.app.router.routes}
    assert paths <= routes | {"other"} and "other" in paths, paths
    taus = {line.split('tau="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("hf_mars_batches_total{")}
    assert taus <= {"verify 0.3", "verify 1", "verify 0.9", "verify <0.9"}, taus


# ------------------------------------------------------------------------------------- fuzz
WRONG = [None, True, False, -1, 0, 1e300, 2.5, "", "x", "\u0000", [], [None], [1, "a"], {}, {"a": [1]}, "\ud800",
         {"role": "user"}, [{"role": "user", "content": 5}], 10**30, -0.0]
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream", "stop",
          "seed", "logit_bias", "tools", "tool_choice", "generation_config", "mars_threshold", "chat_template_kwargs",
          "response_format", "stream_options", "logprobs", "user", "zzz"]


def _mutate(rng):
    body = _chat(max_tokens=4)
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.6:
            body[rng.choice(FIELDS)] = rng.choice(WRONG)
        elif kind < 0.75:
            message = {"role": "user", "content": "Reverse: abc"}
            message[rng.choice(["role", "content", "tool_calls", "name", "x"])] = rng.choice(WRONG)
            body["messages"] = [message]
        elif kind < 0.9:
            body.pop(rng.choice(list(body) or ["model"]), None)
        else:
            return json.dumps(body)[: rng.randint(0, 40)]  # truncated JSON
    return body


@pytest.mark.timeout(600)
def test_fuzzed_bodies_are_4xx_errors_and_good_requests_stay_exact(client, tiny):
    rng = random.Random(1234)
    want = _greedy(tiny, "Reverse: abc", 12)
    seen = {}
    for group in range(6):
        for _ in range(50):
            body = _mutate(rng)
            path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/responses"])
            r = _post(client, path, body)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, body, r.text)
            if r.status_code >= 400:
                _refused(r, r.status_code)
        good = _post(client, "/v1/chat/completions", _chat())
        assert good.json()["choices"][0]["message"]["content"] == want, (group, good.text)
    assert seen.get(400, 0) > 200, seen
