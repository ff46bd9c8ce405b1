"""The server's Prometheus metrics. Every label takes values from a fixed set (route templates, status codes,
τ ladder rungs), never from what a client sends, so the number of series stays bounded."""

from __future__ import annotations

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    """The metrics, in a registry of their own (several servers can live in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("hf_mars_requests", "HTTP requests answered, by route template and status code "
                                "(paths no route serves count as `other`).", ["path", "status"], registry=r)
        self.cancelled = Counter("hf_mars_requests_cancelled", "Requests whose client went away before the end.",
                                 registry=r)
        self.failed_alone = Counter("hf_mars_requests_failed_alone", "Requests whose batch failed and that were "
                                    "decoded again on their own (and failed there: the others were answered).",
                                    registry=r)
        self.queue_depth = Gauge("hf_mars_queue_depth", "Requests waiting to be decoded.", registry=r)
        self.in_flight = Gauge("hf_mars_requests_in_flight", "Requests being decoded now.", registry=r)
        self.tau = Gauge("hf_mars_tau", "τ of the latest batch (verify mode: its draft threshold).", registry=r)
        self.batches = Counter("hf_mars_batches", "MARS generate calls, by the ladder rung their τ falls to.",
                               ["tau"], registry=r)
        self.batch_size = Histogram("hf_mars_batch_size", "Requests decoded together in one generate call.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.tokens = Counter("hf_mars_generated_tokens", "Tokens generated.", registry=r)
        self.forwards = Counter("hf_mars_row_forwards", "Forward passes, summed over the rows that took part.",
                                registry=r)
        self.tokens_per_forward = Gauge("hf_mars_tokens_per_forward", "Tokens per forward of the latest batch.",
                                        registry=r)
        self.decode_seconds = Counter("hf_mars_decode_seconds", "Time the decode thread spent in generate calls "
                                      "(its rate is the decoder's utilisation).", registry=r)
        self.tokens_per_second = Gauge("hf_mars_tokens_per_second", "Tokens/s of the latest batch.", registry=r)
        self.latency = Histogram("hf_mars_request_latency_seconds", "Arrival to last token, per request.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("hf_mars_queue_wait_seconds", "Arrival to start of decoding, per request.",
                                    buckets=LATENCY_BUCKETS, registry=r)
