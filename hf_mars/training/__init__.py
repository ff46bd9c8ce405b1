"""MARS training on TRL: the objective's input (`masking`), the mask token and its metadata (`tokens`), the
configuration (`config.MARSConfig`, an ``SFTConfig``), the collator (`collator`) and the trainer
(`trainer.MARSTrainer`, an ``SFTTrainer``).

Names load lazily, so that ``import hf_mars.training.tokens`` (what the generation side and the Hub checks need)
does not import TRL.
"""

_EXPORTS = {
    "add_mask_token": "tokens",
    "get_mars_metadata": "tokens",
    "set_mars_metadata": "tokens",
    "DEFAULT_MASK_TOKEN": "tokens",
    "MARSConfig": "config",
    "MARSDataCollator": "collator",
    "MARSTrainer": "trainer",
    "build_mars_attention_mask": "masking",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
