"""`hf-mars serve`: an OpenAI-compatible server with MARS batching and a load-adaptive τ.

MARS requests decode in flight: a request joins the running batch at the next step and leaves it when done
(`generation.engine.MARSEngine`), and each step's τ is read off a declared ladder from the load (requests waiting
+ decoding): an idle server answers at τ = 1 (exactly the AR model), a loaded one lowers τ and emits more tokens
per forward. Plain and seeded requests run alone, one `generate` call each, between steps.
`--lossless` decodes every rung in verify mode (output equal to greedy). Request parsing, chat templates, tool and
reasoning parsers and the response objects are `transformers serve`'s handlers (reached through
`hf_mars/serve/_compat.py`, the one module touching transformers serve's private APIs); the rest is ours:

- `ladder.py`: the τ ladder; `metrics.py`: Prometheus metrics with bounded labels;
- `requests.py`: strict request schemas and the server's limits, applied before a request is queued;
- `batching.py`: the decode thread, the in-flight batch and the requests run alone (a failed step's requests
  are retried alone);
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
