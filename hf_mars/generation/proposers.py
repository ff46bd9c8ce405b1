"""Who lays out a step, and the one place a step's layout is chosen (`choose_layout`).

Every MARS step is plan -> forward -> read -> accept -> roll back -> commit (`MARSDecoder.step`, the only step).
The ways of decoding differ only in how a step's chunk is laid out (which pending drafts and masks each row
feeds), which logits columns are its candidate slots, and which cache columns stay afterwards. A proposer holds
those parts; what is accepted is decided by the one acceptor (`acceptor.accept`, applying `rules.py`'s rules), as
vLLM's speculative decoding separates its proposers from the rejection sampler:

- `CANDIDATES`: threshold mode (candidate 0, then the masks while confident), the block cache, and verify mode's
  draft chain (pending drafts, then masks that propose the next ones); laid out by `plan.plan_step`.
- `TREE_ROOT`: a draft tree's first step: the chain's prefill ``[prompt | masks]``, read as the root's mask group.
- `TREE`: a draft tree's decode steps: top-k candidates per depth and a mask group after the likely path ends
  (`tree.py`).
"""

from __future__ import annotations

from .acceptor import accept
from .plan import plan_step
from .rules import take_columns


def choose_layout(dec):
    """The proposer that lays out ``dec``'s next step: the one point where a step's layout is chosen.

    The call's options decide the proposer once (a draft tree where `tree.refusal` allows one, else the candidates
    laid out by `plan.plan_step`). Where the call opted into a per-step policy (`policy.py`: draft_tree='cost',
    threshold mode's plain_steps), it chooses each decode step's layout here, from the decoder's per-step inputs
    (``dec.rows``, ``dec.shape``) and the measured cost of a step's width; every choice is lossless."""
    first = dec.rows.at_prefill
    if dec.policy is not None and not first:
        dec.policy.choose_step(dec)
    if dec.tree_shape is None:
        return CANDIDATES
    return TREE_ROOT if first else TREE


class Candidates:
    """Threshold mode, the block cache and verify mode's draft chain: per row [uncached committed | pending drafts
    | masks], right-aligned; the slots from candidate 0 on are read (in the compiled graph when greedy with no
    processor) and accepted, and the masks' and rejected drafts' columns are cropped."""

    name = "candidates"

    def plan(self, dec):
        return plan_step(dec)

    def forward_and_accept(self, dec, plan):
        """The forward and its decision (`acceptor.accept`); returns (decision, what `roll_back` needs)."""
        input_ids, position_ids, col_real = dec.chunk(plan)
        if plan.read_slots:  # (compiled, greedy, no processor: the graph reads the slots)
            return accept(dec, plan, dec.forward_read(plan, input_ids, position_ids, col_real)), col_real
        logits = dec.forward(plan, input_ids, position_ids, col_real)
        return accept(dec, plan, self.slots(plan, logits)), col_real

    @staticmethod
    def slots(plan, logits):
        """Slot s of row r reads the logits column before its drafts and masks, plus s."""
        if not plan.uniform:  # (batches only: one row is always uniform)
            return take_columns(logits, plan.slot_col_t)
        r0 = plan.rows[0]
        offset = plan.logits_kept - (plan.masks[r0] + plan.drafts[r0] + 1)
        return logits[:, offset:offset + plan.max_slots]

    def roll_back(self, dec, plan, col_real, accepted, finished) -> int:
        return dec.roll_back(plan, col_real, accepted, finished)


class TreeRoot(Candidates):
    """A draft tree's first step: the chain's prefill; its mask group after the last prompt token gives the
    first tree's candidates (rows at tau >= 1 read candidate 0 only)."""

    name = "tree root"

    def forward_and_accept(self, dec, plan):
        input_ids, position_ids, col_real = dec.chunk(plan)
        logits = dec.forward(plan, input_ids, position_ids, col_real)
        groups = [0 if dec.one_token_row(r) else dec.group for r in range(dec.batch)]
        trees = [dec.empty_tree() for _ in range(dec.batch)]
        return accept(dec, plan, logits[:, :1 + dec.group], trees, groups), col_real


class TreeSteps:
    """A draft tree's decode steps: [uncached committed | nodes | mask groups] under a tree-shaped attention mask;
    AR's token at every node decides the accepted path (`rules.accepted_path`), whose columns alone stay."""

    name = "tree"

    def plan(self, dec):
        return dec.plan_tree()

    def forward_and_accept(self, dec, plan):
        logits = dec.forward(plan, plan.input_ids, plan.pos_t, None, dec.tree_attention(plan))
        slots = logits if plan.slot_col_t is None else take_columns(logits, plan.slot_col_t)
        decision = accept(dec, plan, slots, plan.trees, plan.groups)
        return decision, decision.paths

    def roll_back(self, dec, plan, paths, accepted, finished) -> int:
        return dec.keep_paths(plan, paths)


CANDIDATES, TREE_ROOT, TREE = Candidates(), TreeRoot(), TreeSteps()
