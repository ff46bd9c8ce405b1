"""`hf-mars serve`: an OpenAI-compatible server with MARS batching and a load-adaptive τ.

Requests that wait at the same time are decoded together in one left-padded MARS `generate` call, and the τ of
that call is read off a declared ladder from the load when it starts (requests waiting + in flight): an idle
server answers at τ = 1 (exactly the AR model), a loaded one lowers τ and emits more tokens per forward.
`--lossless` decodes every rung in verify mode (output equal to greedy). Request parsing, chat templates, tool and
reasoning parsers and the response objects are `transformers serve`'s handlers (reached through
`hf_mars/_compat.py`, the one module touching private transformers APIs); the rest is ours:

- `ladder.py`: the τ ladder; `metrics.py`: Prometheus metrics with bounded labels;
- `requests.py`: strict request schemas and the server's limits, applied before a request is queued;
- `batching.py`: the decode thread and its batches (a failed batch's requests are retried alone);
- `app.py`: routes, the guard (key, body size and deadline), OpenAI-shaped errors, streams;
- `command.py`: the flags, uvicorn with a header deadline and a graceful-shutdown bound.
"""

from .batching import MARSBatchingManager
from .command import add_arguments, run
from .ladder import TauLadder
from .metrics import Metrics

__all__ = ["MARSBatchingManager", "Metrics", "TauLadder", "add_arguments", "build_app", "run"]


def __getattr__(name):  # the app needs fastapi (the `serve` extra); importing the package does not
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(name)
