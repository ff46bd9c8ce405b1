"""The batching generation manager: waiting requests decoded together in one left-padded MARS `generate` call.

One worker thread owns the model (as transformers' `InferenceThread` does); requests queue in arrival order; each
call takes the oldest request and every waiting request with the same generation settings (up to
``max_batch_size``), at the τ the ladder gives for the load when it starts. A request whose client went away
(stream closed, or a non-streaming request whose connection dropped) stops its row at the next step. If a batched
call fails, each of its requests that has not streamed anything yet is decoded again on its own: one bad request
fails alone, never the requests batched with it.
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

from .. import _compat as tf
from ..generation import DEFAULT_VERIFY_THRESHOLD
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


class _RowStreamer:
    """Fans a batched MARS call's new tokens out to each request's own transformers streamer."""

    def __init__(self, jobs):
        self.jobs, self.first = jobs, True

    def put(self, value):
        if self.first:  # the prompt
            self.first = False
            return
        if len(self.jobs) != 1:
            raise RuntimeError("a batched call must stream through put_rows")
        self.put_rows([value.reshape(-1)])

    def put_rows(self, rows):
        for job, tokens in zip(self.jobs, rows):
            if job.streamer is None or len(tokens) == 0 or job.cancelled():
                continue
            try:
                job.streamer.put(tokens)
            except tf.generation_cancelled_error():
                continue  # the row is stopped by _CancelledRows at its next check
            if not job.streamed:
                job.mark_started()
            job.streamed += len(tokens)

    def end(self):
        pass  # each request's stream is ended once its row's result is known


class _CancelledRows:
    """Stops the rows whose client disconnected, so a batch does not decode for nobody."""

    mars_stateless = True  # depends on the clients, not on which positions it has seen: the fast path may call it

    def __init__(self, jobs):
        self.jobs = jobs

    def __call__(self, input_ids, scores=None, **kwargs):
        return torch.tensor([job.cancelled() for job in self.jobs], dtype=torch.bool, device=input_ids.device)


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

    def _take(self):
        """The next group of requests to decode together, and the load when it starts."""
        with self._cond:
            while not self._waiting:
                if self._stopping:
                    return None, 0
                self._cond.wait()
            load = len(self._waiting) + self._in_flight
            first = self._waiting[0]
            group = [j for j in self._waiting if j.key == first.key][: 1 if first.call else self.max_batch_size]
            for job in group:
                self._waiting.remove(job)
            self._in_flight = len(group)
            self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.in_flight.set(self._in_flight)
            return group, load

    def _work(self):
        while True:
            group, load = self._take()
            if group is None:
                return
            try:
                if group[0].call is not None:
                    fn, args, kwargs = group[0].call
                    try:
                        group[0].resolve(fn(*args, **kwargs))
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        group[0].resolve(error=e)
                else:
                    self._decode(group, load)
            except Exception as e:  # noqa: BLE001 - the decode thread must outlive any request
                for job in group:
                    job.resolve(error=e)
            finally:
                with self._cond:
                    self._in_flight = 0
                    self.metrics.in_flight.set(0)

    # ---- one batched generate call
    def _decode(self, group, load):
        m = self.metrics
        started = time.perf_counter()
        jobs = []
        for job in group:
            m.queue_wait.observe(started - job.arrived)
            if job.cancelled():
                m.cancelled.inc()
                job.resolve()
            else:
                jobs.append(job)
        if not jobs:
            return
        try:
            self._generate(jobs, load, started)
        except Exception as e:  # noqa: BLE001 - answered below, per request
            if len(jobs) == 1:
                jobs[0].resolve(error=e)
                return
            for job in jobs:  # the batch failed: each request that has streamed nothing is decoded alone
                if job.streamed:
                    job.resolve(error=e)
                    continue
                try:
                    self._generate([job], load, time.perf_counter())
                except Exception as alone:  # noqa: BLE001 - this request's own failure
                    m.failed_alone.inc()
                    job.resolve(error=alone)

    def _generate(self, jobs, load, started):
        m = self.metrics
        model, processor = self.model, self.processor
        tokenizer = getattr(processor, "tokenizer", processor)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        width = max(len(job.input_ids) for job in jobs)
        input_ids = torch.full((len(jobs), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for r, job in enumerate(jobs):
            input_ids[r, width - len(job.input_ids):] = torch.tensor(job.input_ids)
            attention_mask[r, width - len(job.input_ids):] = 1
        gc = copy.deepcopy(jobs[0].gen_config)
        gc.return_dict_in_generate = True
        from transformers import StoppingCriteriaList

        kwargs = dict(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                      generation_config=gc, tokenizer=processor,
                      stopping_criteria=StoppingCriteriaList([_CancelledRows(jobs)]))
        if any(job.streamer is not None for job in jobs):
            for job in jobs:
                if job.streamer is not None and not job.prompt_sent:
                    job.streamer.put(torch.tensor(job.input_ids))  # transformers' streamer skips the prompt
                    job.prompt_sent = True
            kwargs["streamer"] = _RowStreamer(jobs)
        tau = None
        if jobs[0].mars:
            tau = jobs[0].tau if jobs[0].tau is not None else self.ladder.tau_for(load)
            kwargs.update(mars=True, mars_threshold=tau, **self.mars_options)
            if self.lossless:
                kwargs["mars_verify"] = True
                if jobs[0].tau is None:  # verify's own draft threshold
                    kwargs.pop("mars_threshold")
                    tau = DEFAULT_VERIFY_THRESHOLD
        else:
            kwargs["mars"] = False
        if jobs[0].seed is not None:  # a seeded request decodes alone: the generator state is its own
            torch.manual_seed(jobs[0].seed)
        with torch.inference_mode():
            out = model.generate(**kwargs)
        elapsed = time.perf_counter() - started
        seq = out.sequences[:, width:].cpu()
        if getattr(out, "mars_emitted_tokens", None) is not None:
            emitted = out.mars_emitted_tokens.tolist()
            forwards = out.mars_forward_passes.tolist()
        else:  # plain generate, one request
            emitted = [seq.shape[1]]
            forwards = [seq.shape[1]]
        done = time.perf_counter()
        for r, job in enumerate(jobs):
            if job.cancelled():
                m.cancelled.inc()
            job.resolve(seq[r, : emitted[r]])
            m.latency.observe(done - job.arrived)
        total, fwd = sum(emitted), sum(forwards)
        m.tokens.inc(total)
        m.decode_seconds.inc(elapsed)
        m.forwards.inc(fwd)
        m.tokens_per_forward.set(total / max(fwd, 1))
        m.tokens_per_second.set(total / max(elapsed, 1e-9))
        m.batch_size.observe(len(jobs))
        if jobs[0].mars:
            label = self.ladder.label(tau) if not self.lossless or tau != DEFAULT_VERIFY_THRESHOLD else f"{tau:g}"
            m.batches.labels(tau=f"verify {label}" if self.lossless else label).inc()
            m.tau.set(tau)
