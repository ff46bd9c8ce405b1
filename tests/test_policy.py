"""The opt-in draft policy (``mars_draft_tree="cost"``, `hf_mars.generation.policy`) and the step-cost table it
reads (`hf_mars.generation.cost`): their arithmetic, the choices they make under known costs, that every choice,
switching layouts between steps and falling back to plain steps included, decodes exactly what plain greedy
decodes, and that the default ("auto") never consults it."""

import json
import random

import pytest
import torch

import hf_mars.generation.call_record as call_record
import hf_mars.generation.policy as policy_module
from hf_mars.generation import cost, enable_mars
from hf_mars.generation.policy import PLAIN, DraftPolicy, Layout, menu, propose_shape, tree_value

PROMPTS = ["hello world", "a", "the quick brown fox", "xy"]


def _cands(*probs):
    """Per depth one or more (token, probability) pairs, tokens numbered by depth."""
    return [[(10 * d + i, p) for i, p in enumerate(ps)] for d, ps in enumerate(probs)]


# ------------------------------------------------------------------------------------------ the cost table


def test_costs_interpolate_between_measured_widths_and_follow_the_nearest_slope():
    table = cost.StepCosts()
    table.record(4, 1, 0.010)
    assert table.estimate(4, 1) == 0.010
    assert table.estimate(4, 9) is None  # one width says nothing about how cost grows
    table.record(4, 9, 0.018)
    assert table.estimate(4, 5) == pytest.approx(0.014)
    assert table.estimate(4, 13) == pytest.approx(0.022)  # beyond: the last slope
    assert table.estimate(16, 5) is None  # another row count is its own curve
    table.record(4, 9, 0.026)  # a moving average, not the last sample
    assert 0.018 < table.estimate(4, 9) < 0.026


def test_costs_seeded_from_a_bench_report_give_way_to_the_decoders_own_steps(tmp_path):
    report = {"step_costs": {"4": {"past_len": 80, "table_ms": {"1": 10.0, "5": 12.0, "13": 20.0}}}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    table = cost.seed_from_bench(cost.StepCosts(), str(path))
    assert table.snapshot() == {4: {1: 0.010, 5: 0.012, 13: 0.020}}
    table.record(4, 5, 0.030)  # a bench times a bare forward; the first own step replaces it
    assert table.estimate(4, 5) == 0.030
    table.seed(4, {5: 0.001, 7: 0.016})  # seeding never overwrites what was measured
    assert table.estimate(4, 5) == 0.030 and table.estimate(4, 7) == 0.016


def test_costs_are_kept_per_model_device_and_dtype(make_model, monkeypatch, tmp_path):
    cost.forget_all()
    a, _ = make_model(seed=0)
    b, _ = make_model(seed=1)
    assert cost.costs_for(a) is cost.costs_for(a)
    assert cost.costs_for(a) is not cost.costs_for(b)  # unnamed models: one table each
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"step_costs": {"1": {"table_ms": {"1": 2.0, "9": 3.0}}}}))
    monkeypatch.setenv(cost.STEP_COSTS_ENV, str(path))
    cost.forget_all()
    assert cost.costs_for(a).estimate(1, 5) == pytest.approx(0.0025)
    cost.forget_all()


# ------------------------------------------------------------------------------------------ the arithmetic


def test_tree_value_reads_the_masks_probabilities():
    chain = Layout((1, 1, 1), 3, 0.03)
    nodes, groups, expected, grouped_end = tree_value(_cands([.9], [.5], [.8]), chain)
    assert nodes == 3
    assert expected == pytest.approx(.9 + .45 + .36)  # P(reach) of each node
    # ends: root .1, node 0 .45, node 1 .09, node 2 .36: all above 0.03, so every end has masks
    assert groups == 4 and grouped_end == pytest.approx(1.0)
    one_group = Layout((1, 1, 1), 3, 1.0)  # only the likeliest end (node 0) keeps masks
    assert tree_value(_cands([.9], [.5], [.8]), one_group)[1:] == (1, pytest.approx(1.71), pytest.approx(.45))
    wide = Layout((2, 1, 1), 3, 0.03)
    nodes, _, expected, _ = tree_value(_cands([.6, .3], [.5], [.5]), wide)
    assert nodes == 6 and expected == pytest.approx(.6 + .3 + (.6 + .3) * .5 + (.6 + .3) * .25)
    assert tree_value([], chain) == (0, 1, 0.0, 1.0)  # no drafts: the root's masks propose


def _tree_value_by_building(candidates, layout):
    """tree_value's reference: the tree `tree.Tree.grow` builds and the groups `choose_groups` gives it."""
    from hf_mars.generation.tree import Tree

    tree = Tree.grow(candidates, layout.shape)
    tree.choose_groups(layout.min_share)
    reach, child = {-1: 1.0}, {-1: 0.0}
    for node, (parent, prob) in enumerate(zip(tree.parents, tree.probs)):
        reach[node], child[node] = reach[parent] * prob, 0.0
        child[parent] += prob
    grouped_end = sum(reach[n] * max(0.0, 1.0 - child[n]) for n in tree.grouped)
    return len(tree.tokens), len(tree.grouped), sum(reach.values()) - 1.0, min(grouped_end, 1.0)


def test_tree_value_is_the_built_trees_value():
    rng = random.Random(0)
    layouts = menu(4, 0.03) + [Layout((1, 1), 4, 1.0), Layout((3, 2), 2, 0.1), Layout((2, 2, 2), 3, 0.0)]
    for _ in range(400):
        depth = rng.randrange(0, 5)
        candidates = [[(rng.randrange(99), rng.random() ** rng.choice((1, 4))) for _ in range(rng.randrange(0, 4))]
                      for _ in range(depth)]
        for layout in layouts:
            nodes, groups, expected, grouped_end = tree_value(candidates, layout)
            ref = _tree_value_by_building(candidates, layout)
            assert (nodes, groups) == ref[:2], (candidates, layout)
            assert expected == pytest.approx(ref[2]) and grouped_end == pytest.approx(ref[3]), (candidates, layout)


def test_best_drafting_is_the_scan_over_every_option():
    """_best_drafting finds each row's best fit by bisection; the plain scan of every option is what it stands for."""
    def scan(policy, rows, options):
        widths = sorted({o[0] for opts in options.values() for o in opts if not o[4].plain})
        best, best_rate = None, -1.0
        for width in widths:
            cost_ = policy.costs.estimate(rows, width)
            picks, value, immediate = {}, 0.0, 0.0
            for r, opts in options.items():
                fit = [o for o in opts if o[0] <= width and not o[4].plain] or [opts[0]]
                pick = max(fit, key=lambda o: (o[1], -o[0]))
                picks[r], value, immediate = pick, value + pick[1], immediate + pick[2]
            if value / cost_ > best_rate:
                best, best_rate = (max(p[0] for p in picks.values()), picks, immediate), value / cost_
        return best

    rng = random.Random(1)
    layouts = menu(4, 0.03)
    for _ in range(200):
        policy = _policy(_Costs(rng.uniform(0.001, 0.01), rng.uniform(0, 0.001)))
        rows = rng.randrange(1, 9)
        options = {}
        for r in range(rows):
            width0 = rng.randrange(1, 4)
            opts = [(width0, 1.0, 1.0, 0.0, PLAIN)]
            for layout in layouts:  # coarse values and widths: ties in both, as rounding gives them
                opts.append((width0 + rng.randrange(1, 12), rng.choice((1.0, 1.5, 2.0, 2.5)), 1.0, 0.5, layout))
            options[r] = opts
        assert policy._best_drafting(rows, options) == scan(policy, rows, options)


def test_menu_and_the_shape_proposals_keep():
    layouts = menu(4, 0.03)
    labels = [layout.label() for layout in layouts]
    assert labels == ["1", "1,1", "1,1,1", "1,1,1,1", "1,1,1,1/1g", "2,1,1,1", "2,2,1,1"]
    assert propose_shape(layouts) == (2, 2, 1, 1)
    assert all(layout.group == 4 for layout in layouts)  # every group proposes the full depth
    assert menu(1, 0.03)[0] == Layout((1,), 1, 0.03) and PLAIN.plain and PLAIN.label() == "plain"


class _Costs(cost.StepCosts):
    """Costs from a formula: a + slope x rows x width (a step of a CPU-bound model)."""

    def __init__(self, base, slope):
        super().__init__()
        self.base, self.slope = base, slope

    def estimate(self, rows, width):
        return self.base + self.slope * rows * width


def _policy(costs, depth=4):
    policy = DraftPolicy(costs, menu(depth, 0.03))
    policy.rec.drafting_timed = policy_module.EXPLORE_AFTER
    return policy


def test_wide_steps_that_cost_little_draft_the_full_tree():
    policy = _policy(_Costs(0.010, 0.00001))
    choice = policy.choose(1, [1], [_cands([.9], [.9], [.9], [.9])])
    assert not choice.plain and choice.layouts[0] == Layout((1, 1, 1, 1), 4, 0.03)


def test_costly_width_shortens_the_drafts_and_weak_drafts_fall_back_to_plain():
    costs = _Costs(0.001, 0.001)  # every column costs as much as the fixed part: width is what matters
    policy = _policy(costs)
    confident = [_cands([.95], [.3], [.3], [.3])] * 16
    choice = policy.choose(16, [1] * 16, confident)
    nodes, groups, _, _ = tree_value(confident[0], Layout((1, 1, 1, 1), 4, 0.03))  # the full tree: 21 wide
    assert not choice.plain and choice.width < 1 + nodes + 4 * groups
    assert Layout((1, 1, 1, 1), 4, 0.03) not in choice.layouts
    weak = [_cands([.05], [.05], [.05], [.05])] * 16
    policy.rec.accepted, policy.rec.predicted, policy.rec.tokens, policy.rec.width = 0.05, 0.05, 1.05, 9.0
    assert policy.choose(16, [1] * 16, weak).plain


def test_plain_regime_probes_drafting_again():
    policy = _policy(_Costs(0.001, 0.001))
    policy.rec.accepted, policy.rec.predicted, policy.rec.tokens, policy.rec.width = 0.0, 0.5, 1.0, 9.0  # drafting never paid
    rows = 4
    plain = [policy.choose(rows, [1] * rows, [[]] * rows).plain for _ in range(policy_module.PROBE_EVERY + 1)]
    assert all(plain[:-1]) and not plain[-1]


def test_unknown_costs_take_the_default_then_time_a_plain_step_once():
    table = cost.StepCosts()
    policy = DraftPolicy(table, menu(4, 0.03))
    cands = [_cands([.9], [.9], [.9], [.9])]
    first = policy.choose(1, [1], cands)
    assert first.layouts[0] == Layout((1, 1, 1, 1), 4, 0.03)  # today's default before anything is timed
    for _ in range(policy_module.EXPLORE_AFTER):
        policy.observe(first, 1, 25, 0.02, [3])
    assert policy.choose(1, [1], cands).plain  # the plain step's cost is unknown: taken once
    policy.observe(policy_module.Choice([PLAIN], 1, 0.0, True), 1, 1, 0.01, [])
    assert not policy.choose(1, [1], cands).plain  # 4 tokens for 2x the time of one


def test_observe_calibrates_the_masks_probabilities():
    policy = DraftPolicy(cost.StepCosts(), menu(2, 0.03))
    assert policy.calibration == 1.0 and policy.future == policy_module.PRIOR_ACCEPTED  # before any record
    choice = policy_module.Choice([Layout((1, 1), 2, 0.03)] * 2, 7, 3.0, False)  # 1.5 drafts per row predicted
    for _ in range(200):
        policy.observe(choice, 2, 7, 0.01, [0, 1])  # 0.5 accepted
    assert policy.calibration == pytest.approx(1 / 3, rel=1e-3)
    assert policy.future == pytest.approx(0.5, rel=1e-3) and policy.rec.tokens == pytest.approx(1.5, rel=1e-3)
    fresh = DraftPolicy(cost.StepCosts(), menu(2, 0.03))
    fresh.observe(choice, 2, 7, 0.01, [0, 0])  # one bad step moves the prior by 1 / (PRIOR_STEPS + 1) only
    assert fresh.future == pytest.approx(1.0 - 1.0 / (policy_module.PRIOR_STEPS + 1))


def test_a_preempted_step_barely_moves_the_cost():
    table = cost.StepCosts()
    table.record(1, 5, 0.010)
    table.record(1, 5, 0.500)  # preempted
    assert table.estimate(1, 5) < 0.040
    table.record(1, 5, 0.008)
    assert table.estimate(1, 5) < 0.040


# ------------------------------------------------------------------------------------------ equal to greedy


@pytest.fixture
def peaky(make_model):
    model, tok = make_model(seed=1, initializer_range=1.0)
    enable_mars(model)
    return model, tok


def _greedy_and_verify(model, tok, prompts, max_new_tokens=24, tree="cost"):
    enc = tok(prompts, return_tensors="pt", padding=True)
    ref = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, mars_verify=True,
                         mars_threshold=0.0, mars_draft_tree=tree, return_dict_in_generate=True)
    return ref, out


def test_random_layouts_every_step_stay_greedy(peaky, monkeypatch):
    """Whatever the policy picks, per row and per step (every tree of the menu, plain steps, switching at every
    step), the output is plain greedy's."""
    model, tok = peaky
    rng = random.Random(0)
    seen = set()

    def choose(self, rows, uncached, candidates):
        options = [PLAIN] + self.layouts
        layouts = [rng.choice(options) if u is not None else None for u in uncached]
        seen.update(layout.label() for layout in layouts if layout is not None)
        if all(layout is None or layout.plain for layout in layouts):
            return policy_module.Choice(layouts, 1, 0.0, True)
        return policy_module.Choice(layouts, 0, 1.0, False)

    monkeypatch.setattr(DraftPolicy, "choose", choose)
    for prompts in (PROMPTS, PROMPTS[2:3]):
        ref, out = _greedy_and_verify(model, tok, prompts)
        assert torch.equal(out.sequences, ref)
    assert {"plain", "1", "1,1,1,1", "1,1,1,1/1g", "2,2,1,1"} <= seen


@pytest.mark.parametrize("plain_pays", [True, False])
def test_the_policys_own_choices_stay_greedy(peaky, monkeypatch, plain_pays):
    """Costs where a wide step does not pay (the policy falls back to plain steps, probing now and then) and
    where it does (it drafts): the same output as plain greedy either way."""
    model, tok = peaky
    made = []
    original = DraftPolicy.__init__

    def init(self, costs, layouts, history=None, record=None):
        original(self, _Costs(0.001, 0.01) if plain_pays else _Costs(0.010, 0.0), layouts)
        self.rec.drafting_timed = policy_module.EXPLORE_AFTER
        made.append(self)

    monkeypatch.setattr(DraftPolicy, "__init__", init)
    monkeypatch.setattr(policy_module, "PROBE_EVERY", 3)
    ref, out = _greedy_and_verify(model, tok, PROMPTS, max_new_tokens=32)
    assert torch.equal(out.sequences, ref)
    history = made[-1].history
    if plain_pays:
        assert history.get("plain", 0) > 0 and len(history) > 1, history  # plain steps, and probes between them
    else:
        assert "plain" not in history, history


def test_rows_joining_a_cost_batch_stay_greedy(peaky, monkeypatch):
    """`MARSEngine` (rows join and leave between steps) with draft_tree='cost' and random layouts per row and step:
    every row decodes what plain greedy decodes."""
    from transformers import GenerationConfig

    from hf_mars.generation.engine import MARSEngine

    model, tok = peaky
    rng, batches = random.Random(1), set()

    def choose(self, rows, uncached, candidates):
        layouts = [rng.choice([PLAIN] + self.layouts) if u is not None else None for u in uncached]
        batches.add(rows)
        return policy_module.Choice(layouts, 0, 1.0, all(x is None or x.plain for x in layouts))

    monkeypatch.setattr(DraftPolicy, "choose", choose)
    engine, got, arrivals = MARSEngine(model), {}, [(0, PROMPTS[0], 20), (0, PROMPTS[1], 8), (3, PROMPTS[2], 16)]
    step, pending = 0, list(arrivals)
    while pending or len(engine):
        while pending and pending[0][0] <= step:
            _, prompt, max_new = pending.pop(0)
            config = GenerationConfig(max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
            events = engine.add(prompt, tok([prompt]).input_ids[0], config, None, mars_verify=True,
                                mars_draft_tree="cost")
            for handle, tokens, _, _ in events:
                got.setdefault(handle, []).extend(tokens)
        for handle, tokens, _, _ in engine.step(0.0) if len(engine) else ():
            got.setdefault(handle, []).extend(tokens)
        step += 1
    for _, prompt, max_new in arrivals:
        enc = tok([prompt], return_tensors="pt")
        ref = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        assert got[prompt] == ref[0, enc.input_ids.shape[1]:].tolist(), prompt
    assert len(batches) > 1  # the policy laid out steps of batches that rows joined and left


@pytest.mark.parametrize("tree", [None, "auto", "chain", "2,1,1"])
def test_only_cost_consults_the_policy(peaky, monkeypatch, tree):
    """The default and every fixed layout decode as before: no policy is made, no step is chosen by timing."""
    model, tok = peaky

    def refuse(*args, **kwargs):
        raise AssertionError("a policy was made for a fixed layout")

    monkeypatch.setattr(DraftPolicy, "__init__", refuse)
    monkeypatch.setattr(policy_module.ThresholdPolicy, "__init__", refuse)
    ref, out = _greedy_and_verify(model, tok, PROMPTS, tree=tree)
    assert torch.equal(out.sequences, ref)
    enc = tok(PROMPTS[:1], return_tensors="pt")
    model.generate(**enc, max_new_tokens=8, do_sample=False, mars=True, mars_threshold=0.5,
                   mars_plain_steps=False)  # the masks on every step: no plain-step policy either


def test_cost_layouts_are_counted_for_the_bench(peaky):
    model, tok = peaky
    chosen = policy_module.choices_for(model, len(PROMPTS))
    chosen.clear()
    ref, out = _greedy_and_verify(model, tok, PROMPTS)
    assert torch.equal(out.sequences, ref)
    assert sum(chosen.values()) > 0 and set(chosen) <= {"plain"} | {layout.label() for layout in menu(4, 0.03)}


# ------------------------------------------------------------------------------------------ vLLM's default ladder


def _report(per_forward_b1=2.6):
    """A bench report: a forward's cost grows with the positions it feeds (rows x width) past a flat start."""
    def table(rows):
        return {str(w): 10.0 + 0.02 * max(rows * w - 32, 0) for w in (1, 3, 5, 7, 9)}
    return {"settings": {"block_size": 4},
            "step_costs": {str(b): {"table_ms": table(b)} for b in (1, 4, 16, 64, 256)},
            "rows": [{"mode": "verify", "batch_size": 1, "tokens_per_forward": per_forward_b1}]}


def test_the_ladder_drafts_less_as_the_batch_makes_width_costly():
    from hf_mars.vllm.options import default_batch_ladder, parse_batch_ladder

    ladder = parse_batch_ladder(default_batch_ladder(4, _report()))
    assert ladder[0] == (1, 4)  # a wide step is free at batch 1
    blocks = [b for _, b in ladder]
    assert blocks == sorted(blocks, reverse=True) and blocks[-1] < 4
    from hf_mars.vllm.ladder import expected_chain_tokens, per_depth_from_tokens

    assert per_depth_from_tokens(expected_chain_tokens(0.7, 4), 4) == pytest.approx(0.7)
    weak = parse_batch_ladder(default_batch_ladder(4, _report(per_forward_b1=1.05)))
    assert weak[-1][1] == 0 and weak[-1][0] <= ladder[-1][0]  # weak drafts: plain steps, and sooner


def test_mars_settings_take_the_derived_ladder_only_when_none_is_given(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from hf_mars.vllm.options import mars_settings

    config = SimpleNamespace(mars={"mask_token_id": 5, "block_size": 4}, vocab_size=100, eos_token_id=1,
                             pad_token_id=0, bos_token_id=2, layer_types=["full_attention"])
    monkeypatch.delenv(cost.STEP_COSTS_ENV, raising=False)
    assert mars_settings({}, config) == {"num_speculative_tokens": 8}  # no measured costs: as before
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report()))
    monkeypatch.setenv(cost.STEP_COSTS_ENV, str(path))
    derived = mars_settings({}, config)["num_speculative_tokens_per_batch_size"]
    assert derived[0][:2] == (1, derived[1][0] - 1) and derived[0][2] == 8 and derived[-1][2] < 8
    given = mars_settings({"batch_ladder": "1:2"}, config)
    assert given["num_speculative_tokens_per_batch_size"] == [(1, 1 << 20, 4)]


# ------------------------------------------------------------------------------------------ threshold mode


def test_threshold_steps_go_plain_only_while_the_masks_do_not_pay():
    costs = _Costs(0.002, 0.0005)  # a 5-wide step costs 1.8x a 1-wide one
    policy = policy_module.ThresholdPolicy(costs)
    assert not policy.plain(1, 5, 1)  # the prior: 2 tokens for 1.8x the time
    policy.rec.tokens = 1.2  # a record of 1.2 tokens per wide step: plain pays
    assert policy.plain(1, 5, 1)
    policy.rec.tokens = 3.5  # the masks pay
    assert not policy.plain(1, 5, 1)
    cheap = policy_module.ThresholdPolicy(_Costs(0.010, 0.0))  # width is free: the masks always pay
    cheap.rec.tokens = 1.01
    assert not cheap.plain(16, 5, 1)


def _threshold_record(model, rows, tau):
    """Threshold mode's per-call record for calls at this tau (with the model's other defaults)."""
    from hf_mars.generation import MARSGenerationConfig

    opts = MARSGenerationConfig.resolve(model, model.generation_config, mars_threshold=tau)
    return policy_module.record_for(model, rows, "threshold-call", acceptance=policy_module.acceptance_key(opts))


def test_threshold_plain_steps_emit_the_ar_token(peaky, monkeypatch):
    """A plain step in threshold mode is an AR step: after the prefill (its masks' tokens at tau = 0), every token
    is the model's argmax at its prefix, one per forward, whatever tau."""
    model, tok = peaky
    monkeypatch.setattr(call_record.ThresholdCallRecord, "choose", lambda self: "masks")  # (the per-step choice)
    monkeypatch.setattr(policy_module.ThresholdPolicy, "plain", lambda self, rows, wide, narrow: True)
    for prompt in PROMPTS[:3]:
        enc = tok([prompt], return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=16, do_sample=False, mars=True, mars_threshold=0.0,
                             mars_plain_steps=True, return_dict_in_generate=True)
        seq, P = out.sequences[0], enc.input_ids.shape[1]
        decode_steps = int(out.mars_forward_passes[0]) - 1
        from_prefill = int(out.mars_emitted_tokens[0]) - decode_steps
        assert from_prefill > 1 and decode_steps > 0  # (tau = 0: the prefill took its masks' tokens)
        with torch.no_grad():
            argmax = model(seq[None]).logits[0].argmax(-1)
        start = P + from_prefill
        assert torch.equal(seq[start:start + decode_steps], argmax[start - 1:start - 1 + decode_steps])


def test_threshold_call_record_keeps_the_faster_of_drafting_and_plain_calls():
    """plain_steps per call: the warm-up runs drafting calls, then plain ones (the first call untimed), and keeps
    the faster: the longest answer per forward (a batch runs until its last row is done, which a step's own tokens
    do not show) times decode steps per second, so that calls on answers of other lengths compare."""
    record = call_record.ThresholdCallRecord()
    order = []
    for i in range(12):
        layout = record.choose()
        order.append(layout)
        longest = 30 + 20 * (i % 3)  # the calls' answers differ in length; the layouts' speeds do not
        if layout == "masks":  # 1.5 tokens per forward for the batch's longest row, at 3.5 ms a step
            record.observe_call(layout, longest, longest // 1.5, longest // 1.5 - 1, 0.0035 * (longest // 1.5 - 1))
        else:  # one token per forward, at 2 ms a step: plain wins
            record.observe_call(layout, longest, longest, longest - 1, 0.002 * (longest - 1))
    assert order[:3] == ["masks", "masks", "plain"] and record.best() == "plain" and order[-1] == "plain"
    assert record.tokens_per_forward("plain") == 1.0 and abs(record.tokens_per_forward("masks") - 1.5) < 0.1
    assert abs(record.rate("plain") - 500) < 1 and 420 < record.rate("masks") < 445  # tokens per second
    record.observe_call("plain", 0, 1, 0, 1.0)  # a call with no decode step says nothing
    assert sum(record.calls.values()) == 12


def test_a_plain_threshold_call_is_plain_greedy(make_model, monkeypatch):
    """A call the record runs plain takes one token per forward from the prefill on (no masks fed), whatever tau:
    its output is plain greedy's; its steps count as plain ones in the shares `hf-mars bench` reports, and its
    tokens and time go to the record."""
    model, tok = make_model(seed=1, initializer_range=1.0)
    enable_mars(model)
    mask_id = model.config.mars["mask_token_id"]
    enc = tok(["hello world", "a"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    greedy = model.generate(**enc, **kw).sequences
    monkeypatch.setattr(call_record.ThresholdCallRecord, "choose", lambda self: "plain")
    record = _threshold_record(model, 2, 0.0)
    shares = policy_module.choices_for(model, 2, "chunk")
    fed = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: fed.append(kwargs["input_ids"]),
                                           with_kwargs=True)
    try:
        out = model.generate(**enc, mars=True, mars_threshold=0.0, mars_plain_steps=True, **kw)
    finally:
        hook.remove()
    assert torch.equal(out.sequences, greedy)
    assert out.mars_forward_passes.tolist() == out.mars_emitted_tokens.tolist()  # one token per forward
    assert all(x.shape[1] == 1 for x in fed[1:]) and not any((x == mask_id).any() for x in fed)
    assert shares == {"plain": len(fed) - 1} and record.calls == {"plain": 1}
    out = model.generate(**enc, mars=True, mars_threshold=0.0, mars_plain_steps=False, **kw)  # no record, masks
    assert record.calls == {"plain": 1} and out.mars_emitted_tokens.sum() > out.mars_forward_passes.sum()


@pytest.mark.plain_step_policy
def test_threshold_mode_takes_plain_steps_by_default(make_model):
    """The plain-step policy is threshold mode's default: a call that does not set mars_plain_steps goes through the
    call record (drafting or plain calls, the warm-up trying both), its steps are counted for `hf-mars bench`, and
    a call the record ran plain is plain greedy's at any tau. mars_plain_steps=False keeps the masks on every step
    and leaves the record alone."""
    model, tok = make_model(seed=1, initializer_range=1.0)
    enable_mars(model)
    enc = tok(["hello world", "a"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    greedy = model.generate(**enc, **kw).sequences
    record = _threshold_record(model, 2, 0.0)
    shares = policy_module.choices_for(model, 2, "chunk")
    for _ in range(4):
        before = record.calls.get("plain", 0)
        out = model.generate(**enc, mars=True, mars_threshold=0.0, **kw)
        if record.calls.get("plain", 0) > before:
            assert torch.equal(out.sequences, greedy)
    assert sum(record.calls.values()) == 4 and set(record.calls) == {"masks", "plain"}  # the warm-up ran both
    assert sum(shares.values()) > 0
    calls = dict(record.calls)
    out = model.generate(**enc, mars=True, mars_threshold=0.0, mars_plain_steps=False, **kw)
    assert record.calls == calls and out.mars_emitted_tokens.sum() > out.mars_forward_passes.sum()
    # another tau keeps its own record (its masks are worth more or less): a sweep never runs by the first tau's
    model.generate(**enc, mars=True, mars_threshold=0.5, **kw)
    other = _threshold_record(model, 2, 0.5)
    assert other is not record and sum(other.calls.values()) == 1 and record.calls == calls


def test_threshold_plain_steps_on_a_sliding_window_batch(make_model, monkeypatch):
    """A sliding-window model's batch moves in lockstep (Gemma 3's at batch 4 took every wide step and ran 0.69x
    plain): plain steps apply there too, all rows together, and each is the rows' AR step."""
    model, tok = make_model(seed=1, initializer_range=1.0, use_sliding_window=True, sliding_window=64,
                            max_window_layers=0)
    enable_mars(model)
    enc = tok(["hello world", "a"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    greedy = model.generate(**enc, **kw).sequences
    monkeypatch.setattr(call_record.ThresholdCallRecord, "choose", lambda self: "masks")  # (the per-step choice)
    monkeypatch.setattr(policy_module.ThresholdPolicy, "plain", lambda self, rows, wide, narrow: True)
    out = model.generate(**enc, mars=True, mars_threshold=1.0, mars_plain_steps=True, **kw)
    assert torch.equal(out.sequences, greedy)  # tau = 1 stays greedy with plain steps
    out = model.generate(**enc, mars=True, mars_threshold=0.0, mars_plain_steps=True, **kw)
    decode_steps = out.mars_forward_passes - 1
    from_prefill = out.mars_emitted_tokens - decode_steps
    assert (decode_steps > 0).all() and (from_prefill > 1).all()  # tau = 0: the prefill took its masks' tokens
    P = enc.input_ids.shape[1]
    for r in range(2):
        real = enc.attention_mask[r].bool()
        seq = torch.cat([enc.input_ids[r][real], out.sequences[r, P:]])
        start, n = int(real.sum()) + int(from_prefill[r]), int(decode_steps[r])
        with torch.no_grad():
            argmax = model(seq[None]).logits[0].argmax(-1)
        assert torch.equal(seq[start:start + n], argmax[start - 1:start - 1 + n]), r


# ------------------------------------------------------------------------------------------ 'auto': tree or chain


def _calls(drafted_steps, row_steps=10, tokens_per_drafted_step=3):
    from types import SimpleNamespace

    return SimpleNamespace(row_steps=row_steps, drafted_steps=drafted_steps,
                           drafted_tokens=drafted_steps * tokens_per_drafted_step)


def test_auto_tries_every_layout_then_keeps_the_fastest_and_probes_the_others():
    record = call_record.CallRecord(untimed=0)
    warm, layouts = call_record.WARM_CALLS, call_record.CALL_LAYOUTS
    # (row-steps with drafts of 10, seconds per step): the tree has drafts after a rejection, the chain does not
    speed = {"tree": (9, 0.003), "chain": (6, 0.002), "plain": (0, 0.0012)}
    seen = []
    for _ in range(warm * len(layouts)):  # the tree first, then each until it has its warm-up calls
        layout = record.choose()
        seen.append(layout)
        record.observe(layout, _calls(speed[layout][0]), 10, 10 * speed[layout][1])
    assert seen[:3] == ["tree", "chain", "plain"] and all(seen.count(layout) == warm for layout in layouts)
    assert record.tokens_per_forward("tree") == pytest.approx(2.8) and record.tokens_per_forward("plain") == 1.0
    assert record.best() == "chain"  # 2.2 tokens per 2 ms, against the tree's 2.8 per 3 ms and plain's 1 per 1.2
    probed = []
    for _ in range(2):
        kept = []
        while record.since_probe < call_record.PROBE_CALLS:  # the chain is kept ...
            kept.append(record.choose())
            record.observe("chain", _calls(6), 10, 0.020)
        probed.append(record.choose())  # ... until another is tried again: the one tried longest ago
        record.observe(probed[-1], _calls(speed[probed[-1]][0]), 10, 10 * speed[probed[-1]][1])
        assert set(kept) == {"chain"} and record.since_probe == 0 and record.choose() == "chain"
    assert sorted(probed) == ["plain", "tree"]
    for _ in range(60):  # masks that stop paying (other text): the drafts accepted are pooled (recent calls weigh
        record.observe("chain", _calls(6, tokens_per_drafted_step=1), 10, 0.020)  # most): every layout falls
    assert record.best() == "plain"


def test_auto_warm_up_drops_a_layout_one_call_showed_far_slower():
    """Successive elimination: after one call each, a layout below CONTENTION x the best rate gets no more warm-up
    calls, so a short process spends its few calls on the contenders (plain steps at 1 token per forward against
    drafts at ~3, here)."""
    record = call_record.CallRecord(untimed=0)
    speed = {"tree": (9, 0.003), "chain": (6, 0.0022), "plain": (0, 0.0025)}
    seen = []
    while record.best() is None:
        layout = record.choose()
        seen.append(layout)
        record.observe(layout, _calls(speed[layout][0]), 10, 10 * speed[layout][1])
    assert seen[:3] == ["tree", "chain", "plain"]  # each once, in that order
    assert seen.count("plain") == 1 and seen.count("tree") == seen.count("chain") == call_record.WARM_CALLS
    assert record.best() == "chain" and len(seen) == 2 * call_record.WARM_CALLS + 1  # 2.2 tok per 2.2 ms


def test_auto_keeps_its_fastest_layout_through_a_slowed_call():
    """A layout's time per step is a low quantile of its calls': one call the machine slowed (preempted, sharing
    its cores; 3x here) does not hand the lead to another layout until the next probe, as a mean of the recent
    calls did; a slowdown that stays is followed."""
    record = call_record.CallRecord(untimed=0)
    speed = {"tree": (9, 0.0025), "chain": (6, 0.0022), "plain": (0, 0.002)}
    while record.best() is None:
        layout = record.choose()
        record.observe(layout, _calls(speed[layout][0]), 10, 10 * speed[layout][1])
    assert record.best() == "tree"  # 2.8 tokens per 2.5 ms, against the chain's 2.2 per 2.2 and plain's 1 per 2
    record.observe("tree", _calls(9), 10, 10 * 0.0025 * 3)
    assert record.best() == "tree" and record.step_seconds["tree"] < 0.0025 * 1.15
    for _ in range(60):
        record.observe("tree", _calls(9), 10, 10 * 0.0025 * 2)
    assert record.best() == "chain"


def test_auto_probes_a_far_slower_layout_less_often():
    """After the warm-up, a contender (within CONTENTION of the best rate) is tried again every PROBE_CALLS calls,
    a layout far behind (plain steps at a third of the tree's rate, here) only every FAR_PROBE_CALLS: each such
    probe costs a slow call and refreshes only that layout's step time."""
    record = call_record.CallRecord(untimed=0)
    speed = {"tree": (9, 0.0025), "chain": (6, 0.0022), "plain": (0, 0.0025)}
    while record.best() is None:
        layout = record.choose()
        record.observe(layout, _calls(speed[layout][0]), 10, 10 * speed[layout][1])
    seen = []
    for _ in range(2 * call_record.FAR_PROBE_CALLS):
        layout = record.choose()
        seen.append(layout)
        record.observe(layout, _calls(speed[layout][0]), 10, 10 * speed[layout][1])
    probes = [i for i, layout in enumerate(seen) if layout != "tree"]
    assert seen.count("plain") == 1 and seen.count("chain") >= 6  # plain: 1 per FAR_PROBE_CALLS; chain: ~1 per 33
    assert seen.index("plain") >= call_record.FAR_PROBE_CALLS - 1 and probes[0] == call_record.PROBE_CALLS


def test_a_records_first_call_is_not_timed():
    """A process's first call for a model and batch size pays one-time costs; timed, they would fall on the
    warm-up's first layout, the tree, and one such call (here 3x a warm one) would drop it from contention. Its
    draft counts are kept; the tree is timed again on the next call and, the fastest, is kept."""
    speed = {"tree": (9, 0.0025), "chain": (6, 0.0022), "plain": (0, 0.0012)}
    for untimed, kept in ((1, "tree"), (0, "chain")):  # (0: as before the rule; the cold call's time counted)
        record, seen = call_record.CallRecord(untimed=untimed), []
        while record.best() is None:
            layout = record.choose()
            cold = 3.0 if not seen else 1.0
            seen.append(layout)
            record.observe(layout, _calls(speed[layout][0]), 10, 10 * speed[layout][1] * cold)
        assert seen[:2 + untimed] == ["tree"] * (1 + untimed) + ["chain"] and record.best() == kept, untimed
        assert record.calls["tree"] == seen.count("tree")  # every call is counted, the untimed one included
    assert record.drafted_steps > 0


def test_default_verify_follows_the_record_and_stays_greedy(peaky, monkeypatch):
    """Where the record says the chain is faster, a default verify call decodes with the chain (the same forwards
    as an explicit 'chain'); the tree, with the tree; plain, one token per forward; plain greedy's output each time."""
    model, tok = peaky
    enc = tok(["hello world", "a"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
    greedy = model.generate(**enc, **kw).sequences
    forwards = {}
    for layout in call_record.CALL_LAYOUTS:
        monkeypatch.setattr(call_record.CallRecord, "choose", lambda self, layout=layout: layout)
        out = model.generate(**enc, mars_verify=True, **kw)
        assert torch.equal(out.sequences, greedy)
        forwards[layout] = out.mars_forward_passes.tolist()
    chain = model.generate(**enc, mars_verify=True, mars_draft_tree="chain", **kw)
    assert forwards["chain"] == chain.mars_forward_passes.tolist()
    tree = model.generate(**enc, mars_verify=True, mars_draft_tree="tree", **kw)  # the tree, every call
    assert forwards["tree"] == tree.mars_forward_passes.tolist() and torch.equal(tree.sequences, greedy)
    emitted = out.mars_emitted_tokens.tolist()  # (the last call: plain)
    assert forwards["plain"] == emitted  # one token per forward
    record = policy_module.record_for(model, 2, "call")
    assert record.calls == {"tree": 1, "chain": 1, "plain": 1}  # every call was timed into the record
    assert policy_module.choices_for(model, 2, "call") == {"tree": 1, "chain": 1, "plain": 1}


def test_where_a_tree_is_refused_auto_measures_the_chain_against_plain_steps(make_model):
    """A call longer than its model's sliding window (Gemma 3's past 512 positions) cannot decode a tree; 'auto'
    then weighs the chain against plain one-token steps (weak masks or a costly wide step may not pay), in its own
    record, and both stay plain greedy. Sampling keeps the chain (no record)."""
    from transformers import DynamicCache

    from hf_mars.generation.cache import has_sliding_layers

    model, tok = make_model(seed=1, initializer_range=1.0, use_sliding_window=True, sliding_window=16,
                            max_window_layers=0)
    assert has_sliding_layers(DynamicCache(config=model.config))
    enable_mars(model)
    enc = tok(["hello world", "a"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
    greedy = model.generate(**enc, **kw).sequences
    record = policy_module.record_for(model, 2, "call-chain")
    chosen = policy_module.choices_for(model, 2, "call")  # what hf-mars bench reports
    seen = []
    while record.best() is None and len(seen) < 10:
        before = dict(chosen)
        out = model.generate(**enc, mars_verify=True, **kw)
        assert torch.equal(out.sequences, greedy)
        seen += [layout for layout in chosen if chosen[layout] > before.get(layout, 0)]
        if seen[-1] == "plain":
            assert out.mars_forward_passes.tolist() == out.mars_emitted_tokens.tolist()  # one token per forward
    assert seen[:3] == ["chain", "chain", "plain"] and record.best() in ("chain", "plain")  # (the first: untimed)
    assert record.calls == chosen and sum(record.calls.values()) == len(seen)
    calls = dict(record.calls)
    model.generate(**enc, mars_verify=True, do_sample=True, max_new_tokens=8)
    assert record.calls == calls


@pytest.mark.parametrize("sliding", [False, True], ids=["tree model", "sliding-window model"])
def test_verifys_plain_layout_feeds_no_masks(make_model, monkeypatch, sliding):
    """'auto''s plain layout is plain decoding: every forward, the prefill too, feeds real tokens only (a mask fed
    there would be read by no one, and on a large LM head it doubles a step's cost), and the output is greedy's."""
    extra = dict(use_sliding_window=True, sliding_window=64, max_window_layers=0) if sliding else {}
    model, tok = make_model(seed=1, initializer_range=1.0, **extra)
    enable_mars(model)
    mask_id = model.config.mars["mask_token_id"]
    enc = tok(["hello world", "a"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    greedy = model.generate(**enc, **kw).sequences
    monkeypatch.setattr(call_record.CallRecord, "choose", lambda self: "plain")
    fed = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: fed.append(kwargs["input_ids"]),
                                           with_kwargs=True)
    try:
        out = model.generate(**enc, mars_verify=True, **kw)
    finally:
        hook.remove()
    assert torch.equal(out.sequences, greedy)
    assert all(x.shape[1] == 1 for x in fed[1:]) and not any((x == mask_id).any() for x in fed), \
        [tuple(x.shape) for x in fed]
