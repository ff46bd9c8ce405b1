"""The `hf-mars serve` command: its flags, and uvicorn with deadlines for slow clients."""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import threading

from ..bench.kernels import KERNELS
from ..generation.config import MARSGenerationConfig, parse_draft_tree
from .ladder import TauLadder

# server-wide MARS options (τ: the ladder; verify: --lossless; its draft tree: --mars-draft-tree)
SERVER_OPTIONS = ("acceptance", "block_size", "draft_tree")


def add_arguments(p):
    p.add_argument("model", help="A MARS checkpoint: a Hub repo id or a local folder.")
    p.add_argument("--host", default="127.0.0.1", help="Listen address (default loopback; 0.0.0.0 exposes it).")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="The model name clients send and see (default: the folder's name, or the Hub repo id).")
    p.add_argument("--api-key", default=None,
                   help="Require `Authorization: Bearer KEY` on every route but /health (the openai client's "
                        "api_key).")
    p.add_argument("--tau-ladder", default="0:1.0,2:0.99",
                   help="LOAD:TAU rungs: each decoding step, with LOAD requests waiting + decoding, runs the rows "
                        "without their own mars_threshold at the τ of the highest rung <= LOAD (default "
                        "'0:1.0,2:0.99': exact AR when idle).")
    p.add_argument("--lossless", action="store_true",
                   help="Verify mode at every rung: answers equal greedy decoding; load still raises throughput.")
    MARSGenerationConfig.add_arguments(p, SERVER_OPTIONS)
    p.add_argument("--max-batch-size", type=int, default=8,
                   help="Requests decoding at once: a request joins the running batch at its next step, up to this.")
    p.add_argument("--max-queue", type=int, default=256, help="Waiting requests beyond which new ones get 429.")
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="Longer prompts get 413.")
    p.add_argument("--max-tokens-limit", type=int, default=1024,
                   help="Largest max_tokens a request may ask for (400 above); the default for requests without "
                        "(within the model's context).")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="Larger request bodies get 413 (1 MiB).")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="Seconds a client has to send a request's headers, and then its body (408 / closed).")
    p.add_argument("--template-timeout", type=float, default=10.0,
                   help="Seconds the chat template and tokenizer may take for one request (503 above).")
    p.add_argument("--graceful-timeout", type=float, default=60.0,
                   help="On SIGTERM/SIGINT, seconds open requests get to finish before they are cut.")
    p.add_argument("--enable-admin", action="store_true",
                   help="Serve POST /load_model and /reset (off by default; needs --api-key).")
    p.add_argument("--public-metrics", action="store_true", help="Serve /metrics without the API key.")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="Let a request send its own chat template (chat_template_kwargs.chat_template); it runs "
                        "on this server, so only for trusted clients.")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kernels", default="default", choices=list(KERNELS),
                   help="onednn: the model's linear layers on oneDNN's kernels (torch.utils.mkldnn; CPU, eager, "
                        "inference only): on some CPUs MKL's few-row float32 matmuls are slow, a MARS step's most "
                        "of all (see `hf-mars bench --kernels onednn`).")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", default="warning")


def header_deadline_protocol(read_timeout: float):
    """uvicorn's h11 protocol, closing a connection whose next request's headers do not arrive in time.

    uvicorn has no such deadline: its keep-alive timer stops at the first byte, so a client sending a header a
    byte at a time holds a connection (and delays shutdown) for ever. The deadline starts when the connection
    opens or its last response ends, and stops when a request's headers are complete."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        _hf_mars_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._hf_mars_arm()

        def handle_events(self):
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete and self._hf_mars_timer is not None:
                self._hf_mars_timer.cancel()  # a request is in progress: the app's body deadline takes over
                self._hf_mars_timer = None

        def on_response_complete(self):
            super().on_response_complete()
            self._hf_mars_arm()

        def connection_lost(self, exc):
            if self._hf_mars_timer is not None:
                self._hf_mars_timer.cancel()
            super().connection_lost(exc)

        def _hf_mars_arm(self):
            if self._hf_mars_timer is not None:
                self._hf_mars_timer.cancel()
            self._hf_mars_timer = self.loop.call_later(read_timeout, self._hf_mars_expire)

        def _hf_mars_expire(self):
            self._hf_mars_timer = None
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

    return DeadlineH11Protocol


def run(args):
    missing = [m for m in ("fastapi", "uvicorn", "openai", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"hf-mars serve needs {', '.join(missing)}: pip install 'hf-mars[serve]'")
    from ._compat import serve_refusal

    refusal = serve_refusal()  # before loading anything: a clear refusal, not a TypeError on start-up or a request
    if refusal:
        raise ValueError(refusal)
    import uvicorn

    from .app import build_app, served_name

    ladder = TauLadder(args.tau_ladder)
    for name in ("max_batch_size", "max_queue", "max_prompt_tokens", "max_tokens_limit", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("read_timeout", "template_timeout", "graceful_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    options = MARSGenerationConfig.from_arguments(args, SERVER_OPTIONS)
    if "mars_draft_tree" in options:
        if not args.lossless:
            raise ValueError("--mars-draft-tree shapes lossless (verify) decoding: pass --lossless with it.")
        parse_draft_tree(options["mars_draft_tree"])  # a clear error now, not on the first request
    app = build_app(args.model, ladder, served_model_name=args.served_model_name, lossless=args.lossless,
                    max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                    max_prompt_tokens=args.max_prompt_tokens, max_tokens_limit=args.max_tokens_limit,
                    api_key=args.api_key, device=args.device, dtype=args.dtype,
                    trust_remote_code=args.trust_remote_code, mars_options=options, enable_admin=args.enable_admin,
                    public_metrics=args.public_metrics, max_body_bytes=args.max_body_bytes,
                    read_timeout=args.read_timeout, template_timeout=args.template_timeout,
                    trust_request_chat_template=args.trust_request_chat_template, kernels=args.kernels)
    from ._compat import untested_version

    if untested_version():
        print(f"warning: {untested_version()}", flush=True)
    mode = "lossless (verify)" if args.lossless else f"τ ladder {ladder}"
    if args.kernels != "default":
        mode += f", {args.kernels} kernels"
    print(f"hf-mars serve: {served_name(args.model, args.served_model_name)} on http://{args.host}:{args.port}/v1, "
          f"{mode}, batches of up to {args.max_batch_size}; metrics at /metrics", flush=True)
    # uvicorn's shutdown (SIGINT / SIGTERM) stops accepting, then waits up to --graceful-timeout for open requests;
    # the decode thread keeps draining the queue until then
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           http=header_deadline_protocol(args.read_timeout),
                                           timeout_graceful_shutdown=args.graceful_timeout))
    with clean_exit_on_signals(server) as received:
        server.run()
    print("hf-mars serve: shut down" + (f" on {received[-1]}" if received else ""), flush=True)
    return 0


@contextlib.contextmanager
def clean_exit_on_signals(server):
    """SIGINT and SIGTERM shut the server down gracefully and the command exits 0; yields the signals' names.

    uvicorn handles both while it serves, then re-raises the signal to the handler it found: Python's default
    kills the process on SIGTERM (status 143, no shutdown line) and asyncio's raises KeyboardInterrupt on SIGINT
    (a traceback). Ours, installed around the whole run, records the re-raised signal instead; one that arrives
    before uvicorn's handlers are in (the event loop starting) asks the server to exit, as uvicorn's would."""
    received = []
    if threading.current_thread() is not threading.main_thread():  # signals are only delivered to the main thread
        yield received
        return

    def handler(sig, frame):
        received.append(signal.Signals(sig).name)
        server.handle_exit(sig, frame)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)

