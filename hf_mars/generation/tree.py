"""Verify mode with a draft tree: several candidates per depth in one forward, and masks after every node.

The chain (`decoder.MARSDecoder` in verify mode) offers one draft per depth and proposes new drafts only when every
draft was accepted: after a rejection the next forward emits one token and only proposes. A tree (Medusa,
SpecInfer) offers each mask's top-k tokens at its depth, as extra chunk positions under a tree-shaped attention
mask: a node sees the committed prefix and its ancestors, at position root + depth. MARS adds what draft heads
cannot: a group of mask tokens after the root and after every node, each seeing that node's path, which is the
``[committed | masks]`` layout MARS is trained on, as if the path were committed. Whichever path AR accepts, its
last node's masks hold the next tree's candidates: no forward is spent only proposing.

A mask's prediction depends only on the path before it, so the candidates at depth d are the same under every
parent; a static shape (k_1, ..., k_D) is the product of each depth's top-k_d (`Tree.grow`). Greedy output is
plain greedy's: every emitted token is the AR argmax at its exact prefix (`rules.accepted_path`, applied by
`acceptor.accept` with the next candidates read from the path's masks). Sampling, processors that read the token
history and caches that cannot take a gathered path (static, a sliding window the call does not fit in) decode
with the chain instead (`refusal`).

This module lays a tree step out (`TreeDecoder.plan_tree`, its attention) and keeps the accepted path's cache
columns (`TreeDecoder.keep_paths`); it decides nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch
from transformers.utils import logging as _hf_logging

from ._compat import attn_implementation
from .clients import history_free
from .decoder import MARSDecoder
from .cost import costs_for
from .plan import to_device
from .policy import DraftPolicy, choices_for, menu, propose_shape, record_for
from .rules import draft_room, one_token

_logger = _hf_logging.get_logger(__name__)

TREE_ATTENTION = ("sdpa", "eager")  # attention implementations that take a prepared 4D float mask as it is
# a node gets a group of masks only where the accepted path ends with an estimated probability >= this: each group
# costs D chunk columns, and a path that ends without one drafts from its deepest grouped ancestor's later masks.
# Measured on the demo checkpoint (CPU, 48 held-out prompts, best of 3, against the chain's wall-clock): batch 1:
# 0 (a group after every node) 3.03 tokens/forward at 1.00x; 0.03: 3.02 at 1.07x; 0.1: 2.99 at 1.08-1.13x; 0.5:
# 2.80 at 1.02x. Batch 4 (a wider step costs more there): 0.03: 3.02 at 0.95x; 0.1: 2.99 at 0.97x; 0.3: 2.90 at
# 1.03x; 1.0: 2.80 at 1.01x. (On a GPU a wider step costs little: more groups should pay there.)
GROUP_MIN_SHARE = 0.03


@dataclasses.dataclass
class Tree:
    """One row's draft tree, nodes in depth-first order with each depth's top-1 first (so the all-top-1 path is a
    prefix of the nodes: accepting it is a crop, not a gather), and the nodes (-1: the root) that carry a group
    of masks (`choose_groups`)."""

    tokens: list  # node n's draft
    parents: list  # node n's parent (-1: the root, the last committed token)
    depths: list  # node n's depth (1: a child of the root)
    probs: list = dataclasses.field(default_factory=list)  # node n's probability under its mask
    grouped: list = dataclasses.field(default_factory=lambda: [-1])  # nodes followed by a mask group, in order

    @classmethod
    def grow(cls, candidates: list, shape: tuple) -> Tree:
        """The tree of shape ``shape`` over ``candidates`` (per depth, (token, probability) pairs, best first)."""
        tree = cls([], [], [])

        def visit(parent, depth):
            if depth >= min(len(candidates), len(shape)):
                return
            for token, prob in candidates[depth][:shape[depth]]:
                tree.tokens.append(token)
                tree.parents.append(parent)
                tree.depths.append(depth + 1)
                tree.probs.append(prob)
                visit(len(tree.tokens) - 1, depth + 1)

        visit(-1, 0)
        return tree

    def choose_groups(self, min_share: float) -> None:
        """Masks after the nodes where the accepted path is likely to end: P(the path ends at n) = P(reach n) x
        (1 - the probabilities of n's children), with the masks' probabilities standing in for AR's agreement.
        Every mask group widens the step; a path that ends at a node without one gets no next drafts (the next
        step only proposes, as the chain's does after a rejection). The likeliest end always gets one."""
        reach, child_mass = {-1: 1.0}, {-1: 0.0}
        for node, (parent, prob) in enumerate(zip(self.parents, self.probs)):
            reach[node] = reach[parent] * prob
            child_mass[node] = 0.0
            child_mass[parent] += prob
        end = {n: reach[n] * max(0.0, 1.0 - child_mass[n]) for n in reach}
        self.grouped = [n for n in end if end[n] >= min_share] or [max(end, key=end.get)]

    def children(self) -> dict:
        out = {}
        for node, parent in enumerate(self.parents):
            out.setdefault(parent, []).append(node)
        return out

    def paths(self) -> list:
        """Each node's path from the root, the node included."""
        out = []
        for node, parent in enumerate(self.parents):
            out.append((out[parent] if parent >= 0 else []) + [node])
        return out


@dataclasses.dataclass
class TreePlan:
    """A decode step's layout, per row: [uncached committed | nodes | mask group of the root, of node 0, ...]. The
    columns from the root on are the candidate slots: 0 the root, 1 + n node n, then the groups."""

    active: list
    trees: list  # per row: its Tree (empty for inactive rows)
    uncached: list  # per row: committed tokens fed first (the last is the root)
    groups: list  # per row: masks per group (0: a row that reads no masks)
    lens: list
    rows: list = dataclasses.field(default_factory=list)
    first: bool = False
    width: int = 0
    logits_kept: int = 0  # = candidate slots of the widest row
    input_ids: torch.Tensor | None = None
    pos_t: torch.Tensor | None = None
    allowed_t: torch.Tensor | None = None  # (b, width, width): which chunk column each chunk column may see
    slot_col_t: torch.Tensor | None = None  # rows of different layouts: the logits column each slot reads


def shape_of(opts, max_drafts: int) -> tuple:
    """The tree shape an option names ('tree', and 'auto' when it takes a tree: one candidate per depth, masks
    after every likely end; 'cost' starts from it, then `policy.DraftPolicy` lays out each step)."""
    if opts.draft_tree in ("auto", "tree", "cost"):
        return (1,) * max_drafts
    return tuple(int(k) for k in opts.draft_tree.split(","))


CACHE_REFUSAL = ("a static cache, or a sliding window the call does not fit in (the accepted path is gathered, the "
                 "cache cannot hold gaps)")


def options_refusal(dec) -> str | None:
    """Why this call's own options (not its model) rule a tree out (None: they do not)."""
    if dec.do_sample:
        return ("sampling (exact multi-candidate speculative sampling is not implemented; the chain's speculative "
                "sampling keeps the target distribution)")
    if dec.clients.exact or not history_free(dec.clients.processors):
        return "logits processors that read the token history (one call per tree node would be needed)"
    if dec.cache.static:
        return CACHE_REFUSAL
    return None


def refusal(dec) -> str | None:
    """Why this call cannot decode with a tree (None: it can): its options (`options_refusal`), then its model's
    cache and attention."""
    attention = attn_implementation(dec.model.config)
    reason = options_refusal(dec)
    if reason is not None:
        return reason
    if not dec.cache.ragged_rows:  # a sliding window the call does not fit in: no gaps
        return CACHE_REFUSAL
    if attention not in TREE_ATTENTION:
        return f"attn_implementation={attention!r} (a tree needs a 4D attention mask: use 'sdpa' or 'eager')"
    return None


class TreeDecoder(MARSDecoder):
    """Verify mode over draft trees: the tree's layout and the accepted path's cache columns; the chain's decoder
    (its prefill, commit, streaming, compaction) and the acceptor do everything a tree does not change."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tree_shape = self.tree_kept = None  # (tree_kept: the shape while `drafting_as` has the chain decode)
        if self.shape.one_token or not self.opts.verify or self.opts.draft_tree == "chain":
            return
        reason = refusal(self)
        asked = "draft_tree" in self.opts._from_call and self.opts.draft_tree != "auto"
        if reason is None:
            self.tree_shape = shape_of(self.opts, self.shape.max_drafts)
            self.group = len(self.tree_shape)
            self.propose_shape = self.tree_shape  # top-k kept per depth for the next step's candidates
            if self.opts.draft_tree == "cost":  # each decode step's layout per row, by measured cost
                layouts = menu(self.shape.max_drafts, GROUP_MIN_SHARE)
                vocab = self.opts.draft_vocab  # (its steps have their own costs and record)
                self.policy = DraftPolicy(costs_for(self.model, "tree", vocab), layouts,
                                          choices_for(self.model, self.batch),
                                          record_for(self.model, self.batch, "tree", vocab))
                self.propose_shape = propose_shape(layouts)
        elif asked and not self.do_sample:
            raise ValueError(f"mars_draft_tree={self.opts.draft_tree!r} cannot be used with {reason}. Leave "
                             "mars_draft_tree unset (the chain is used where a tree cannot be) or pass 'chain'.")
        elif asked:
            _logger.warning_once(f"mars_draft_tree: decoding with the draft chain instead of a tree: {reason}.")

    def auto_record(self, synced: bool) -> str | None:
        """Which record verify's default 'auto' takes this call's layout from: "call" (the tree, the chain or plain
        steps) where a tree can run; "call-chain" (the chain or plain steps) where a tree was refused for the model
        alone (a sliding window the call does not fit in, as Gemma 3's; an attention without 4D masks): weak masks or a costly wide
        step may not pay there either. None: the call's own layout (also where its options refuse a tree:
        sampling, the static cache, processors that read the history)."""
        if synced or self.opts.draft_tree != "auto" or not self.opts.verify or self.shape.one_token:
            return None
        if self.tree_shape is not None:
            return "call"
        return None if options_refusal(self) is not None else "call-chain"

    def run(self, synced: bool = False):
        """`MARSDecoder.run`; with the default 'auto', the tree, the chain or plain one-token steps, whichever this
        process measured fastest for this model at this batch size (`call_record.CallRecord`); the call's own time goes
        to the record. (`MARSEngine` steps its decoders without `run`: `engine.measured_step` chooses per step.)"""
        layout = record = None
        loop = self.auto_record(synced)
        if loop is not None:
            record = record_for(self.model, self.batch, loop, self.opts.draft_vocab)
            layout = record.choose()
            history = choices_for(self.model, self.batch, "call")
            history[layout] = history.get(layout, 0) + 1
            if layout != "tree":  # (as where a tree is refused: the chain decodes)
                self.tree_shape = None
            if layout == "plain":  # no masks: every step takes AR's one token, as plain greedy
                self.shape.one_token = True
            self.outputs.counting = True  # (what the record reads: `outputs.Outputs.count_drafted`)
        sequences = super().run(synced)
        if record is not None and self.outputs.decode_started is not None:  # decode steps only (not the prefill)
            record.observe(layout, self.outputs, max(self.rows.forwards) - 1,
                           time.perf_counter() - self.outputs.decode_started)
        return sequences

    def drafting_as(self, layout: str) -> None:
        """Between two steps, decode the next ones as the draft chain ('chain') or as the tree again ('tree'):
        `MARSEngine`'s measured choice for a served batch (the batch itself stays a tree decoder, so rows that join
        merge as before). The rows' pending drafts change form with the layout: a tree's per-depth candidates give
        the chain their top-1 tokens; the chain's drafts give the tree one candidate per depth, of unknown
        probability (1.0: the first tree step after a chain puts its masks at the path's end, the chain's habit).
        Lossless either way: a layout decides which drafts are checked, never what is emitted."""
        if layout == "chain" and self.tree_shape is not None:
            self.tree_kept, self.tree_shape = self.tree_shape, None
            _, candidates = self.row_candidates()  # (cut to what the length limits let a row emit, as the chain's)
            self.rows.drafts = [[per_depth[0][0] for per_depth in c or []] for c in candidates]
        elif layout == "tree" and self.tree_shape is None and self.tree_kept is not None:
            self.tree_shape = self.tree_kept
            self.rows.drafts = [[[(token, 1.0)] for token in drafts] for drafts in self.rows.drafts]

    # ---------------------------------------------------------------- the chunk
    @staticmethod
    def empty_tree() -> Tree:
        return Tree([], [], [])

    def one_token_row(self, r) -> bool:
        tau = self.rows.tau[r]
        return tau is not None and one_token(tau)

    def row_candidates(self) -> tuple:
        """Per row (None for finished rows): its uncached committed tokens and its candidates, cut to what the
        length limits let it emit (the nodes + the AR token fit); none for a row at tau >= 1."""
        rows, uncached, candidates = self.rows, [None] * self.batch, [None] * self.batch
        for r in range(self.batch):
            if rows.unfinished[r]:
                depth = draft_room(rows.limit[r] - rows.emitted[r], self.opts.max_accept)
                candidates[r] = [] if self.one_token_row(r) else rows.drafts[r][:depth]
                uncached[r] = rows.emitted[r] - rows.fed[r]
        return uncached, candidates

    def plan_tree(self) -> TreePlan:
        """Each active row's tree (the shape of the call's option, or the layout the 'cost' policy chose for the
        row this step: `proposers.choose_layout`) and the chunk."""
        b, rows = self.batch, self.rows
        plan = TreePlan(active=list(rows.unfinished), trees=[Tree([], [], []) for _ in range(b)],
                        uncached=[0] * b, groups=[0] * b, lens=[0] * b)
        uncached, candidates = self.row_candidates()
        choice = None if self.policy is None else self.policy.step_choice
        layouts = None if choice is None else choice.layouts
        for r in range(b):
            if not rows.unfinished[r]:
                continue
            shape, group, share, one = self.tree_shape, self.group, GROUP_MIN_SHARE, self.one_token_row(r)
            if layouts is not None:
                shape, group, share = layouts[r].shape, layouts[r].group, layouts[r].min_share
                one = one or layouts[r].plain
            tree = plan.trees[r] = Tree.grow([] if one else candidates[r], shape)
            tree.choose_groups(share)
            plan.uncached[r] = uncached[r]
            plan.groups[r] = 0 if one else group
            plan.lens[r] = plan.uncached[r] + len(tree.tokens) + len(tree.grouped) * plan.groups[r]
        plan.rows = [r for r in range(b) if plan.active[r]]
        plan.width = max(plan.lens)
        plan.logits_kept = max(plan.lens[r] - plan.uncached[r] + 1 for r in plan.rows)
        self._lay_out(plan)
        return plan

    def _lay_out(self, plan) -> None:
        """The chunk's tokens, positions, tree attention and slot columns, in one host->device copy."""
        b, W, S, rows = self.batch, plan.width, plan.logits_kept, self.rows
        ids, pos, allowed, cols = [], [], [], []
        for r in range(b):
            tree, u, g, n = plan.trees[r], plan.uncached[r], plan.groups[r], plan.lens[r]
            left = W - n
            committed = rows.tokens[r][rows.fed[r]:rows.fed[r] + u]
            ids += [self.limits.pad] * left + committed + tree.tokens + [self.mask_token_id] * (n - u - len(tree.tokens))
            root = rows.prompt_tokens[r] + rows.fed[r] + u - 1  # the root's position
            group_depths = [tree.depths[m] if m >= 0 else 0 for m in tree.grouped] if g else []
            pos += [0] * left + list(range(root - u + 1, root + 1)) + [root + d for d in tree.depths]
            pos += [root + d + 1 + j for d in group_depths for j in range(g)]
            allowed += _row_pattern(tree, u, g, left, W)
            c0 = S - (n - u + 1) if plan.active[r] else 0
            cols += [min(c0 + s, S - 1) for s in range(S)]
        uniform = len({plan.lens[r] - plan.uncached[r] for r in plan.rows}) == 1 and all(plan.active)
        sizes = [b * W, b * W, b * W * W] + ([] if uniform else [b * S])
        parts = to_device(ids + pos + allowed + ([] if uniform else cols), self.device).split(sizes)
        plan.input_ids, plan.pos_t = parts[0].view(b, W), parts[1].view(b, W)
        plan.pos_t = self.prompt.clamped(plan.pos_t)
        plan.allowed_t = parts[2].view(b, W, W).bool()
        plan.slot_col_t = None if uniform else parts[3].view(b, S)

    def tree_attention(self, plan):
        """The 4D float mask: every chunk column sees the cache's real columns and what its tree pattern allows."""
        b, W = self.batch, plan.width
        past = self.cache.attn
        if past is None:
            past = torch.ones(b, self.cache.length, dtype=torch.long, device=self.device)
        allowed = torch.cat([past.bool()[:, None, :].expand(b, W, -1), plan.allowed_t], dim=2)[:, None]
        dtype = self.model.dtype if self.model.dtype.is_floating_point else torch.float32
        return torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)

    # ---------------------------------------------------------------- the cache
    def keep_paths(self, plan, paths) -> int:
        """Keep each row's committed columns and its accepted path's nodes, drop the rest. When every row's path
        is its tree's leading nodes (always, for the all-top-1 path) that is a crop; otherwise a gather."""
        b, W = self.batch, plan.width
        lefts = [W - plan.lens[r] for r in range(b)]
        kept = [plan.uncached[r] + len(paths[r]) if plan.active[r] else 0 for r in range(b)]
        if all(p == list(range(len(p))) for p in paths):
            keep = max(lefts[r] + kept[r] for r in range(b))
            real = None
            if b > 1 or lefts[0] > 0:
                flags = [int(lefts[r] <= c < lefts[r] + kept[r]) for r in range(b) for c in range(keep)]
                real = to_device(flags, self.device).view(b, keep)
            self.cache.roll_back(W - keep, real, keep, self.device)
            return keep
        keep = max(kept)
        index, flags = [], []
        for r in range(b):
            cols = [lefts[r] + c for c in range(plan.uncached[r])] + [lefts[r] + plan.uncached[r] + n for n in paths[r]]
            cols = cols if plan.active[r] else []
            index += [0] * (keep - len(cols)) + cols
            flags += [0] * (keep - len(cols)) + [1] * len(cols)
        both = to_device(index + flags, self.device).view(2, b, keep)
        self.cache.keep_chunk_columns(W, both[0], both[1].bool(), self.device)
        return keep


def _row_pattern(tree, uncached, group, left, width) -> list:
    """One row's chunk attention, flattened (width x width, 1 = may see): pads see themselves; committed tokens
    see the committed ones before them; a node sees the committed tokens and its path; mask j of a group sees the
    committed tokens, its node's path and masks 0..j of its group. (Every step lays out one per row, and steps
    repeat a few layouts: cached.)"""
    return list(_pattern(tuple(tree.parents), tuple(tree.grouped), uncached, group, left, width))


@functools.lru_cache(maxsize=1024)
def _pattern(parents, grouped, uncached, group, left, width) -> tuple:
    tree = Tree([0] * len(parents), list(parents), [])
    n_nodes = len(parents)
    rows = [[q] for q in range(left)]
    committed = list(range(left, left + uncached))
    rows += [committed[:i + 1] for i in range(uncached)]
    node_col = [left + uncached + n for n in range(n_nodes)]
    paths = tree.paths()
    rows += [committed + [node_col[m] for m in path] for path in paths]
    start = left + uncached + n_nodes
    for g, path in enumerate([paths[m] if m >= 0 else [] for m in grouped] if group else []):
        base = committed + [node_col[m] for m in path]
        first = start + g * group
        rows += [base + list(range(first, first + j + 1)) for j in range(group)]
    flat = [0] * (width * width)
    for q, seen in enumerate(rows):
        for c in seen:
            flat[q * width + c] = 1
    return tuple(flat)
