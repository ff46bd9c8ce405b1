"""The paper's own MARS sampler, ported, and a per-call benchmark of it against hf-mars and plain `generate`.

Port: github.com/Xalp/MARS, ``mars/samplers/mars_sampler.py`` at commit
131b6aef12e467850750ee6ec252c8fd4e1ac9e5 (2026-04-22), copied verbatim between the ``BEGIN/END port`` lines
(its module docstring turned into a comment; nothing else changed: it already puts every tensor on
``self.model.device``). It is a plain PyTorch loop without a KV cache: every step forwards the whole sequence
``[prompt | generated | B masks]`` under a dense 4D causal mask and accepts mask predictions left to right while
their probability is >= the threshold. It is run as the repository's ``mars/eval_harness.py`` documents it:
``right_shift_logits=True`` (candidate 0 is the last committed position's AR prediction, then masks 1..B-1),
``steps = max_new_tokens``, ``block_size`` = the checkpoint's B. tau = 1 is passed as ``confidence_threshold=None``
(the sampler's "exactly one token per step"; 1.0 would also accept saturated p == 1.0 candidates).

Benchmark (``python benchmarks/reference_sampler.py``): on a MARS checkpoint (default: the demo's) and N held-out
prompts (hf_mars.demo.data's split, chat template, as ``hf-mars bench`` loads them) at batch 1, for each tau it
times one call of (a) the reference loop, (b) ``model.generate(mars=True, mars_threshold=tau)`` after
``enable_mars``, (c) plain greedy ``generate`` (the model class's own, unrouted) -- interleaved per prompt in
rotating order after a warm-up pass -- and reports the median ms per call, the speed-up of (b) over (a) (ratio of
total time, i.e. of mean per-call time) and how many outputs of (a) and (b) are identical (answers cut after the
first EOS). Mismatches are listed, not hidden. ``--static-compile`` adds (d): (b) with
``cache_implementation="static"`` and a ``CompileConfig`` that compiles on CPU too (first call compiles: ~40 s on CPU).

    OMP_NUM_THREADS=1 python benchmarks/reference_sampler.py --repeats 5 --static-compile --output ref_bench.json
"""

# the port below is kept byte for byte as upstream wrote it: no lint rules apply to this file
# ruff: noqa

# ======================================= BEGIN port of Xalp/MARS mars/samplers/mars_sampler.py @ 131b6ae
# MARS Sampler for models trained with 100% masking.
#
# The key difference from standard block diffusion samplers:
# - Standard: Tokens are revealed based on confidence (most confident first).
# - MARS: Tokens are revealed LEFT-TO-RIGHT within the block.
#
# Left-to-Right Logic:
# 1. Model predicts all masked positions in the current block.
# 2. Starting from the leftmost masked position, tokens pass a confidence threshold.
# 3. Accept tokens consecutively from left until one fails the threshold OR we hit max_accept.
# 4. If no threshold is set (None), accept exactly 1 token per step (always the leftmost).
#
# This aligns with training where the model always saw a fully masked block
# and learned to predict left-to-right (causal intra-block).

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class SamplerOutput:
    sequences: torch.Tensor
    histories: list | None = None


def add_gumbel_noise(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """
    The Gumbel max is a method for sampling categorical distributions.
    According to arXiv:2409.02908, for MDM, low-precision Gumbel Max improves
    perplexity score but reduces generation quality. Thus, we use float64.
    """
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    gumbel_noise = (-torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


def build_pure_causal_attention_mask(
    x: torch.Tensor,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Build a strict causal attention mask.
    No block boundary constraints. Every token can attend to all previous valid tokens.
    """
    B, T = x.shape
    device = x.device

    # Per-sample valid mask (exclude padding)
    valid = x != pad_token_id

    # Position IDs: logical positions 0..T-1 (ignoring padding gaps)
    pos_raw = torch.cumsum(valid.to(torch.long), dim=-1)
    logical_pos = pos_raw - 1
    position_ids = torch.where(valid, logical_pos, torch.zeros_like(logical_pos)).to(device=device, dtype=torch.long)

    # Physical positions for causal mask
    pos = torch.arange(T, device=device)

    valid_q = valid.unsqueeze(2)  # [B, T, 1]
    valid_k = valid.unsqueeze(1)  # [B, 1, T]

    # Causal (General Time Arrow): pos_k <= pos_q
    causal_mask = pos.view(1, T, 1) >= pos.view(1, 1, T)  # [1, T, T] broadcastable

    # Combine
    base_mask = causal_mask & valid_q & valid_k

    return base_mask.unsqueeze(1), position_ids  # [B, 1, T, T]


@dataclass
class MARSSamplerConfig:
    """Config for MARSSampler."""
    max_new_tokens: int = 128
    max_length: int = None
    block_size: int = 32
    steps: int = 128
    steps_per_block: int | None = None
    temperature: float = 0.0
    cfg_scale: float = 0.0
    right_shift_logits: bool = False
    # Confidence threshold for accepting tokens.
    # If None, accept exactly 1 token per step.
    # If set (e.g., 0.5), accept consecutive tokens from left as long as conf >= threshold.
    confidence_threshold: float | None = None
    # Max tokens to accept per step (even if more pass threshold).
    max_accept_per_step: int | None = None
    # Acceptance metric: "probability" (default), "entropy", or "margin".
    # - probability: accept if P(top token) >= threshold (higher = more confident)
    # - entropy: accept if H(p) <= threshold (lower = more confident)
    # - margin: accept if P(top1) - P(top2) >= threshold (higher = more confident)
    acceptance_metric: str = "probability"
    return_dict: bool = False


def left_to_right_step(
    logits: torch.Tensor,  # [B, L, V]
    x_block: torch.Tensor,  # [B, L]
    mask_block: torch.Tensor,  # [B, L] bool
    mask_id: int,
    temperature: float,
    confidence_threshold: float | None,
    max_accept: int | None,
    acceptance_metric: str = "probability",
) -> tuple[torch.Tensor, list[int]]:
    """
    One generation step with left-to-right acceptance.

    Args:
        logits: Model predictions for the block.
        x_block: Current block tokens.
        mask_block: Boolean mask of which positions are still masked.
        mask_id: The mask token ID.
        temperature: Sampling temperature (0 = greedy).
        confidence_threshold: If set, accept consecutive tokens from left with conf >= this.
        max_accept: Maximum tokens to accept per step.
        acceptance_metric: "probability", "entropy", or "margin".

    Returns:
        Tuple of (updated x_block, list of accepted counts per batch element).
    """
    B, L, V = logits.shape
    device = logits.device

    if not mask_block.any():
        return x_block, [0] * B

    # Sample predictions
    if temperature > 0:
        logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
        x0 = torch.argmax(logits_with_noise, dim=-1)  # [B, L]
    else:
        x0 = torch.argmax(logits, dim=-1)  # [B, L]

    # Compute per-position acceptance score based on metric
    p = F.softmax(logits, dim=-1)  # [B, L, V]
    if acceptance_metric == "entropy":
        # H(p) = -sum(p * log(p)); accept if H <= threshold (low entropy = confident)
        log_p = torch.log(p + 1e-10)
        x0_conf = -(p * log_p).sum(dim=-1)  # [B, L]
    elif acceptance_metric == "margin":
        # margin = P(top1) - P(top2); accept if margin >= threshold
        top2 = torch.topk(p, k=2, dim=-1).values  # [B, L, 2]
        x0_conf = top2[:, :, 0] - top2[:, :, 1]  # [B, L]
    else:
        # probability (default): P(chosen token); accept if P >= threshold
        x0_conf = torch.gather(p, dim=-1, index=x0.unsqueeze(-1)).squeeze(-1)  # [B, L]

    # For entropy, lower is more confident; for probability/margin, higher is more confident
    accept_if_below = (acceptance_metric == "entropy")

    # Build output
    x_block_new = x_block.clone()
    accepted_per_batch = []

    for b in range(B):
        # Find masked positions for this batch element
        masked_positions = mask_block[b].nonzero(as_tuple=True)[0]  # 1D tensor of indices
        if len(masked_positions) == 0:
            continue

        # Iterate LEFT-TO-RIGHT through masked positions
        accepted_count = 0
        max_to_accept = max_accept if max_accept is not None else L  # Default: accept up to block_size

        for pos in masked_positions:
            pos_idx = pos.item()
            conf = x0_conf[b, pos_idx].item()

            # Check threshold (if set)
            if confidence_threshold is not None:
                if accept_if_below:
                    # Entropy: reject if conf > threshold (high entropy = uncertain)
                    if conf > confidence_threshold and accepted_count > 0:
                        break
                else:
                    # Probability/margin: reject if conf < threshold
                    if conf < confidence_threshold and accepted_count > 0:
                        break

            # Accept this token
            x_block_new[b, pos_idx] = x0[b, pos_idx]
            accepted_count += 1

            # Check max accept limit
            if accepted_count >= max_to_accept:
                break

            # If no threshold, accept only 1 token (the leftmost)
            if confidence_threshold is None:
                break

        accepted_per_batch.append(accepted_count)

    return x_block_new, accepted_per_batch


@dataclass
class MARSSampler:
    """
    Sampler for MARS models.

    Uses left-to-right token acceptance within each block.
    """
    model: object
    tokenizer: object

    def __post_init__(self):
        self.global_forward_passes = 0
        self.global_tokens_accepted = 0
        self.global_samples = 0

    def get_global_stats(self) -> dict:
        """Aggregate stats across all processes and return as dict. Also prints on rank 0."""
        forward_passes = torch.tensor(self.global_forward_passes, device=self.model.device)
        tokens_accepted = torch.tensor(self.global_tokens_accepted, device=self.model.device)
        samples = torch.tensor(self.global_samples, device=self.model.device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(forward_passes)
            torch.distributed.all_reduce(tokens_accepted)
            torch.distributed.all_reduce(samples)
        fp = forward_passes.item()
        ta = tokens_accepted.item()
        s = samples.item()
        stats = {
            "samples": s,
            "total_forwards": fp,
            "total_tokens_accepted": ta,
            "avg_tokens_per_forward": ta / fp if fp > 0 else 0.0,
        }
        is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if fp > 0 and is_main:
            print(f"[MARS Global Stats] {stats}")
        return stats

    @torch.no_grad()
    def sample(
        self,
        inputs: list[torch.Tensor | list],
        config: MARSSamplerConfig | None = None,
        **kwargs,
    ) -> SamplerOutput | torch.Tensor:
        if config is None:
            config = MARSSamplerConfig()

        # Pull args
        steps = kwargs.get("steps", config.steps)
        steps_per_block = kwargs.get("steps_per_block", config.steps_per_block)
        max_new_tokens = kwargs.get("max_new_tokens", config.max_new_tokens)
        max_length = kwargs.get("max_length", config.max_length)
        block_size = kwargs.get("block_size", config.block_size)
        temperature = kwargs.get("temperature", config.temperature)
        cfg_scale = kwargs.get("cfg_scale", config.cfg_scale)
        return_dict = kwargs.get("return_dict", config.return_dict)
        right_shift_logits = kwargs.get("right_shift_logits", config.right_shift_logits)
        confidence_threshold = kwargs.get("confidence_threshold", config.confidence_threshold)
        max_accept_per_step = kwargs.get("max_accept_per_step", config.max_accept_per_step)
        acceptance_metric = kwargs.get("acceptance_metric", config.acceptance_metric)

        assert block_size >= 1
        assert steps >= 1

        mask_id = self.tokenizer.mask_token_id
        bos_id = self.tokenizer.bos_token_id
        pad_id = self.tokenizer.pad_token_id

        # Normalize inputs
        if right_shift_logits:
            inputs = [[bos_id] if isinstance(p, list) and len(p) == 0 else p for p in inputs]

        if isinstance(inputs[0], list):
            inputs = [torch.as_tensor(p, dtype=torch.long, device=self.model.device) for p in inputs]

        prompt_lens = [p.shape[0] for p in inputs]
        if max_new_tokens:
            max_length = max_new_tokens + max(prompt_lens)
        else:
            max_new_tokens = max_length - max(prompt_lens)

        B = len(inputs)
        max_prompt_len = max(prompt_lens)

        # Initialize with left-padded prompts
        x = torch.full((B, max_prompt_len), pad_id, dtype=torch.long, device=self.model.device)
        for b, p in enumerate(inputs):
            L = prompt_lens[b]
            offset = max_prompt_len - L
            x[b, offset:offset + L] = p

        histories = [x.clone()] if return_dict else None
        generated = 0

        # Statistics tracking
        total_forward_passes = 0
        total_tokens_accepted = 0

        # Per-sample done tracking
        done = torch.zeros(B, dtype=torch.bool, device=self.model.device)

        # Append initial block of MASK tokens (always keep block_size MASKs at end)
        initial_mask = torch.full((B, block_size), mask_id, dtype=torch.long, device=self.model.device)
        x = torch.cat([x, initial_mask], dim=1)

        # =====================================================
        # Sliding Window: always keep block_size MASKs at the end
        # Each step: forward block -> accept N tokens -> update cache -> slide
        # =====================================================
        max_steps = steps if steps else max_new_tokens
        for step_idx in range(max_steps):
            if done.all():
                break
            if generated >= max_new_tokens:
                break

            T_total = x.shape[1]
            T_prefix = T_total - block_size

            # --- 1. Single forward of entire x (no cache split) ---
            full_attn, full_pos = build_pure_causal_attention_mask(
                x=x,
                pad_token_id=pad_id,
            )

            x_block = x[:, T_prefix:T_total]
            mask_block = (x_block == mask_id) & (~done.unsqueeze(1).expand(B, block_size))

            if not mask_block.any():
                break

            out_full = self.model(
                x,
                attention_mask=full_attn,
                position_ids=full_pos,
            )
            total_forward_passes += 1

            full_logits = out_full.logits
            logits_block = full_logits[:, T_prefix:T_total, :]

            if right_shift_logits:
                shifted = torch.empty_like(logits_block)
                shifted[:, 0:1, :] = full_logits[:, T_prefix-1:T_prefix, :]
                shifted[:, 1:, :] = logits_block[:, :-1, :]
                logits_block = shifted

            # --- 3. Accept tokens left-to-right ---
            x_block_updated, n_accepted = left_to_right_step(
                logits=logits_block,
                x_block=x_block,
                mask_block=mask_block,
                mask_id=mask_id,
                temperature=temperature,
                confidence_threshold=confidence_threshold,
                max_accept=max_accept_per_step,
                acceptance_metric=acceptance_metric,
            )
            total_tokens_accepted += sum(n_accepted)
            x[:, T_prefix:T_total] = x_block_updated

            # Calculate how many tokens were accepted
            n_new = max(n_accepted) if n_accepted else 0
            if n_new == 0:
                n_new = 1  # always advance by at least 1

            n_new = min(n_new, max_new_tokens - generated)
            if n_new <= 0:
                break

            # --- 4. Slide: append new MASKs to replace accepted tokens ---
            new_masks = torch.full((B, n_new), mask_id, dtype=torch.long, device=self.model.device)
            # Done samples get pad
            if done.any():
                new_masks[done] = pad_id
            x = torch.cat([x, new_masks], dim=1)
            generated += n_new

            # Per-sample EOS check (in the accepted region)
            for b in range(B):
                if not done[b]:
                    accepted_region = x[b, T_prefix:T_prefix + block_size]
                    if self.tokenizer.eos_token_id in accepted_region:
                        done[b] = True

            if histories is not None:
                histories.append(x.clone())

        # =====================================================
        # Accumulate global statistics
        # =====================================================
        self.global_forward_passes += total_forward_passes
        self.global_tokens_accepted += total_tokens_accepted
        self.global_samples += 1

        # =====================================================
        # Output
        # =====================================================
        if not return_dict:
            return x
        else:
            return SamplerOutput(sequences=x, histories=histories)


# ========================================= END port


# ---------------------------------------------------------------------------------------------- the benchmark


def _answer(new, eos_id, max_new_tokens, mask_id=None):
    """New tokens up to and including the first EOS (the reference's output ends with its block of masks)."""
    out = []
    for t in new[:max_new_tokens]:
        if t == mask_id:
            break
        out.append(t)
        if t == eos_id:
            break
    return out


def main(argv=None):
    import argparse
    import json
    import os
    import statistics
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

    import hf_mars
    from hf_mars._compat import compile_on_any_device
    from hf_mars.demo.bench import encode_prompts, load_prompts, machine_info

    p = argparse.ArgumentParser(description="Per-call time at batch 1: the paper's sampler vs hf-mars vs plain generate.")
    p.add_argument("--model", default="runs/demo/mars-checkpoint")
    p.add_argument("--prompts", default=None, help="prompt file (as hf-mars bench reads it); default: held-out split")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--thresholds", type=float, nargs="+", default=[1.0, 0.99, 0.95, 0.9])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--static-compile", action="store_true",
                   help="also time hf-mars with cache_implementation='static' + torch.compile (compiles on CPU too)")
    p.add_argument("--output", default=None, help="write the JSON here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = hf_mars.enable_mars(AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval())
    B, M, eos_id, mask_id = model.config.mars["block_size"], args.max_new_tokens, tok.eos_token_id, tok.mask_token_id
    sampler = MARSSampler(model=model, tokenizer=tok)
    records = load_prompts(args.prompts, limit=args.num_prompts)
    prompts = [torch.tensor(e, device=args.device) for e in encode_prompts(tok, [r["prompt"] for r in records])]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    plain_generate = type(model).generate  # the class's own generate (enable_mars reroutes the instance's)
    compiled = {"cache_implementation": "static", "compile_config": compile_on_any_device(CompileConfig())}

    def ref(ids, tau):
        x = sampler.sample([ids], max_new_tokens=M, steps=M, block_size=B, right_shift_logits=True,
                           confidence_threshold=None if tau >= 1.0 else tau)
        return x[0, ids.shape[0]:]

    def ours(ids, tau, **kw):
        return model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], mars=True,
                              mars_threshold=tau, max_new_tokens=M, do_sample=False, **kw)[0, ids.shape[0]:]

    def plain(ids, tau=None):
        return plain_generate(model, input_ids=ids[None], attention_mask=torch.ones_like(ids)[None],
                              max_new_tokens=M, do_sample=False)[0, ids.shape[0]:]

    calls = {("plain", None): plain}
    for tau in args.thresholds:
        calls[("ref", tau)] = ref
        calls[("ours", tau)] = ours
        if args.static_compile:
            calls[("ours_sc", tau)] = lambda ids, tau: ours(ids, tau, **compiled)
    keys = list(calls)

    # warm-up (and compilation) + outputs: every setting once per prompt, untimed; forwards counted
    answers, forwards = {k: [] for k in keys}, {k: [] for k in keys}
    n_forwards = [0]
    hook = model.register_forward_pre_hook(lambda *a: n_forwards.__setitem__(0, n_forwards[0] + 1))
    for ids in prompts:
        for k in keys:
            n_forwards[0] = 0
            answers[k].append(_answer(calls[k](ids, k[1]).tolist(), eos_id, M, mask_id))
            forwards[k].append(n_forwards[0])
    hook.remove()

    # timing: per prompt, every setting in rotating order, repeated
    times = {k: [[] for _ in prompts] for k in keys}
    load_start = os.getloadavg()
    with torch.no_grad():
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                shift = (rep + i) % len(keys)
                for k in keys[shift:] + keys[:shift]:
                    sync()
                    t0 = time.perf_counter()
                    calls[k](ids, k[1])
                    sync()
                    times[k][i].append(time.perf_counter() - t0)
    load_end = os.getloadavg()
    med = {k: [statistics.median(t) for t in times[k]] for k in keys}  # per prompt, over repeats
    best = {k: [min(t) for t in times[k]] for k in keys}

    def ms(k):  # median over prompts of the per-prompt median
        return 1e3 * statistics.median(med[k])

    def ratio(a, b, per=med):  # total time of a / total time of b (= ratio of mean per-call times)
        return sum(per[a]) / sum(per[b])

    rows, mismatches, P = [], [], ("plain", None)
    for tau in args.thresholds:
        r, o = ("ref", tau), ("ours", tau)
        same = [a == b for a, b in zip(answers[r], answers[o])]
        mismatches += [{"tau": tau, "prompt": i, "ref": tok.decode(answers[r][i]), "ours": tok.decode(answers[o][i])}
                       for i, ok in enumerate(same) if not ok]
        row = {"tau": tau, "ref_ms": ms(r), "ours_ms": ms(o), "plain_ms": ms(P),
               "ours_vs_ref": ratio(r, o), "ours_vs_ref_best": ratio(r, o, best), "ours_vs_plain": ratio(P, o),
               "identical": sum(same), "n": len(same), "ours_equals_plain": sum(
                   a == b for a, b in zip(answers[o], answers[P])),
               "ref_forwards": sum(forwards[r]), "ours_forwards": sum(forwards[o]),
               "tokens": sum(len(a) for a in answers[o])}
        if args.static_compile:
            sc = ("ours_sc", tau)
            row.update(sc_ms=ms(sc), sc_vs_ref=ratio(r, sc), sc_vs_ref_best=ratio(r, sc, best),
                       sc_identical=sum(a == b for a, b in zip(answers[r], answers[sc])))
        rows.append(row)

    n_tok = sorted(len(a) for a in answers[P])
    print(f"{len(prompts)} prompts, batch 1, answers {n_tok[0]}-{n_tok[-1]} tokens (median {statistics.median(n_tok):g}), "
          f"max_new_tokens={M}, B={B}, {args.repeats} repeats, {args.threads} thread(s), "
          f"load average {load_start[0]:.2f} -> {load_end[0]:.2f}")
    print("ms: median per call; x: total time ratio (best: fastest repeat per prompt); same: outputs identical to ref")
    sc_head = f" {'s+c ms':>7} {'s+c/ref':>8} {'(best)':>7} {'same':>6}" if args.static_compile else ""
    print(f"{'tau':>5} {'ref ms':>7} {'ours ms':>7} {'plain ms':>8} {'ours/ref':>8} {'(best)':>7} {'plain/ours':>10} "
          f"{'same':>6} {'fwd ref':>7} {'fwd ours':>8} {'tok/fwd':>7}" + sc_head)
    for w in rows:
        line = (f"{w['tau']:>5g} {w['ref_ms']:>7.2f} {w['ours_ms']:>7.2f} {w['plain_ms']:>8.2f} {w['ours_vs_ref']:>7.2f}x "
                f"{w['ours_vs_ref_best']:>6.2f}x {w['ours_vs_plain']:>9.2f}x {w['identical']:>3}/{w['n']:<2} "
                f"{w['ref_forwards']:>7} {w['ours_forwards']:>8} {w['tokens'] / w['ours_forwards']:>7.2f}")
        if args.static_compile:
            line += (f" {w['sc_ms']:>7.2f} {w['sc_vs_ref']:>7.2f}x {w['sc_vs_ref_best']:>6.2f}x "
                     f"{w['sc_identical']:>3}/{w['n']:<2}")
        print(line)
    for m in mismatches:
        print(f"  mismatch tau={m['tau']:g} prompt {m['prompt']}: ref {m['ref']!r} ours {m['ours']!r}")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"settings": vars(args), "block_size": B, "machine": machine_info(torch.device(args.device)),
                       "load_average": {"start": load_start, "end": load_end}, "rows": rows,
                       "mismatches": mismatches, "answer_tokens": [len(a) for a in answers[P]],
                       "per_prompt_ms": {f"{k[0]}:{k[1]}": [1e3 * t for t in v] for k, v in med.items()}}, f, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
