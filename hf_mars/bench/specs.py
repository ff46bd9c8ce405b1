"""What `hf-mars bench` times: one `RunSpec` per decoding configuration, plain `generate` and its peers first.

A spec is the arguments one timed ``generate`` call gets; `build_specs` checks the settings a user passes (cache
modes, thresholds, peers) once, before any model runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_mars.generation import ACCEPTANCE_MODES, CACHE_MODES

__all__ = ["DEFAULT_ACCEPTANCE", "PEERS", "PLAIN_MODES", "PROMPT_LOOKUP_TOKENS", "RunSpec", "build_specs"]


@dataclass
class RunSpec:
    """One decoding configuration of the benchmark."""

    mode: str  # "ar" | "ar_static_compile" | "prompt_lookup" (plain generate and its peers) | "mars" | "verify"
    threshold: float | None = None
    cache: str | None = None
    kwargs: dict = field(default_factory=dict)
    tree: str | None = None  # verify mode's mars_draft_tree
    acceptance: str | None = None  # threshold mode's mars_acceptance when not the default rule
    # threshold mode's measured-cost plain-step policy applies (mars_plain_steps, generate's default on the sliding
    # cache); False on a sliding-cache threshold row: the masks on every step (mars_plain_steps=False)
    plain_steps: bool = False

    @property
    def label(self) -> str:
        if self.mode in PLAIN_MODES:
            return self.mode
        tree = f",tree={self.tree}" if self.tree else ""
        rule = f",rule={self.acceptance}" if self.acceptance else ""
        plain = ",plain_steps=off" if self.kwargs.get("mars_plain_steps") is False else ""
        return f"{self.mode}(tau={self.threshold:g},cache={self.cache}{rule}{plain}{tree})"


PEERS = ("prompt_lookup", "static_compile")  # what a user would run instead of MARS
PLAIN_MODES = ("ar", "ar_static_compile", "prompt_lookup")
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens
DEFAULT_ACCEPTANCE = "probability"  # what generate applies without mars_acceptance (MARSGenerationConfig)


def build_specs(thresholds, caches, verify_thresholds, block_size, cache_block, verify_cache="sliding", peers=(),
                draft_trees=("auto",), acceptances=(DEFAULT_ACCEPTANCE,), plain_steps=False):
    """Plain `generate`, the peers asked for, then every MARS configuration: threshold mode once per cache, tau and
    acceptance rule (``plain_steps``: each tau < 1 on the sliding cache again with mars_plain_steps=False, the masks
    on every step, beside generate's default plain-step policy); verify once per draft tree."""
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"Unknown peer(s) {unknown}: use any of {PEERS}.")
    unknown = sorted(set(acceptances) - set(ACCEPTANCE_MODES))
    if unknown or not acceptances:
        raise ValueError(f"Unknown or no acceptance rule(s) {unknown}: use any of {ACCEPTANCE_MODES}.")
    specs = [RunSpec("ar")]
    if "static_compile" in peers:  # transformers' documented fast path: static cache + torch.compile
        from transformers import CompileConfig

        from hf_mars._compat import compile_on_any_device

        specs.append(RunSpec("ar_static_compile", kwargs={
            "cache_implementation": "static", "compile_config": compile_on_any_device(CompileConfig())}))
    if "prompt_lookup" in peers:  # lossless, no training, built in (batch 1 only in transformers)
        specs.append(RunSpec("prompt_lookup", kwargs={"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}))
    for cache in caches:
        if cache not in CACHE_MODES:
            raise ValueError(f"Unknown cache mode {cache!r}: use one of {CACHE_MODES}.")
        for tau in thresholds:
            kw = {"mars": True, "mars_threshold": float(tau), "mars_cache": cache}
            if block_size is not None:
                kw["mars_block_size"] = int(block_size)
            if cache != "sliding":
                kw["mars_cache_block"] = int(cache_block)
            for rule in acceptances:  # the default rule runs with generate's own default (no extra argument)
                other = rule != DEFAULT_ACCEPTANCE
                specs.append(RunSpec("mars", float(tau), cache, {**kw, **({"mars_acceptance": rule} if other else {})},
                                     acceptance=rule if other else None,
                                     plain_steps=cache == "sliding" and float(tau) < 1.0))
                if plain_steps and cache == "sliding" and float(tau) < 1.0:  # (the policy's only home)
                    specs.append(RunSpec("mars", float(tau), cache, {**specs[-1].kwargs, "mars_plain_steps": False},
                                         acceptance=specs[-1].acceptance, plain_steps=False))
    for tau in verify_thresholds or ():
        kw = {"mars": True, "mars_threshold": float(tau), "mars_verify": True, "mars_cache": verify_cache}
        if block_size is not None:
            kw["mars_block_size"] = int(block_size)
        for tree in draft_trees or ("auto",):
            specs.append(RunSpec("verify", float(tau), verify_cache, {**kw, "mars_draft_tree": tree}, tree))
        if "static_compile" in peers:  # MARS on the same fast path as the compiled plain peer (the chain: a static
            # cache cannot hold a tree's gathered path)
            specs.append(RunSpec("verify", float(tau), "static+compile", {**kw, **specs[1].kwargs}))
    for spec in specs:
        if spec.mode in PLAIN_MODES:
            continue
        if not 0.0 <= spec.threshold <= 1.0:
            raise ValueError(f"Thresholds must lie in [0, 1], got {spec.threshold}.")
    return specs
