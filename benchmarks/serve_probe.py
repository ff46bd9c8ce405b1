"""Probe a running `hf-mars serve` as careless and hostile clients would, and print what each probe found.

    hf-mars serve runs/demo/mars-checkpoint --port 8000 &
    python benchmarks/serve_probe.py --port 8000 [--api-key KEY]

Probes (each independent; the server should be idle when it starts):
- casualties: 6 chat requests and 1 empty-prompt completion with the same settings, sent while a long answer
  decodes (so they wait and batch together): how many of the 6 good ones failed;
- health under a 10 MB body: the slowest /health answer while a 10 MB chat message is sent;
- malformed bodies: the status codes of a table of malformed chat bodies (5xx and 422 are findings);
- abandoned request: tokens the server generated for a non-streaming 200-token request whose client hung up
  0.3 s after sending it (from /metrics);
- stream start: the HTTP status of a stream that cannot start (`max_tokens: 0`), and whether a good stream ends
  with `data: [DONE]`.
"""

import argparse
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request


class Probe:
    def __init__(self, port, key):
        self.port, self.base = port, f"http://127.0.0.1:{port}"
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def post(self, path, body, timeout=300):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=raw, method="POST", headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, socket.timeout) as e:
            return -1, str(e).encode()  # e.g. the server answered 413 and closed before the body was sent

    def metric(self, name):
        req = urllib.request.Request(self.base + "/metrics", headers=self.headers)
        text = urllib.request.urlopen(req, timeout=30).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def health_seconds(self):
        start = time.perf_counter()
        urllib.request.urlopen(self.base + "/health", timeout=120).read()
        return time.perf_counter() - start


def chat(text, max_tokens, **kw):
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, **kw}


def casualties(p):
    long = threading.Thread(target=p.post, args=("/v1/chat/completions", chat("Copy: " + "ab" * 20, 150,
                                                                              mars_threshold=1.0)))
    long.start()
    time.sleep(0.3)
    statuses = {}

    def good(i):
        statuses[i] = p.post("/v1/chat/completions", chat(f"Reverse: q{i}w", 64, mars_threshold=1.0))[0]

    threads = [threading.Thread(target=good, args=(i,)) for i in range(6)]
    bad = threading.Thread(target=lambda: statuses.update(
        bad=p.post("/v1/completions", {"prompt": "", "max_tokens": 64, "temperature": 0, "mars_threshold": 1.0})[0]))
    for t in threads[:3] + [bad] + threads[3:]:
        t.start()
    for t in threads + [bad, long]:
        t.join()
    return {"good_failed": sum(statuses[i] != 200 for i in range(6)), "empty_prompt_status": statuses["bad"]}


def health_under_big_body(p):
    status = []
    sender = threading.Thread(target=lambda: status.append(
        p.post("/v1/chat/completions", chat("x" * 10_000_000, 4))[0]))
    sender.start()
    worst = 0.0
    while sender.is_alive():
        worst = max(worst, p.health_seconds())
        time.sleep(0.05)
    sender.join()
    return {"worst_health_s": round(worst, 3), "big_body_status": status[0]}  # -1: closed after an early 413


MALFORMED = [{"messages": [{"content": "x"}]}, {"messages": [{"role": 5, "content": "x"}]},
             {"messages": [{"role": "user", "content": {"a": 1}}]}, chat("x", [5]), chat("x", 5.7), chat("x", "10"),
             chat("x", True), chat("x", 4, temperature=-1), chat("x", 4, top_p=5), chat("x", 4, n=3),
             chat("x", 4, n=0), chat("x", 4, stop=123), chat("x", 4, stop=[None]), chat("x", 4, logit_bias=[1]),
             chat("x", 4, chat_template_kwargs=["a"]), chat("x", 4, generation_config={"max_new_tokens": 4}),
             chat("x", 4, unknown_field=1), chat("x", 4, stop=[]), {"messages": []}, {"messages": "hi"}]
RAW = [json.dumps(chat("x", 4)).replace('"max_tokens": 4', '"max_tokens": 1e400').encode(),
       json.dumps(chat("x", 4)).replace('"temperature": 0', '"temperature": NaN').encode(),
       json.dumps(chat("\ud800", 4)).encode()]


def malformed(p):
    codes = [p.post("/v1/chat/completions", body)[0] for body in MALFORMED + RAW]
    codes.append(p.post("/v1/responses", {"model": "x"})[0])
    counts = {}
    for c in codes:
        counts[str(c)] = counts.get(str(c), 0) + 1
    return {"bodies": len(codes), "status_counts": counts}


def abandoned(p):
    body = json.dumps(chat("go", 200, mars_threshold=1.0, generation_config=json.dumps(
        {"min_new_tokens": 200, "max_new_tokens": 200}))).encode()
    before = p.metric("hf_mars_generated_tokens_total")
    sock = socket.create_connection(("127.0.0.1", p.port))
    head = "".join(f"{k}: {v}\r\n" for k, v in p.headers.items())
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{head}Content-Length: {len(body)}\r\n\r\n"
                 .encode() + body)
    time.sleep(0.3)
    sock.close()  # 0.3 s after sending: the answer (200 tokens) is still being decoded
    time.sleep(5)
    return {"tokens_generated_for_it": p.metric("hf_mars_generated_tokens_total") - before}


def stream_start(p):
    status, _ = p.post("/v1/chat/completions", chat("x", 0, stream=True))
    _, body = p.post("/v1/chat/completions", chat("Reverse: abc", 8, stream=True))
    return {"max_tokens_0_stream_status": status, "good_stream_ends_with_done": body.rstrip().endswith(b"[DONE]")}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--probes", default="casualties,health_under_big_body,malformed,abandoned,stream_start")
    args = ap.parse_args()
    probe = Probe(args.port, args.api_key)
    for name in args.probes.split(","):
        print(json.dumps({name: globals()[name](probe)}), flush=True)
