"""The MARS decoding loop: the rows of one generation and the step that advances them.

One step reads top to bottom (`MARSDecoder.step`): plan (per-row counts, `plan.py`), build the chunk (each row's
uncached committed tokens, pending drafts, mask tokens), one forward over the KV cache, read the candidate slots
(logits processors, one host sync; a compiled greedy step with no processor reads them in its graph), decide (the
rules of `rules.py`, on the host), roll the cache back (`cache.py`), commit. Two cases move the rows in lockstep
(the same count per step): stateful logits processors or criteria (they must see exactly the calls plain decoding
makes: `exact.py`), and sliding-window caches or a static block cache (a window counts cache columns; a block's
chunk spans the rows).
"""

from __future__ import annotations

import math
import time

import torch

from .cache import RollbackCache
from .clients import history_free, sort_clients
from .config import mask_token_id
from .forward import pad_prefill
from .history import History
from .limits import Limits
from .model_calls import ModelCalls, cache_key
from .outputs import Outputs
from .plan import to_device
from .policy import threshold_policy
from .prompt import Prompt
from .proposers import choose_layout
from .row_tensors import RowTensors
from .rules import (
    Decision,
    choose,
    confident,
    cut_at_stop,
    lockstep,
    one_token,
    proposed_drafts,
    speculative_sample,
    stops,
    take_columns,
    threshold_run,
    verify_row,
)
from .state import Rows, Shape, SlotRead


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
                                   needed=P + max(limits.max_new, 0) + limits.step_room)
        self.history = History(input_ids, self.clients.reads_history, limits, streamer)  # seq, the streamer
        self.prompt = Prompt(model, input_ids, model_kwargs.get("attention_mask"),
                             needed_positions=P + limits.max_new + limits.max_slots,
                             max_positions=limits.buf_len + 2 * (self.shape.chunk + candidates) + 8)
        reads_scores = bool(self.do_sample or self.clients.reads_history or self.clients.processors
                            or self.outputs.scores or self.outputs.logits)
        self.calls = ModelCalls(model, opts, self.shape, self.cache, generation_config, model_kwargs, reads_scores,
                                self.mask_token_id, b, self.device)
        self.shape.fixed_width = self.calls.fixed_width
        self.rows = Rows.new(b, P, limits.max_new, self.prompt.tokens)  # every per-row value: `merge` / `keep_rows`
        self.row_tensors = RowTensors()  # the per-row values on the device: taus, verify sampling's drafts' q
        self.copies_failed = False  # a stateful processor could not be copied (`exact.disposable_chain`)
        self.tree_shape = None  # verify mode's draft tree (`tree.TreeDecoder`); None: no tree
        # ragged rows leave masked columns in the cache, which every later forward pays for: compacted away
        # (full-attention caches, unlocked batches; a static cache in place, and also whenever a step would not
        # fit). A sliding window counts columns and a block cache's chunk spans rows: there every row accepts the
        # same count each step (the exact path already moves rows that way)
        self.shape.compactable = not self.clients.exact and not self.shape.block and not self.cache.sliding
        self.shape.lockstep = b > 1 and not self.clients.exact and (
            self.cache.sliding or (self.cache.static and self.shape.block))
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
        (forward), its slots are read and accepted by the rules (read, accept), the cache drops what was not
        accepted (roll back) and the rows advance (commit)."""
        proposer = choose_layout(self)
        started = time.perf_counter()  # timed to the end of its one host sync (no sync added): the policy's cost
        plan = proposer.plan(self)
        decision, record, kept = proposer.forward_and_accept(self, plan)
        accepted = [len(t) for t in decision.tokens]
        if self.outputs.records is not None:
            self.outputs.records.append(record(accepted))
        rows = self.rows
        finished = [plan.active[r] and (decision.stopped[r] or rows.emitted[r] + accepted[r] >= rows.limit[r])
                    for r in range(self.batch)]
        keep_cols = proposer.roll_back(self, plan, kept, accepted, finished)
        self._commit(plan, keep_cols, decision, finished)
        if self.shape.compactable and self.cache.attn is not None and self.cache.compact(
                max(p + f for p, f in zip(rows.prompt_tokens, rows.fed)), room=self.limits.step_room):
            self.outputs.compactions += 1
        if self.clients.lagging is not None:
            self._check_lagging()
        if self.policy is not None and not plan.first:
            self.policy.observe_step(self, plan, time.perf_counter() - started, accepted)
        return any(rows.unfinished)

    def chunk(self, plan):
        """Inputs: per row [uncached committed | drafts | masks], right-aligned in a (batch, width) chunk.
        Returns input_ids, position_ids and which columns are real (None when all are)."""
        b, dev = self.batch, self.device
        if plan.first:  # prefill: [prompt | masks], the same number of masks in every row
            return self.prompt.prefill_chunk(plan.masks[plan.rows[0]], self.mask_token_id)
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
        return SlotRead(flat.tolist(), self.limits.max_slots, True, False, None)

    def candidate_slots(self, plan, logits):
        """Slot s of row r reads the logits column before its drafts and masks, plus s. Returns the float32 slot
        logits (suppressed tokens at -inf: the mask token is never emitted) and the raw ones for output_logits."""
        S, kept = plan.max_slots, plan.logits_kept
        if plan.uniform:
            r0 = plan.rows[0]
            offset = kept - (plan.masks[r0] + plan.drafts[r0] + 1)
            slot_logits = logits[:, offset:offset + S]
        else:  # (batches only: one row is always uniform)
            slot_logits = take_columns(logits, plan.slot_col_t)
        slot_logits = slot_logits.float()  # (a view of the forward's output where it already is float32)
        raw_logits = slot_logits.clone() if self.outputs.logits else None  # output_logits: before any processing
        return slot_logits.index_fill(-1, self.limits.suppress_t, -math.inf), raw_logits  # (a new tensor: one op)

    # ---------------------------------------------------------------- deciding (processors, then the rules)
    def process(self, plan, slot_logits, chain, stop_at_ends=False):
        """Run a processor chain on every slot and choose a token for it. A chain that ignores input_ids is one
        call for all slots; otherwise slot s of row r is processed on the row's history extended by the tokens
        of slots 0..s-1 (drafts where pending, chosen tokens otherwise), exactly what AR decoding would pass,
        written into `seq` as it goes. Rows are grouped by history length; every call gets the full batch
        (processors may hold per-row state) and rows outside the group are discarded. ``stop_at_ends`` (a chain
        holding stateful objects): no history goes on past a row's EOS, as in AR decoding (grammar matchers raise
        when handed one); once every row has ended no further slot is processed (none can be emitted)."""
        if history_free(chain):
            if len(chain) == 0:
                return slot_logits, choose(slot_logits, self.do_sample)
            b, S, V = slot_logits.shape
            history = torch.zeros((b * S, 1), dtype=torch.long, device=self.device)  # (read by none of them)
            scores = chain(history, slot_logits.reshape(-1, V)).view(b, S, V)
            return scores, choose(scores, self.do_sample)
        P, S = self.prompt_len, plan.max_slots
        groups = {}
        for r in plan.rows:
            groups.setdefault(self.rows.emitted[r], []).append(r)
        group_rows = {g: to_device(rs, self.device) for g, rs in groups.items()}
        scores = torch.empty_like(slot_logits)
        pad, eos_t, seq = self.limits.pad, self.limits.eos_t, self.history.seq
        chosen = torch.full(slot_logits.shape[:2], pad, dtype=torch.long, device=self.device)
        stop_at_ends = stop_at_ends and eos_t is not None
        ended = None if plan.active_t is None else ~plan.active_t  # rows whose history takes pads from here on
        if stop_at_ends and ended is None:
            ended = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
        for s in range(S):
            if s > 0 and stop_at_ends and bool(ended.all()):  # the rest is never emitted: raw logits, pads
                scores[:, s:] = slot_logits[:, s:]
                seq.scatter_(1, plan.slot_pos_t[:, s:], pad)
                break
            for g, rs in group_rows.items():
                processed = chain(seq[:, :P + g + s], slot_logits[:, s].clone())
                if len(group_rows) == 1:
                    scores[:, s] = processed
                else:
                    scores[rs, s] = processed[rs]
            tok = choose(scores[:, s], self.do_sample)
            chosen[:, s] = tok
            ext = tok if plan.forced_mask_t is None else torch.where(plan.forced_mask_t[:, s], plan.forced_t[:, s], tok)
            if ended is not None:
                ext = torch.where(ended, pad, ext)
            seq.scatter_(1, plan.slot_pos_t[:, s:s + 1], ext[:, None])
            if stop_at_ends:
                ended = ended | stops(ext, eos_t) | stops(tok, eos_t)
        return scores, chosen

    def confident(self, scores, chosen, of_distribution):
        """Whether each slot's confidence clears its row's tau."""
        tau = self.opts.threshold if self.row_tensors.tau is None else self.row_tensors.tau
        return confident(self.opts.acceptance, chosen, tau, scores, of_distribution=of_distribution)

    def speculate_no_more(self) -> None:
        """A stateful processor could not be copied (`exact.disposable_chain`): from now on every step accepts
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

    def read_slots(self, plan, slot_logits) -> SlotRead:
        """Process the candidates and bring each slot's token and flags to the host: the step's one sync."""
        S, opts = plan.max_slots, self.opts
        scores, chosen = self.process(plan, slot_logits, self.clients.processors)
        parts, flags = [chosen.view(-1)], not (self.shape.one_token or S == 1)
        if flags:
            parts.append(self.confident(scores, chosen, of_distribution=opts.verify or not self.do_sample).view(-1))
        Dm = max(plan.drafts)
        sampled = opts.verify and self.do_sample and Dm > 0
        if opts.verify and self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            if sampled:
                kept, resampled = speculative_sample(probs[:, :Dm], self.row_tensors.q_drafts[:, :Dm],
                                                     plan.forced_t[:, :Dm])
                parts += [kept.view(-1), resampled.view(-1)]
            if plan.q_idx_t is not None:  # the distributions the next drafts are drawn from
                self.row_tensors.keep_draft_distributions(probs, plan.q_idx_t)
        return SlotRead(torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist(), S, flags, sampled, scores)

    def decide(self, plan, read: SlotRead) -> Decision:
        """Apply the rules to a step's slots on the host: threshold mode accepts candidate 0 and then slots while
        confident; verify accepts the pending drafts AR agrees with plus one AR token and, when all were accepted,
        proposes the confident mask slots after it as the next drafts. Stops (EOS, then other criteria) cut a run;
        lockstep evens runs."""
        b, opts, Dm = self.batch, self.opts, max(plan.drafts)
        host, S, flags, sampled, scores = read
        ok = host[b * S:2 * b * S] if flags else None
        kept_at = b * S * (1 + flags)  # then, sampling verify: kept (b x Dm), the residual's tokens (b x Dm)
        tokens, stopped = [[] for _ in range(b)], [False] * b
        drafts_next = [[] for _ in range(b)] if opts.verify else None
        for r in plan.rows:
            o, n = r * S, plan.slots[r]
            row = host[o:o + S]
            conf = ok[o:o + S] if ok is not None else None
            if opts.verify:
                pending = self.rows.drafts[r]
                d = len(pending)
                kept_r = host[kept_at + r * Dm:kept_at + r * Dm + d] if sampled else None
                resampled = host[kept_at + b * Dm + r * Dm:kept_at + b * Dm + r * Dm + d] if sampled else None
                tokens[r] = verify_row(row, pending, kept_r, resampled)
                if len(tokens[r]) == d + 1 and conf is not None:
                    drafts_next[r] = proposed_drafts(row, conf, d + 1, n)
            else:
                tokens[r] = row[:threshold_run(conf, n) if conf is not None else 1]
            stopped[r] = cut_at_stop(tokens[r], self.clients.eos_ids)
        if len(self.clients.criteria) > 0:
            self._apply_criteria(plan, tokens, stopped, scores)
        if self.shape.lockstep:
            lockstep(plan.rows, tokens, drafts_next or [[] for _ in range(b)], stopped, plan.drafts)
        return Decision(tokens, stopped, drafts_next, scores)

    def _apply_criteria(self, plan, tokens, stopped, scores):
        """Stopping criteria beyond EOS / length, called after each decided token on its AR history (rows grouped
        by history length; one sync); a run is cut after the first position a criterion stops."""
        P, b = self.prompt_len, self.batch
        seq = self.history.seq
        self.history.write(plan.rows, self.rows.emitted, tokens, [False] * b)
        longest = max((len(tokens[r]) for r in plan.rows), default=0)
        groups = {}
        for r in plan.rows:
            groups.setdefault(self.rows.emitted[r], []).append(r)
        hits = []
        for i in range(1, longest + 1):
            for g in groups:
                hit = self.clients.criteria(seq[:, :P + g + i], (scores[:, i - 1],) if self.outputs.scores else None)
                hits.append(torch.as_tensor(hit, device=self.device).expand(b))
        host = torch.stack(hits).view(longest, len(groups), b).tolist() if hits else []
        for j, (g, rs) in enumerate(groups.items()):
            for r in rs:
                if cut_at_stop(tokens[r], [host[i][j][r] for i in range(len(tokens[r]))]):
                    stopped[r] = True

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
        if self.calls.draft_vocab is not None:
            with self.calls.draft_vocab.installed(self.model):
                return self._loop(synced)
        return self._loop(synced)

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
