"""MARS decoding inside ``model.generate`` (sliding window, block-level KV cache, lossless verify mode).

One module per concern, each importing only torch, transformers, the standard library and its siblings (the
package ships inside every MARS checkpoint as ``custom_generate/``, see `hf_mars.hub`):

- `config`: `MARSGenerationConfig`, the ``mars_*`` options, their defaults and checks; the checkpoint metadata.
- `clients`: which logits processors and stopping criteria keep state, and what they may be shown.
- `rules`: the acceptance rules, each written once (the device-side variants beside them), and
  `reference_decode`, the algorithm in one screen: the tests and the short-answer bench hold the loop to it.
- `proposers`: who lays out a step (threshold candidates / verify chain, a draft tree's root and its steps) and
  `choose_layout`, the one point where a step's layout is chosen.
- `acceptor`: what a step emits, for every proposer (`accept`): reads the candidate slots (processors, one host
  sync) and applies the rules; stateful clients position by position.
- `plan`: a step's per-row counts and its chunk, laid out on the host.
- `cache`: the KV cache's rollback (crop, 2D mask, compaction, static caches).
- `decoder`: the rows of one generation and its one step (plan, forward, read, accept, roll back, commit);
  `state`: its per-row state on the host (`Rows`), `row_tensors` on the device. Its collaborators, settled once
  per call: `limits` (stops, length and step limits), `prompt` (the prompt and its positions), `model_calls`
  (which forward runs: eager, compiled, guarded, a draft vocabulary), `history` (the token history processors
  read, the streamer), `outputs` (scores, logits, statistics).
- `tree`: verify mode over draft trees (several candidates per depth, masks after every node): their layout and
  the accepted path's cache columns.
- `engine`: rows that join and leave a running batch (in-flight batching for servers).
- `cost`, `policy`, `call_record`: layouts chosen by measured speed: the step costs by (rows, width), the per-step
  policies (`draft_tree="cost"`, threshold mode's ``plain_steps``) and the per-call records (verify's 'auto',
  `MARSEngine`'s tree or chain, threshold mode's drafting or plain calls).
- `api`: `mars_generate`, `enable_mars` and the routing of ``generate``.
- `_compat`: every transformers internal the decoder reads (checked by tests/test_generation_contract.py).
"""

from .api import MARSGenerateOutput, enable_mars, generate, mars_generate
from .cache import COMPACT_THRESHOLD, STATIC_CACHE_SUPPORTED
from .config import (
                     ACCEPTANCE_MODES,
                     CACHE_MODES,
                     DEFAULT_BLOCK_SIZE,
                     DEFAULT_CACHE_BLOCK,
                     DEFAULT_THRESHOLD,
                     DEFAULT_VERIFY_THRESHOLD,
                     MARS_ARGUMENTS,
                     MARSGenerationConfig,
                     check_block_size,
                     check_threshold,
                     mask_token_id,
                     read_mars_metadata,
)
from .rules import reference_decode

__all__ = ["mars_generate", "enable_mars", "generate", "reference_decode", "MARSGenerateOutput", "MARS_ARGUMENTS",
           "MARSGenerationConfig", "ACCEPTANCE_MODES", "CACHE_MODES", "DEFAULT_BLOCK_SIZE", "DEFAULT_CACHE_BLOCK",
           "DEFAULT_THRESHOLD", "DEFAULT_VERIFY_THRESHOLD", "COMPACT_THRESHOLD", "STATIC_CACHE_SUPPORTED",
           "check_block_size", "check_threshold", "mask_token_id", "read_mars_metadata"]
