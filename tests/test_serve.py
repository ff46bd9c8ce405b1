"""MARS through `transformers serve`: a real server process on loopback, the official `openai` client.

The request's `generation_config` (a JSON string in the body, as transformers serve reads it) switches MARS on
with `"mars": true`; without it the checkpoint answers as the AR model. The server is `transformers serve` with the
`hf_mars.generation.stats` logger sent to a file at DEBUG (one record per MARS call, written by the checkpoint's
custom_generate), so the test sees the forwards the server ran. The logger is set up by a `sitecustomize` module
on the server's path, so it also holds in the model's own process (transformers 5.25 spawns one).
"""

import json
import os
import subprocess
import sys
import time

import pytest
from servers import free_port, stop_server

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


# run at the start of every Python process of the server: MARS's per-call statistics logger (see
# hf_mars.generation.api) appended to the file $MARS_TEST_STATS
_STATS_SITECUSTOMIZE = """
import logging, os
handler = logging.FileHandler(os.environ["MARS_TEST_STATS"], encoding="utf-8")
handler.setFormatter(logging.Formatter("%(message)s"))
stats = logging.getLogger("hf_mars.generation.stats")
stats.addHandler(handler)
stats.setLevel(logging.DEBUG)
"""
_SERVE = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; sys.exit(main())"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_stateful_clients import position_only_model

    from hf_mars import save_for_hub
    from hf_mars.testing_utils import build_char_tokenizer
    from hf_mars.training.tokens import set_mars_metadata

    tmp = tmp_path_factory.mktemp("serve")
    tok = build_char_tokenizer()
    model = position_only_model(tok)  # drafts mostly right: verify takes several tokens per forward
    set_mars_metadata(model.config, block_size=4, trained_steps=1)
    ckpt = save_for_hub(model, tok, tmp / "ckpt")
    port = free_port()
    stats = tmp / "stats.jsonl"
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_STATS_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp / "modules"), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", MARS_TEST_STATS=str(stats), PYTHONPATH=path)
    args = ["serve", str(ckpt), "--trust-remote-code", "--host", "127.0.0.1", "--port", str(port)]
    cmd = [sys.executable, "-c", _SERVE, *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    deadline = time.time() + 90
    while True:  # bounded wait for the server to come up
        try:
            client.models.list()
            break
        except Exception:  # noqa: BLE001 - not listening yet
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail("transformers serve did not start:\n" + (proc.stdout.read() or "")[-3000:])
            time.sleep(0.5)
    yield client, str(ckpt), stats
    stop_server(proc)


def _ask(client, model, gen=None, stream=False):
    kw = dict(model=model, messages=[{"role": "user", "content": "Reverse: abcdef"}], max_tokens=24, temperature=0,
              extra_body={"generation_config": json.dumps(gen)} if gen else None)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    return client.chat.completions.create(**kw).choices[0].message.content


def _stats(path):
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line.removeprefix("MARS call: ")) for line in lines if line.startswith("MARS call: ")]


@pytest.mark.timeout(300)
def test_transformers_serve_answers_with_mars_per_request(server):
    client, model, stats = server
    gen = {"max_new_tokens": 24, "do_sample": False}
    plain = _ask(client, model, gen)
    assert _stats(stats) == []  # without MARS settings the checkpoint answers as the AR model
    assert _ask(client, model, {**gen, "mars": True, "mars_threshold": 1.0}) == plain
    assert _ask(client, model, {**gen, "mars": True, "mars_verify": True}) == plain
    assert _ask(client, model, {**gen, "mars": True, "mars_verify": True}, stream=True) == plain
    assert _ask(client, model, gen, stream=True) == plain
    calls = _stats(stats)
    assert len(calls) == 3
    tau1, verify, verify_stream = calls
    assert tau1["threshold"] == 1.0 and sum(tau1["forward_passes"]) == sum(tau1["emitted_tokens"])
    for call in (verify, verify_stream):
        assert call["verify"] and sum(call["emitted_tokens"]) > sum(call["forward_passes"])  # fewer forwards
