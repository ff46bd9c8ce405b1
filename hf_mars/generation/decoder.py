"""The MARS decoding loop: the rows of one generation and the step that advances them.

One step reads top to bottom (`MARSDecoder.step`): plan (per-row counts, `plan.py`), build the chunk (each row's
uncached committed tokens, pending drafts, mask tokens), one forward over the KV cache, then the acceptor
(`acceptor.accept`) reads the candidate slots (logits processors, one host sync; a compiled greedy step with no
processor reads them in its graph) and decides with the rules of `rules.py`; the cache rolls back (`cache.py`) and
the rows advance (commit). The decoder holds no acceptance rule. Two cases move the rows in lockstep (the same
count per step): stateful logits processors or criteria (they must see exactly the calls plain decoding makes:
the acceptor decides those position by position), and sliding-window caches of calls longer than the window or a
block cache on a static or sliding-window cache (a window counts cache columns; a block's chunk spans the rows).
"""

from __future__ import annotations

import time

import torch

from .cache import RollbackCache
from .clients import sort_clients
from .config import mask_token_id
from .forward import pad_prefill
from .history import History
from .limits import Limits
from .model_calls import ModelCalls, cache_key
from .outputs import Outputs
from .plan import to_device
from .policy import threshold_call, threshold_call_done, threshold_policy
from .prompt import Prompt
from .proposers import choose_layout
from .row_tensors import RowTensors
from .rules import one_token
from .state import Rows, Shape, SlotRead, by_row


class MARSDecoder:
    """The rows of one MARS generation (threshold, block-cache or verify mode) and the step that advances them."""

    def __init__(self, model, input_ids, logits_processor, stopping_criteria, generation_config, opts, streamer,
                 model_kwargs, mask_id=None):
        self.model, self.opts, self.device = model, opts, input_ids.device
        b, P = input_ids.shape
        self.prompt_len = P
        self.do_sample = bool(generation_config.do_sample)
        self.outputs = Outputs(generation_config)  # scores / logits per emitted position, statistics
        self.mask_token_id = mask_token_id(model) if mask_id is None else mask_id
        self.clients = sort_clients(logits_processor, stopping_criteria, self.mask_token_id, self.outputs.scores)
        single = one_token(opts.threshold)
        candidates = opts.block_size + 1 if opts.use_last_mask else opts.block_size
        self.shape = Shape(candidates=candidates, max_drafts=0 if single else candidates - 1,
                           one_token=single, block=opts.cache in ("block", "block_trained"), chunk=opts.cache_block)
        self.limits = limits = Limits(self.clients, generation_config, self.shape, opts.verify, P, self.device)
        self.cache = RollbackCache(model, generation_config, model_kwargs.get(cache_key(model_kwargs)), b,
                                   needed=P + max(limits.max_new, 0) + limits.step_room,
                                   prompt_attention=model_kwargs.get("attention_mask"))
        self.cached_prompt = self.cache.length  # prompt columns a cache passed in already holds (prompt reuse)
        self.history = History(input_ids, self.clients.reads_history, limits, streamer)  # seq, the streamer
        self.prompt = Prompt(model, input_ids, model_kwargs.get("attention_mask"),
                             needed_positions=P + limits.max_new + limits.max_slots,
                             max_positions=limits.buf_len + 2 * (self.shape.chunk + candidates) + 8)
        reads_scores = bool(self.do_sample or self.clients.reads_history or self.clients.processors
                            or self.outputs.scores or self.outputs.logits)
        self.calls = ModelCalls(model, opts, self.shape, self.cache, generation_config, model_kwargs, reads_scores,
                                self.mask_token_id, b, self.device)
        self.shape.fixed_width = self.calls.fixed_width
        self.rows = Rows.new(b, P - self.cached_prompt, limits.max_new, self.prompt.tokens)  # every per-row value: `merge` / `keep_rows`
        self.row_tensors = RowTensors()  # the per-row values on the device: taus, verify sampling's drafts' q
        self.copies_failed = False  # a stateful processor could not be copied (`acceptor.disposable_chain`)
        self.tree_shape = None  # verify mode's draft tree (`tree.TreeDecoder`); None: no tree
        # ragged rows leave masked columns in the cache, which every later forward pays for: compacted away
        # (unlocked batches; a static cache in place, and also whenever a step would not fit). A sliding window
        # counts columns (unless the call fits inside it: `RollbackCache.ragged_rows`) and a block cache's chunk
        # spans rows: there every row accepts the same count each step (the position-by-position path for
        # stateful clients already moves rows that way)
        self.shape.compactable = not self.clients.exact and not self.shape.block and self.cache.ragged_rows
        self.shape.lockstep = b > 1 and not self.clients.exact and (
            not self.cache.ragged_rows or (self.shape.block and (self.cache.static or self.cache.sliding)))
        # opt-in per-step policies (policy.py: draft_tree='cost' in `tree.TreeDecoder`, threshold mode's plain_steps);
        # each keeps its own choice for the current step
        self.policy = threshold_policy(self)

    @property
    def batch(self) -> int:
        """Rows in the batch (they join and leave between steps: `merge`, `keep_rows`)."""
        return len(self.rows)

    # ---------------------------------------------------------------- one step
    def step(self) -> bool:
        """One forward and everything it decides; False once every row has finished. The same for every way of
        decoding: the proposer `choose_layout` picks lays the step out (plan), the model runs over the chunk
        (forward), the acceptor reads its slots and applies the rules (read, accept: `acceptor.accept`), the
        cache drops what was not accepted (roll back) and the rows advance (commit)."""
        proposer = choose_layout(self)
        started = time.perf_counter()  # timed to the end of its one host sync (no sync added): the policy's cost
        rows, outputs = self.rows, self.outputs
        had_drafts = [bool(d) for d in rows.drafts] if outputs.counting else None
        plan = proposer.plan(self)
        decision, kept = proposer.forward_and_accept(self, plan)
        accepted = [len(t) for t in decision.tokens]
        outputs.record(decision, accepted, self.device)
        if outputs.counting:
            outputs.count_drafted(plan.rows, had_drafts, accepted)
        finished = [plan.active[r] and (decision.stopped[r] or rows.emitted[r] + accepted[r] >= rows.limit[r])
                    for r in range(self.batch)]
        keep_cols = proposer.roll_back(self, plan, kept, accepted, finished)
        self._commit(plan, keep_cols, decision, finished)
        if self.shape.compactable and self.cache.attn is not None and self.cache.compact(
                max(p + f for p, f in zip(rows.prompt_tokens, rows.fed)), room=self.limits.step_room):
            self.outputs.compactions += 1
        if self.clients.lagging is not None:
            self._check_lagging()
        if plan.first:  # (a per-call record times a call's decode steps from here)
            outputs.decode_started = time.perf_counter()
        elif self.policy is not None:
            self.policy.observe_step(self, plan, time.perf_counter() - started, accepted)
        return any(rows.unfinished)

    def chunk(self, plan):
        """Inputs: per row [uncached committed | drafts | masks], right-aligned in a (batch, width) chunk.
        Returns input_ids, position_ids and which columns are real (None when all are)."""
        b, dev = self.batch, self.device
        if plan.first:  # prefill: [prompt | masks], the same number of masks in every row
            return self.prompt.prefill_chunk(plan.masks[plan.rows[0]], self.mask_token_id, self.cached_prompt)
        if b == 1:  # no padding ever
            offset = self.rows.prompt_tokens[0] + self.rows.fed[0]
            col_real = None if self.cache.attn is None else torch.ones(1, plan.width, dtype=torch.bool, device=dev)
            return plan.input_ids, self.prompt.positions[:, offset:offset + plan.width], col_real
        # pads only matter in rows still decoding; with none there and none in the cache, no mask at all
        col_real = plan.real_t
        if self.cache.attn is None and all(plan.lens[r] == plan.width for r in plan.rows):
            col_real = None
        return plan.input_ids, plan.pos_t, col_real

    def forward(self, plan, input_ids, position_ids, col_real, attention_mask=None):
        """The model forward over the chunk (the cache is updated in place); the logits from candidate 0 on.
        ``attention_mask``: a prepared 4D mask (a draft tree's); else the 2D one from the chunk's real columns."""
        calls, prompt = self.calls, self.prompt
        kwargs = calls.inputs(self.cache, col_real, attention_mask, self.device)
        forward, kept, pad = calls.eager if plan.first else calls.decode, plan.logits_kept, 0
        logits_to_keep = kept
        if plan.first and calls.prefill is not None:
            forward = calls.prefill
            capacity = self.cache.static_len - self.cache.cache.get_seq_length()
            input_ids, position_ids, pad = pad_prefill(input_ids, position_ids, capacity, self.mask_token_id,
                                                       prompt.max_positions)
            width = input_ids.shape[1] - pad  # the kept columns as a tensor: one graph whatever the padding
            logits_to_keep = prompt.positions[0, width - kept:width]
        if calls.logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        out = forward(input_ids=input_ids, position_ids=prompt.clamped(position_ids), **kwargs)
        if pad:  # the padding leaves no trace in the cache
            self.cache.cache.crop(-pad)
        self._count_forward()
        # the kept columns end where the chunk did (logits_to_keep returned only them; else the padding follows)
        end = out.logits.shape[1] - (0 if calls.logits_to_keep else pad)
        return out.logits[:, end - kept:end]

    def _count_forward(self):
        for r in range(self.batch):
            self.rows.forwards[r] += self.rows.unfinished[r]

    def forward_read(self, plan, input_ids, position_ids, col_real) -> SlotRead:
        """A compiled decode step that reads its own slots (`forward.compiled_read_call`): every slot's token and
        flag, over all ``max_slots`` slots (one graph), the columns each reads laid out by the plan."""
        calls, tau = self.calls, self.row_tensors.tau
        kwargs = calls.inputs(self.cache, col_real, None, self.device)
        kwargs["logits_to_keep"] = plan.logits_kept  # (the slots' columns count from the kept ones)
        flat = calls.read(slot_cols=plan.slot_col_t, suppress=self.limits.suppress_t, acceptance=self.opts.acceptance,
                          tau=calls.tau_all if tau is None else tau, input_ids=input_ids,
                          position_ids=self.prompt.clamped(position_ids), **kwargs)
        self._count_forward()
        host = flat.tolist()  # [tokens | flags], each (batch, max_slots): the step's one sync
        half = len(host) // 2
        return SlotRead(by_row(host[:half], self.batch), by_row(host[half:], self.batch))

    def speculate_no_more(self) -> None:
        """A stateful processor could not be copied (`acceptor.disposable_chain`): from now on every step accepts
        one token, decided by the real processors alone."""
        self.copies_failed = True
        self.shape.one_token = True

    def set_row_taus(self, taus: list) -> None:
        """A tau per row from the next step on (a row at 1.0 takes exactly the AR token: no masks are read)."""
        if taus != self.rows.tau:
            self.rows.tau = list(taus)
            self.row_tensors.set_taus(taus, self.device)

    def merge(self, other: MARSDecoder) -> None:
        """Take another generation's rows into this batch, between steps (`engine.merge`): every per-row value
        lives in `Rows`, the cache rows in `RollbackCache`; verify sampling's draft distributions go along."""
        self.cache.append_rows(other.cache, self.device)
        self.row_tensors.extend(other.row_tensors, (self.batch, other.batch), self.shape.max_drafts, self.device)
        taus = [self.opts.threshold if t is None else t for t in self.rows.tau]
        taus += [other.opts.threshold if t is None else t for t in other.rows.tau]
        self.rows.extend(other.rows)
        self.rows.tau = [None] * len(self.rows)  # (filled, and sent to the device, by set_row_taus below)
        self.prompt.take_limit(other.prompt)
        self.set_row_taus(taus)

    def keep_rows(self, keep: list) -> None:
        """Only the rows ``keep`` go on (finished or cancelled ones leave the batch), their cache rows with them."""
        index = to_device(keep, self.device)
        self.cache.select_rows(index)
        self.row_tensors.select(index)
        self.rows.select(keep)

    # ---------------------------------------------------------------- after the decision
    def roll_back(self, plan, col_real, accepted, finished) -> int:
        """Drop the masks' (and rejected drafts') cache entries; returns how many columns of the chunk stay.

        Block cache inside a chunk: everything fed is dropped (back to the frozen prefix). Otherwise each row keeps
        its committed tokens and, in verify mode, the drafts it accepted: the columns after the widest row's are
        cropped, and a row that keeps fewer has the rest masked out in the 2D attention mask."""
        b, width = self.batch, plan.width
        if self.shape.block and not plan.first and not self.rows.chunk_start:
            self.cache.roll_back(width, None, 0, self.device)
            return 0
        verify = self.opts.verify and not plan.first
        # the chunk column after each active row's last kept one (its columns start at width - lens)
        ends = {r: width - plan.lens[r] + plan.uncached[r] + (max(accepted[r] - 1, 0) if verify else 0)
                for r in plan.rows}
        going = [ends[r] for r in plan.rows if not finished[r]]
        keep_cols = max(going or ends.values() or [0])
        kept_real = None if col_real is None else col_real[:, :keep_cols]
        if keep_cols and any(e < keep_cols for e in going):  # (batches only) ragged: per row, host-known
            kept = []
            for r in range(b):
                lo = min(width - plan.lens[r], keep_cols)
                hi = max(lo, min(ends.get(r, 0), keep_cols))
                kept += [0] * lo + [1] * (hi - lo) + [0] * (keep_cols - hi)
            ragged = to_device(kept, self.device).view(b, keep_cols).bool()
            kept_real = ragged if kept_real is None else ragged & kept_real.bool()
        self.cache.roll_back(width - keep_cols, kept_real, keep_cols, self.device)
        return keep_cols

    def _commit(self, plan, keep_cols, decision, finished):
        """Advance the per-row state on the host; finished rows read as pads from here on (like AR's)."""
        rows, verify = self.rows, self.opts.verify
        starts, runs = list(rows.emitted), []
        for r in range(self.batch):
            a = len(decision.tokens[r])
            rows.tokens[r] += decision.tokens[r]
            if verify:
                rows.drafts[r] = [] if finished[r] else decision.drafts[r]
            if keep_cols and rows.unfinished[r]:
                if plan.first:
                    rows.fed[r] = 0
                else:  # verify: accepted drafts are cached, the AR token not
                    rows.fed[r] = rows.emitted[r] + (max(a - 1, 0) if verify else 0)
            runs.append((rows.emitted[r], a))
            rows.emitted[r] += a
            rows.in_chunk[r] += a
            if finished[r]:
                rows.unfinished[r] = False
        if self.history.kept:
            self.history.write(plan.rows, starts, decision.tokens, finished)
        if self.shape.block:
            self._start_chunk_if_filled()
        if self.history.streamer is not None and self.clients.lagging is None:  # (lagging: streamed once checked)
            self.history.stream(rows.tokens, runs)

    def _start_chunk_if_filled(self):
        """Block cache: a new chunk starts once every row still decoding has filled the current one."""
        rows = self.rows
        rows.chunk_start = all((not rows.unfinished[r]) or rows.in_chunk[r] >= self.shape.chunk
                               for r in range(self.batch))
        if rows.chunk_start:
            rows.in_chunk = [0] * self.batch

    def _check_lagging(self):
        """Stateful stopping criteria (no stateful processor): AR's calls, made behind the rows instead of holding
        them in lockstep. The call for position t comes once every row still decoding has reached t, on the batch's
        AR history there (pads after a row that ended before t); a row that ran past a stop it is told of now is
        cut back to it, as AR would have stopped it. Tokens are streamed only once checked."""
        b, P, rows = self.batch, self.prompt_len, self.rows
        while True:
            going = [rows.emitted[r] for r in range(b) if rows.unfinished[r]]
            t = rows.checked + 1
            if t > (min(going) if going else max(rows.emitted)):
                break
            hit = torch.as_tensor(self.clients.lagging(self.history.seq[:, :P + t], None), device=self.device).expand(b)
            for r, stops in enumerate(hit.tolist()):
                if stops and rows.emitted[r] >= t:  # the row has a token at t: it ends there
                    if rows.emitted[r] > t:
                        self.history.cut(r, t)
                        rows.emitted[r] = t
                        del rows.tokens[r][t:]
                    rows.unfinished[r], rows.drafts[r] = False, []
            rows.checked = t
        if self.shape.block and not rows.chunk_start:  # a cut row no longer holds the others' chunk open
            self._start_chunk_if_filled()
        if self.history.streamer is not None:
            runs = [(rows.streamed[r], max(min(rows.emitted[r], rows.checked) - rows.streamed[r], 0))
                    for r in range(b)]
            rows.streamed = [start + a for start, a in runs]
            self.history.stream(rows.tokens, runs)

    # ---------------------------------------------------------------- results
    def run(self, synced: bool = False):
        """Step until every row has finished. ``synced`` (parameters sharded across ranks): every rank forwards in
        lockstep until all ranks are done, a finished rank running a throwaway forward, as transformers does."""
        rows = self.rows
        if self.limits.max_new <= 0:
            rows.unfinished = [False] * self.batch
            if not synced:
                return self.prompt.ids
        if torch.is_grad_enabled():  # (generate already runs under no_grad: entering it again costs ~10 us a call)
            with torch.no_grad():
                return self.run(synced)
        record, layout = threshold_call(self, synced)
        if layout == "plain":  # plain one-token steps throughout: this call's measured choice (plain_steps)
            self.shape.one_token, self.policy = True, None
        sequences = self._loop(synced)
        if record is not None:
            threshold_call_done(self, record, layout)
        return sequences

    def _loop(self, synced: bool):
        """`run`'s steps, and the sequences they give."""
        rows = self.rows
        while True:
            if synced:
                finished_ranks = torch.tensor(0.0 if any(rows.unfinished) else 1.0, device=self.device)
                torch.distributed.all_reduce(finished_ranks)
                if int(finished_ranks.item()) == torch.distributed.get_world_size():
                    break
                if not any(rows.unfinished):
                    self.calls.eager(input_ids=self.prompt.ids[:, :1], use_cache=False)  # keep the shards moving
                    continue
            if not self.step() and not synced:
                break
        T = max(rows.emitted)
        if not T:
            return self.prompt.ids
        # the prompt and the emitted tokens, pad-filled after each row's end
        pad = self.limits.pad
        emitted = to_device([row + [pad] * (T - len(row)) for row in rows.tokens], self.device)
        return torch.cat([self.prompt.ids, emitted.view(self.batch, T)], dim=1)

    def assemble(self, which):
        """One (b, V) tensor per emitted position, from the per-step records (0: scores, 1: logits)."""
        return self.outputs.assemble(which, self.rows.emitted, self.limits.pad, self.device)
