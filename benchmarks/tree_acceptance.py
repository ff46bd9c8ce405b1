"""Per-depth draft coverage of a MARS checkpoint along greedy answers, and what static draft TREES would gain.

Verify mode today (docs/method.md section 3) drafts one chain: the argmax of each of the B-1 masks appended after the
last committed token, accepted while each equals the AR argmax at its position. A tree draft would offer several
candidates per depth (each mask's top-k, laid out under a tree attention mask) and accept the longest path AR agrees
with. Because a MARS mask's prediction depends only on the committed prefix (never on the draft tokens before it),
the candidates at depth d are the same under every parent: a static tree of shape (k_1, ..., k_D) is the Cartesian
product of each depth's top-k_d, it has sum_d prod_{i<=d} k_i nodes, and its accepted length is the number of
leading depths whose true token is within that depth's top-k_d.

Measurement. For each held-out prompt (hf_mars.demo.data, split "eval", seed 1; the user turn through the chat
template with add_generation_prompt=True): the plain greedy answer g (``generate``, do_sample=False, stops at EOS,
the mask token never emitted). Then for every answer position t, ONE fp32 forward without cache over
``[prompt + g[:t] | masks]`` (as ``rules.reference_decode`` does): the logits at the last prefix position are
depth 0 (they predict g[t], the AR token: checked), the logits at mask j predict g[t+j] (depth j). The mask token is
suppressed in every distribution. Stored per (t, j): the rank of g[t+j] in that distribution (0 = argmax), so every
top-k coverage and tree shape below is a function of the stored ranks (the JSON keeps them: other shapes can be
scored without the model).

Depths: masks 1..B-1 are the trained drafts; the run forwards B masks (the logits of masks 1..B-1 are the same under
causal attention) so that depth B, the last mask that verify mode reads by default (``mars_use_last_mask``), is
measured too. Shapes of depth B-1 compare with the chain (1,)*(B-1), shapes of depth B with (1,)*B.

Reported:

- coverage: per depth j and k, the share of positions (with t+j inside the answer) where g[t+j] is in mask j's top-k;
  also conditional on all earlier depths being covered at the same k.
- per tree shape: nodes, and tokens-per-forward figures (tokens emitted / forwards, summed over prompts):
  * ``per_position``: 1 + E[accepted drafts] over positions whose full window lies inside the answer, where
    E[accepted] = sum_d P(depths 1..d all covered);
  * ``simple``: walk the answer; at position t accept a = the leading covered depths (capped at the answer's end),
    emit 1 + a tokens, continue at t + a + 1; one forward per step. This assumes fresh drafts at every step, i.e.
    masks appended after every tree node (and the root) so the masks behind whatever path is accepted give the
    next step's drafts (``every-node masks`` below, exactly); the ceiling for the shape;
  * ``verify``: today's verify rule, literally: a forward verifying drafts from prefix s emits a + 1 tokens and
    proposes new drafts only when every depth was accepted (masks appended after each full-depth leaf, here
    assumed), otherwise the next forward proposes only ([correction | masks]: 1 token, new drafts). For the chain
    (1,)*(B-1) this is exactly hf-mars verify mode (``mars_use_last_mask=False``), for (1,)*B its default;
    ``--check-verify`` runs the real decoder (``mars_verify=True``, each draft tau, with and without the last mask)
    on every prompt and compares its forward count with the chain simulations.
    ``verify tau=T``: the same with verify's draft truncation (the tree keeps the leading depths whose distribution's
    top probability is >= T; tau 0.3 is verify's default). ``top1-leaf masks``: masks only after the all-top-1 leaf
    (D extra positions), so new drafts follow only when the accepted path is the top-1 chain of full depth.
    ``every-node masks``: D masks after the root and after every node, so whatever path is accepted the next drafts
    are ready (no proposal-only forward after a rejection; equals ``simple`` up to one forward per answer).
  Each shape also reports its step width (positions one verify forward feeds: 1 + nodes + masks) for each layout.

    OMP_NUM_THREADS=1 python benchmarks/tree_acceptance.py --model runs/demo/mars-checkpoint \\
        --num-prompts 48 --check-verify --output benchmarks/tree_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mars import enable_mars
from hf_mars.demo.data import generate_examples

DEFAULT_KS = (1, 2, 3, 4, 5, 8)
DEFAULT_SHAPES = ("1,1,1", "2,1,1", "3,1,1", "2,2,1", "2,2,2", "3,2,1", "3,2,2", "4,2,1", "4,2,2", "4,3,2",
                  "5,3,2", "8,4,2", "1,1", "2,2", "3,2",
                  "1,1,1,1", "2,1,1,1", "2,2,1,1", "3,2,1,1", "2,2,2,1", "4,2,2,1", "5,3,2,1", "4,2,2,2")


def nodes(shape) -> int:
    """Draft nodes of a static tree: sum over depths of the product of the branching factors so far."""
    total, width = 0, 1
    for k in shape:
        width *= k
        total += width
    return total


def leading_covered(ranks_t, shape, limit: int) -> int:
    """Accepted drafts at one position: leading depths whose true token is within that depth's top-k (at most
    ``limit``, the tokens left in the answer after the AR token)."""
    a = 0
    for d, k in enumerate(shape):
        if a >= limit or ranks_t[d + 1] is None or ranks_t[d + 1] >= k:
            break
        a += 1
    return a


def simulate_simple(ranks, shape):
    """Fresh drafts every step: (forwards, tokens)."""
    L, t, fwd = len(ranks), 0, 0
    while t < L:
        a = leading_covered(ranks[t], shape, L - 1 - t)
        fwd += 1
        t += a + 1
    return fwd, L


def simulate_verify(ranks, shape, conf=None, tau=0.0, top1_masks_only=False, every_node_masks=False):
    """Today's verify rule with a tree: (forwards, tokens). ``s`` is the prefix the pending drafts came from (the
    forward that made them emitted g[s]); None when the next forward has no drafts to verify. Draft tau: the tree
    keeps only the leading depths whose distribution's top probability is >= tau (as verify truncates its chain)."""
    L, fwd = len(ranks), 0
    emitted, s = 0, None
    while emitted < L:
        fwd += 1
        if s is None:  # [last token | masks]: the AR token g[emitted], drafts from this prefix
            s = emitted
            emitted += 1
            continue
        depth = len(shape)
        if tau > 0:
            depth = next((d for d in range(len(shape)) if conf[s][d + 1] < tau), len(shape))
        a = leading_covered(ranks[s], shape[:depth], L - 1 - s)
        emitted = s + a + 2  # accepted g[s+1..s+a] and the AR token g[s+a+1]
        full = a == depth
        if top1_masks_only:
            full = full and all(ranks[s][d + 1] == 0 for d in range(a))
        s = s + a + 1 if (full or every_node_masks) else None
    return fwd, L


def rank_of(scores, token: int) -> int:
    return int((scores > scores[token]).sum())


@torch.no_grad()
def position_ranks(model, prompt_ids, answer, mask_id: int, masks: int):
    """(ranks, conf): ranks[t][j] for j = 0..masks is the rank of answer[t+j] in the distribution of depth j at
    prefix prompt + answer[:t] (None past the answer's end); conf[t][j] that distribution's top probability (verify's
    draft confidence). Under causal attention mask j's logits do not depend on the masks after it, so forwarding B
    masks gives depths 1..B-1 exactly as B-1 masks would, plus the last mask."""
    P, L = len(prompt_ids), len(answer)
    ranks, conf = [], []
    for t in range(L):
        ids = prompt_ids + answer[:t] + [mask_id] * masks
        logits = model(torch.tensor([ids])).logits[0].float()
        scores = logits[P + t - 1:P + t + masks].clone()
        scores[:, mask_id] = -math.inf
        conf.append([round(float(x), 5) for x in torch.softmax(scores, -1).amax(-1)])
        ranks.append([rank_of(scores[j], answer[t + j]) if t + j < L else None for j in range(masks + 1)])
    return ranks, conf


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="runs/demo/mars-checkpoint")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ks", type=int, nargs="+", default=list(DEFAULT_KS))
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="comma-separated top-k per depth")
    p.add_argument("--draft-taus", type=float, nargs="+", default=[0.0, 0.3],
                   help="verify simulation: drafts kept while their depth's top probability is >= tau (0.3: default)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check-verify", action="store_true",
                   help="also run hf-mars verify mode (each draft tau, with and without the last mask) and compare "
                        "its forward counts with the chain simulations")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()

    tok = AutoTokenizer.from_pretrained(args.model)
    model = enable_mars(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval())
    B, mask_id = model.config.mars["block_size"], model.config.mars["mask_token_id"]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    for sh in shapes:
        if len(sh) > B:
            raise SystemExit(f"shape {sh} is deeper than the B masks (B-1 trained drafts + the optional last mask)")
    chain, chain_last = (1,) * (B - 1), (1,) * B
    key = lambda sh: ",".join(map(str, sh))
    examples = generate_examples(args.num_prompts, seed=args.seed, split="eval")

    per_prompt = []
    depth0_mismatch = 0
    verify_checks = []
    for i, ex in enumerate(examples):
        prompt = tok.apply_chat_template(ex["messages"][:1], tokenize=False, add_generation_prompt=True)
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            seq = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=args.max_new_tokens)
        answer = seq[0, len(prompt_ids):].tolist()
        for n, x in enumerate(answer):
            if x in eos:
                del answer[n + 1:]
                break
        ranks, conf = position_ranks(model, prompt_ids, answer, mask_id, B)
        depth0_mismatch += sum(r[0] != 0 for r in ranks)
        per_prompt.append({"task": ex["task"], "answer_tokens": len(answer), "ranks": ranks, "conf": conf})
        if args.check_verify:
            row = {}
            for sh in (chain, chain_last):  # drafts from masks 1..B-1, and with the last mask (verify's default)
                for tau in args.draft_taus:
                    with torch.no_grad():
                        out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                                             max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                                             mars=True, mars_verify=True, mars_threshold=tau, mars_block_size=B,
                                             mars_use_last_mask=len(sh) == B)
                    got = out.sequences[0, len(prompt_ids):].tolist()
                    row[f"{key(sh)} tau={tau:g}"] = {
                        "same_answer": got[:len(answer)] == answer and len(got) >= len(answer),
                        "forwards": int(out.mars_forward_passes[0]), "emitted": int(out.mars_emitted_tokens[0]),
                        "forwards_simulated": simulate_verify(ranks, sh, conf, tau)[0]}
            verify_checks.append(row)
        print(f"\rprompt {i + 1}/{len(examples)} ({time.time() - t0:.0f}s)", end="", flush=True)
    print()

    # ---- coverage per depth x k (and conditional on earlier depths covered at the same k)
    coverage, conditional, counts = {}, {}, {}
    for j in range(B + 1):
        counts[j] = sum(r[j] is not None for pp in per_prompt for r in pp["ranks"])
        coverage[j], conditional[j] = {}, {}
        for k in args.ks:
            hit = sum(r[j] is not None and r[j] < k for pp in per_prompt for r in pp["ranks"])
            coverage[j][k] = 100.0 * hit / max(counts[j], 1)
            if j >= 1:
                base = [r for pp in per_prompt for r in pp["ranks"]
                        if r[j] is not None and all(r[i] < k for i in range(1, j))]
                conditional[j][k] = 100.0 * sum(r[j] < k for r in base) / max(len(base), 1)

    # ---- tree shapes
    results = {}
    for sh in shapes:
        full_window = [r for pp in per_prompt for r in pp["ranks"] if r[len(sh)] is not None]
        e_acc = 0.0
        for d in range(1, len(sh) + 1):
            e_acc += sum(all(r[i] < sh[i - 1] for i in range(1, d + 1)) for r in full_window) / max(len(full_window), 1)
        runs = {"simple": lambda pp, sh=sh: simulate_simple(pp["ranks"], sh)}
        for tau in args.draft_taus:
            runs[f"verify tau={tau:g}"] = lambda pp, sh=sh, tau=tau: simulate_verify(pp["ranks"], sh, pp["conf"], tau)
        runs["verify tau=0 top1-leaf masks"] = lambda pp, sh=sh: simulate_verify(pp["ranks"], sh,
                                                                                 top1_masks_only=True)
        runs["verify tau=0 every-node masks"] = lambda pp, sh=sh: simulate_verify(pp["ranks"], sh,
                                                                                  every_node_masks=True)
        sims = {}
        for name, fn in runs.items():
            f_tot, tok_tot, per_task = 0, 0, defaultdict(lambda: [0, 0])
            for pp in per_prompt:
                f, n = fn(pp)
                f_tot, tok_tot = f_tot + f, tok_tot + n
                per_task[pp["task"]][0] += n
                per_task[pp["task"]][1] += f
            sims[name] = {"tokens_per_forward": round(tok_tot / f_tot, 4), "forwards": f_tot, "tokens": tok_tot,
                          "per_task": {t: round(v[0] / v[1], 3) for t, v in sorted(per_task.items())}}
        leaves, D = math.prod(sh), len(sh)
        width = {"verify": 1 + nodes(sh) + leaves * D, "top1-leaf masks": 1 + nodes(sh) + D,
                 "every-node masks": 1 + nodes(sh) + (nodes(sh) + 1) * D}
        results[key(sh)] = {"shape": list(sh), "nodes": nodes(sh), "step_width": width,
                            "expected_accepted": round(e_acc, 4),
                            "per_position_tpf": round(1 + e_acc, 4), "positions_full_window": len(full_window),
                            "simulations": sims}

    # ---- print
    print(f"\nmodel {args.model}: B = {B}, mask id {mask_id}; {len(per_prompt)} held-out prompts (seed {args.seed}), "
          f"{sum(pp['answer_tokens'] for pp in per_prompt)} answer tokens; depth-0 argmax != greedy at "
          f"{depth0_mismatch} positions")
    print("\ncoverage (%): true token within the top-k of depth j's distribution (mask suppressed)")
    print("| depth | n | " + " | ".join(f"top-{k}" for k in args.ks) + " |")
    print("|---|---|" + "---|" * len(args.ks))
    for j in range(B + 1):
        note = " (AR)" if j == 0 else " (last mask)" if j == B else ""
        print(f"| {j}{note} | {counts[j]} | " + " | ".join(f"{coverage[j][k]:.1f}" for k in args.ks) + " |")
    print("\nconditional coverage (%): depth j in top-k given depths 1..j-1 all in top-k (same k)")
    print("| depth | " + " | ".join(f"top-{k}" for k in args.ks) + " |")
    print("|---|" + "---|" * len(args.ks))
    for j in range(1, B + 1):
        print(f"| {j} | " + " | ".join(f"{conditional[j][k]:.1f}" for k in args.ks) + " |")
    names = list(next(iter(results.values()))["simulations"])
    print(f"\ntree shapes (top-k per depth): tokens per forward (x: against the chain of the same depth, "
          f"({key(chain)}) for depth <= {B - 1}, ({key(chain_last)}) = + the last mask, verify's default drafts, "
          f"for depth {B})")
    print("step width = positions a verify forward feeds: 1 + nodes + masks (verify: D masks after every full-depth "
          "leaf; top1-leaf: D masks after the top-1 leaf only; every-node: D masks after the root and every node)")
    print("| shape | nodes | width verify/top1-leaf/every-node | E[accepted] | per-position 1+E | "
          + " | ".join(f"{n} sim" for n in names) + " |")
    print("|---|---|---|---|---|" + "---|" * len(names))
    for name, r in results.items():
        c = results.get(key(chain_last if len(r["shape"]) == B else chain), r)["simulations"]
        cells = [f"{r['simulations'][n]['tokens_per_forward']:.3f} "
                 f"({r['simulations'][n]['tokens_per_forward'] / c[n]['tokens_per_forward']:.2f}x)" for n in names]
        w = r["step_width"]
        print(f"| ({name}) | {r['nodes']} | {w['verify']}/{w['top1-leaf masks']}/{w['every-node masks']} | "
              f"{r['expected_accepted']:.3f} | {r['per_position_tpf']:.3f} | "
              + " | ".join(cells) + " |")
    check = None
    if args.check_verify:
        check = {}
        for name in verify_checks[0]:
            rows = [v[name] for v in verify_checks]
            same = sum(v["same_answer"] for v in rows)
            match = sum(v["forwards"] == v["forwards_simulated"] for v in rows)
            fwd_real, emit_real = sum(v["forwards"] for v in rows), sum(v["emitted"] for v in rows)
            fwd_sim = sum(v["forwards_simulated"] for v in rows)
            tokens = sum(pp["answer_tokens"] for pp in per_prompt)
            check[name] = {"same_answer": same, "forward_count_matches": match, "prompts": len(rows),
                           "real_tokens_per_forward": round(emit_real / fwd_real, 4),
                           "simulated_tokens_per_forward": round(tokens / fwd_sim, 4), "rows": rows}
            print(f"check: hf-mars verify ({name}, use_last_mask={name.count('1') == B}) vs its simulation: answers "
                  f"identical {same}/{len(rows)}, forward counts equal {match}/{len(rows)}; real "
                  f"{emit_real / fwd_real:.3f} vs simulated {tokens / fwd_sim:.3f} tokens/forward")
    print(f"\n{time.time() - t0:.0f}s, torch threads {torch.get_num_threads()}")

    if args.output:
        payload = {"model": args.model, "block_size": B, "mask_token_id": mask_id, "num_prompts": len(per_prompt),
                   "seed": args.seed, "max_new_tokens": args.max_new_tokens, "draft_taus": args.draft_taus,
                   "depth0_mismatch": depth0_mismatch,
                   "coverage_percent": {str(j): {str(k): round(v, 2) for k, v in row.items()}
                                        for j, row in coverage.items()},
                   "conditional_coverage_percent": {str(j): {str(k): round(v, 2) for k, v in row.items()}
                                                    for j, row in conditional.items() if row},
                   "positions_per_depth": {str(j): n for j, n in counts.items()},
                   "shapes": results, "verify_check": check,
                   "per_prompt": per_prompt}
        with open(args.output, "w") as f:
            json.dump(payload, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
