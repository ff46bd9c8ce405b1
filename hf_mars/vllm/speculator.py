"""MARS as a registered speculative method of vLLM >= 0.34 (the V2 model runner, the only one there).

NOT YET RUN in an engine: no CPU build of vLLM 0.34 exists, so no engine has decoded with it
(``benchmarks/gpu_check.sh`` is its first engine run). Everything up to the engine is tested against vLLM 0.34.0's
own package on CPU (tests/test_vllm_registered.py, CI's vLLM 0.34 job): vLLM's plugin loader registers "mars",
``{"method": "mars"}`` goes through vLLM's EngineArgs into its SpeculativeConfig by this config, vLLM's
``init_speculator`` builds ``MarsSpeculator`` on its ``DraftModelSpeculator``, and ``propose`` runs on vLLM's
``InputBatch``. Without vLLM (tests/test_vllm_speculator.py, fakes for vLLM's base classes): the draft bookkeeping
shared with the 0.32 path (``drafts.py``) and the registration branch of ``_patches.install``.

vLLM 0.34 lets a plugin add a method: ``register_speculative_method("mars", MarsSpeculatorConfig)``, after which
``{"method": "mars"}`` is accepted and ``speculator_options`` reaches ``MarsSpeculatorConfig.configure``. vLLM
then builds ``speculator_class`` in each GPU worker (``speculator_gpu.py``). This module is the half every vLLM
process imports (the API server, the engine, the workers), so it must not import the speculator: vLLM's own rule
for config modules, which run in every process.

``_patches.install`` calls ``install`` once ``check_contracts_v2`` finds nothing moved; otherwise it steps aside
as on 0.32 (one warning, only "mars" refused).
"""

from __future__ import annotations

from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig, register_speculative_method

from .options import METHOD, OPTIONS_KEY, check_tokenizer, mars_settings, user_options
from .trusted_drafts import register as register_trusted_drafts

SPECULATOR = "hf_mars.vllm.speculator_gpu.MarsSpeculator"
SET = ("num_speculative_tokens", "num_speculative_tokens_per_batch_size")  # MARS sets these, as on 0.32
# SpeculativeConfig fields MARS relies on staying at vLLM's default: one draft per position with no draft
# distribution (point proposals), standard (exact) rejection sampling, every scheduled draft verified.
KEEP = {"model": None, "draft_sample_method": "greedy", "rejection_sample_method": "standard",
        "enable_adaptive_verification": False}


class MarsSpeculatorConfig(SpeculatorConfig):
    """``{"method": "mars"[, "speculator_options": {"block_size": b, "batch_ladder": "1:4,16:2,48:0",
    "tau_ladder": "0:1,8:0.95"}]}`` (``options.speculative_config`` says what each does).

    No draft checkpoint: the target's config stands in for the draft's (``SpeculatorConfig.configure``), and
    ``num_speculative_tokens`` is 2B from ``config.mars`` (``options.mars_settings``), like the 0.32 path."""

    speculator_class = SPECULATOR
    supported_options = frozenset({OPTIONS_KEY})

    @classmethod
    def configure(cls, spec) -> None:
        super().configure(spec)
        target = spec.target_model_config
        if target is None:
            raise ValueError("speculative method 'mars' needs the target model's config (vLLM builds it from "
                             "--model); none was given to SpeculativeConfig.")
        options = user_options({"method": METHOD, OPTIONS_KEY: spec.speculator_options or {}})
        settings = mars_settings(options, target.hf_config)
        clashes = [f"{name}={getattr(spec, name)!r}" for name in SET if getattr(spec, name) is not None]
        clashes += [f"{name}={getattr(spec, name)!r}" for name, value in KEEP.items() if getattr(spec, name) != value]
        if getattr(spec.target_parallel_config, "enable_batch_sharded_sampling", False):
            clashes.append("enable_batch_sharded_sampling (its sharded logits bypass the -inf on the mask token)")
        if clashes:
            raise ValueError(f"speculative method 'mars' cannot be combined with {clashes}: the target drafts for "
                             f"itself, 2B tokens a step (B from config.mars, or {OPTIONS_KEY} block_size / "
                             "batch_ladder), verified exactly.")
        for name, value in settings.items():
            setattr(spec, name, value)
        check_tokenizer(target)
        register_trusted_drafts(target)  # threshold mode: mars_threshold, tau_ladder (trusted_drafts.py)


def install() -> None:
    """Register "mars" with vLLM (once per process: ``_patches.install`` guards it)."""
    register_speculative_method(METHOD, MarsSpeculatorConfig)
