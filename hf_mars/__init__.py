"""hf-mars: MARS (Mask AutoRegression) for transformers and TRL.

Public names are imported lazily so that `import hf_mars` stays cheap (TRL and
datasets are only loaded when the trainer is used); so are the submodules, so that
`import hf_mars` then `hf_mars.hub.write_mars_extras(...)` works as the README writes it.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "add_mask_token": "hf_mars.training.tokens",
    "get_mars_metadata": "hf_mars.training.tokens",
    "set_mars_metadata": "hf_mars.training.tokens",
    "DEFAULT_MASK_TOKEN": "hf_mars.training.tokens",
    "MARSConfig": "hf_mars.training.config",
    "MARSTrainer": "hf_mars.training.trainer",
    "MARSDataCollator": "hf_mars.training.collator",
    "build_mars_attention_mask": "hf_mars.training.masking",
    "mars_generate": "hf_mars.generation",
    "enable_mars": "hf_mars.generation",
    "MARSGenerateOutput": "hf_mars.generation",
    "MARSGenerationConfig": "hf_mars.generation",
    "save_for_hub": "hf_mars.hub",
    "push_to_hub": "hf_mars.hub",
    "write_mars_extras": "hf_mars.hub",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

_SUBMODULES = frozenset({"bench", "cli", "collator", "config", "custom_generate", "demo", "generation", "hub",
                         "masking", "model_card", "serve", "testing_utils", "tokens", "trainer", "training", "vllm"})


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"hf_mars.{name}")  # the import binds it here too
    raise AttributeError(f"module 'hf_mars' has no attribute {name!r}")


def __dir__():
    return __all__
