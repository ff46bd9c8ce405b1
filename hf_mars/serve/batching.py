"""The generation manager: in-flight MARS batching.

One worker thread owns the model (as transformers' `InferenceThread` does); requests queue in arrival order. A
MARS request joins the running batch at the next step (`MARSEngine`: its prompt is prefilled alone, then merged
into the batch), up to ``max_batch_size`` rows, and leaves it when done, so a short answer never waits for a long
one. Each step runs at the τ the ladder gives for the live load (waiting + decoding requests), per row: a
request's own ``mars_threshold`` stays its own. A request whose client went away (stream closed, or a
non-streaming request whose connection dropped) leaves at the next step. Rows whose settings cannot share the
batch (processors or criteria that read the history: penalties, stop strings, minimum lengths) step beside it,
round-robin; plain (non-MARS) and seeded requests decode alone in one `generate` call between steps. If a step
fails, each request that has not streamed anything yet is decoded again on its own: one bad request fails alone.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from . import _compat as tf
from ..generation import DEFAULT_VERIFY_THRESHOLD
from ..generation.engine import MARSEngine
from .errors import HTTPError
from .ladder import TauLadder
from .metrics import Metrics


@dataclass
class _Job:
    input_ids: list | None
    gen_config: object
    key: str
    tau: float | None  # the request's own mars_threshold (overrides the ladder)
    mars: bool
    seed: int | None = None
    streamer: object = None  # transformers' DirectStreamer (streaming requests)
    future: object = None  # non-streaming requests: an asyncio future; plain calls: a concurrent.futures one
    loop: object = None  # the asyncio future's event loop (None: resolve from this thread)
    call: tuple | None = None  # (fn, args, kwargs): a plain call to run on the model's thread
    arrived: float = field(default_factory=time.perf_counter)
    gone: threading.Event = field(default_factory=threading.Event)  # the client went away
    started: asyncio.Event | None = None  # set (on `loop`) at the first streamed tokens or the end
    error: BaseException | None = None
    streamed: int = 0  # tokens handed to the streamer
    tokens: list = field(default_factory=list)  # in-flight rows: the tokens emitted so far
    prompt_sent: bool = False  # transformers' streamer takes the prompt first (and skips it)

    def cancelled(self) -> bool:
        return self.gone.is_set() or (self.streamer is not None and tf.stream_cancelled(self.streamer))

    def mark_started(self):
        if self.started is not None:
            self.loop.call_soon_threadsafe(self.started.set)

    def resolve(self, result=None, error=None):
        """Hand a non-streaming (or call) result back to its event loop; a streamed one ends its stream."""
        self.error = error
        if self.future is not None:
            def done():
                if not self.future.done():
                    self.future.set_exception(error) if error is not None else self.future.set_result(result)
            self.loop.call_soon_threadsafe(done) if self.loop is not None else done()
        elif self.streamer is not None:
            if error is not None:
                tf.stream_fail(self.streamer, str(error))
            else:
                self.streamer.end()
        self.mark_started()


class _JobStreamer:
    """Hands a request's own `generate` call's new tokens to its transformers streamer (the prompt, which
    `generate` hands first, was already sent)."""

    def __init__(self, job):
        self.job, self.first = job, True

    def put(self, value):
        job = self.job
        if self.first:  # the prompt
            self.first = False
            return
        tokens = value.reshape(-1)
        if len(tokens) == 0 or job.cancelled():
            return
        try:
            job.streamer.put(tokens)
        except tf.generation_cancelled_error():
            return  # the call is stopped by _Cancelled at its next check
        if not job.streamed:
            job.mark_started()
        job.streamed += len(tokens)

    def end(self):
        pass  # the request's stream is ended once its result is known


class _Cancelled:
    """Stops a call whose client disconnected, so it does not decode for nobody."""

    mars_stateless = True  # depends on the client, not on which positions it has seen: the fast path may call it

    def __init__(self, job):
        self.job = job

    def __call__(self, input_ids, scores=None, **kwargs):
        return torch.full((input_ids.shape[0],), self.job.cancelled(), dtype=torch.bool, device=input_ids.device)


class MARSBatchingManager:
    """transformers serve's generation-manager interface, decoding waiting requests together with MARS."""

    def __init__(self, ladder: TauLadder, lossless: bool = False, max_batch_size: int = 8, max_queue: int = 256,
                 mars_options: dict | None = None, metrics: Metrics | None = None):
        if max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {max_batch_size}")
        if max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {max_queue}")
        self.ladder, self.lossless = ladder, lossless
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.mars_options = dict(mars_options or {})
        self.metrics = metrics or Metrics()
        self.model = self.processor = None
        self.jobs: dict[str, _Job] = {}  # request id -> its job, until the app has read it (see `job_for`)
        self._waiting: deque[_Job] = deque()
        self._in_flight = 0
        self._emitted = self._forwards = 0  # over finished in-flight requests: tokens per forward
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="hf-mars-decode", daemon=True)
        self._thread.start()

    # ---- the interface transformers' handlers call
    def init_cb(self, model, gen_config):
        pass

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        streamer = tf.make_streamer(processor, loop, queue, response_parser=response_parser)
        job = self._job(model, processor, inputs, gen_config, streamer=streamer, loop=loop, started=asyncio.Event())
        self._submit(job, request_id)
        return queue, streamer

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        loop = asyncio.get_running_loop()
        job = self._job(model, processor, inputs, gen_config, future=loop.create_future(), loop=loop)
        self._submit(job, request_id)
        try:
            generated_ids = await job.future
        except asyncio.CancelledError:  # the client went away: its row stops at the next step
            job.gone.set()
            raise
        text = processor.decode(generated_ids, skip_special_tokens=True)
        return text, len(job.input_ids), generated_ids

    def job_for(self, request_id: str) -> _Job | None:
        """The job a handler queued for ``request_id`` (the app watches its start and its client)."""
        return self.jobs.pop(request_id, None)

    def submit(self, fn, *args, **kwargs):
        from concurrent.futures import Future

        job = _Job(None, None, key="call", tau=None, mars=False, call=(fn, args, kwargs), future=Future())
        self._submit(job, check_queue=False)
        return job.future

    def async_submit(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        job = _Job(None, None, key="call", tau=None, mars=False, call=(fn, args, kwargs), future=loop.create_future(),
                   loop=loop)
        self._submit(job, check_queue=False)
        return job.future

    def stop(self):
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # ---- queueing
    def _job(self, model, processor, inputs, gen_config, **kw) -> _Job:
        self.model, self.processor = model, processor
        ids = inputs["input_ids"]
        ids = (ids[0] if ids.ndim == 2 else ids).tolist() if torch.is_tensor(ids) else list(ids)
        tau = getattr(gen_config, "_hf_mars_request_tau", None)
        seed = getattr(gen_config, "_hf_mars_seed", None)
        mars = getattr(gen_config, "mars", True) is not False
        settings = gen_config.to_json_string(use_diff=True)
        # plain (non-MARS) requests decode one per call (transformers' batched streamer output cannot tell a
        # finished row's padding from its tokens), and so do seeded ones (a seed is one call's generator state)
        alone = not mars or seed is not None
        key = f"alone-{id(gen_config)}" if alone else json.dumps([settings, tau])
        return _Job(ids, gen_config, key=key, tau=tau, mars=mars, seed=seed, **kw)

    def _submit(self, job: _Job, request_id: str | None = None, check_queue: bool = True):
        with self._cond:
            if self._stopping:
                raise HTTPError(503, "The server is shutting down.", "shutting_down")
            if check_queue and len(self._waiting) >= self.max_queue:
                raise HTTPError(429, f"The server is at capacity ({self.max_queue} requests waiting, --max-queue); "
                                "retry later.", "queue_full", retry_after=1)
            self._waiting.append(job)
            if request_id is not None:
                self.jobs[request_id] = job
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def _take(self, running: int):
        """The waiting requests to start now (as many as there are free rows) and the load; blocks while nothing
        decodes and nothing waits. None once stopping and idle."""
        with self._cond:
            while not self._waiting and not running:
                if self._stopping:
                    return None, 0
                self._cond.wait()
            load = len(self._waiting) + running
            taken = []
            while self._waiting and running + len(taken) < self.max_batch_size:
                taken.append(self._waiting.popleft())
            self.metrics.queue_depth.set(len(self._waiting))
            return taken, load

    def _work(self):
        engine = None
        while True:
            taken, load = self._take(len(engine) if engine is not None else 0)
            if taken is None:
                return
            for job in taken:
                if engine is None and job.call is None and job.mars and job.seed is None:
                    engine = MARSEngine(self.model)
                self._start(job, engine, load)
            if engine is not None and len(engine):
                if not self._step(engine, load):
                    engine = None  # the step failed: its rows were answered one by one
            with self._cond:
                self._in_flight = len(engine) if engine is not None else 0
                self.metrics.in_flight.set(self._in_flight)

    def _start(self, job, engine, load):
        """A taken request: a call or a plain / seeded request runs now, alone; a MARS request joins the batch."""
        if job.call is not None or (job.mars and job.seed is None):  # (`_decode` observes its own)
            self.metrics.queue_wait.observe(time.perf_counter() - job.arrived)
        try:
            if job.call is not None:
                fn, args, kwargs = job.call
                job.resolve(fn(*args, **kwargs))
            elif job.cancelled():
                self.metrics.cancelled.inc()
                job.resolve()
            elif not job.mars or job.seed is not None:
                self._decode(job, load)
            else:
                self._join(engine, job, load)
        except Exception as e:  # noqa: BLE001 - this request's own failure; the decode thread goes on
            if job.call is None:
                self.metrics.failed_alone.inc()
            job.resolve(error=e)

    def _default_tau(self, load: int) -> float:
        """τ for rows without their own: the ladder's rung for the load (lossless: verify's draft threshold)."""
        return DEFAULT_VERIFY_THRESHOLD if self.lossless else self.ladder.tau_for(load)

    def _join(self, engine, job, load):
        if job.streamer is not None and not job.prompt_sent:
            job.streamer.put(torch.tensor(job.input_ids))  # transformers' streamer skips the prompt
            job.prompt_sent = True
        mars_args = dict(self.mars_options, tokenizer=self.processor)
        if self.lossless:
            mars_args["mars_verify"] = True
        events = engine.add(job, job.input_ids, copy.deepcopy(job.gen_config), job.tau,
                            default_tau=self._default_tau(load), **mars_args)
        self._deliver(events)

    def _step(self, engine, load) -> bool:
        """One step of every decoding row; False when it failed (each row then answered alone)."""
        m = self.metrics
        gone = [job for job in engine.handles() if job.cancelled()]
        if gone:
            engine.cancel(gone)
            for job in gone:
                m.cancelled.inc()
                job.resolve()
        if not len(engine):
            return True
        tau, rows, started = self._default_tau(load), len(engine), time.perf_counter()
        try:
            events = engine.step(tau)
        except Exception as e:  # noqa: BLE001 - answered below, per request
            self._recover(engine.handles(), e, load)
            return False
        elapsed = time.perf_counter() - started
        m.batch_size.observe(rows)
        m.decode_seconds.inc(elapsed)
        m.tokens_per_second.set(sum(len(ev.tokens) for ev in events) / max(elapsed, 1e-9))
        label = self.ladder.label(tau) if not self.lossless else f"verify {tau:g}"
        m.batches.labels(tau=label).inc()
        m.tau.set(tau)
        self._deliver(events)
        return True

    def _deliver(self, events):
        """New tokens to each request's stream; finished requests answered."""
        m = self.metrics
        for job, tokens, finished, forwards in events:
            job.tokens.extend(tokens)
            m.tokens.inc(len(tokens))
            if tokens and job.streamer is not None and not job.cancelled():
                try:
                    job.streamer.put(torch.tensor(tokens))
                    if not job.streamed:
                        job.mark_started()
                    job.streamed += len(tokens)
                except tf.generation_cancelled_error():
                    pass  # the row leaves at the next step
            if finished:
                job.resolve(torch.tensor(job.tokens, dtype=torch.long))
                m.latency.observe(time.perf_counter() - job.arrived)
                m.forwards.inc(forwards)
                self._emitted, self._forwards = self._emitted + len(job.tokens), self._forwards + forwards
                m.tokens_per_forward.set(self._emitted / max(self._forwards, 1))

    def _recover(self, jobs, error, load):
        """A failed step: each request that has streamed nothing is decoded again alone; the others fail."""
        for job in jobs:
            if job.streamed:
                job.resolve(error=error)
                continue
            job.tokens = []
            try:
                self._generate(job, load, time.perf_counter())
            except Exception as alone:  # noqa: BLE001 - this request's own failure
                self.metrics.failed_alone.inc()
                job.resolve(error=alone)

    # ---- a request decoded alone (plain, seeded, or retried after a failed step)
    def _decode(self, job, load):
        started = time.perf_counter()
        self.metrics.queue_wait.observe(started - job.arrived)
        if job.cancelled():
            self.metrics.cancelled.inc()
            job.resolve()
            return
        try:
            self._generate(job, load, started)
        except Exception as e:  # noqa: BLE001 - this request's own failure
            job.resolve(error=e)

    def _generate(self, job, load, started):
        """One `generate` call for one request: its tokens, its stream and its metrics."""
        m, model = self.metrics, self.model
        gc = copy.deepcopy(job.gen_config)
        gc.return_dict_in_generate = True
        from transformers import StoppingCriteriaList

        input_ids = torch.tensor([job.input_ids], dtype=torch.long, device=model.device)
        kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gc,
                      tokenizer=self.processor, stopping_criteria=StoppingCriteriaList([_Cancelled(job)]))
        if job.streamer is not None:
            if not job.prompt_sent:
                job.streamer.put(torch.tensor(job.input_ids))  # transformers' streamer skips the prompt
                job.prompt_sent = True
            kwargs["streamer"] = _JobStreamer(job)
        tau = None
        if job.mars:
            tau = job.tau if job.tau is not None else self.ladder.tau_for(load)
            kwargs.update(mars=True, mars_threshold=tau, **self.mars_options)
            if self.lossless:
                kwargs["mars_verify"] = True
                if job.tau is None:  # verify's own draft threshold
                    kwargs.pop("mars_threshold")
                    tau = DEFAULT_VERIFY_THRESHOLD
        else:
            kwargs["mars"] = False
        if job.seed is not None:  # a seeded request decodes alone: the generator state is its own
            torch.manual_seed(job.seed)
        with torch.inference_mode():
            out = model.generate(**kwargs)
        elapsed = time.perf_counter() - started
        tokens = out.sequences[0, input_ids.shape[1]:].cpu()
        emitted = int(out.mars_emitted_tokens[0]) if getattr(out, "mars_emitted_tokens", None) is not None else None
        forwards = int(out.mars_forward_passes[0]) if emitted is not None else tokens.shape[0]  # plain: one a token
        emitted = tokens.shape[0] if emitted is None else emitted
        if job.cancelled():
            m.cancelled.inc()
        job.resolve(tokens[:emitted])
        m.latency.observe(time.perf_counter() - job.arrived)
        m.tokens.inc(emitted)
        m.decode_seconds.inc(elapsed)
        m.forwards.inc(forwards)
        m.tokens_per_forward.set(emitted / max(forwards, 1))
        m.tokens_per_second.set(emitted / max(elapsed, 1e-9))
        m.batch_size.observe(1)
        if job.mars:
            label = self.ladder.label(tau) if not self.lossless or tau != DEFAULT_VERIFY_THRESHOLD else f"{tau:g}"
            m.batches.labels(tau=f"verify {label}" if self.lossless else label).inc()
            m.tau.set(tau)
