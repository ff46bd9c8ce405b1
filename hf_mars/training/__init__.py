"""MARS training on TRL: the objective's input (`masking`), the mask token and its metadata (`tokens`), the
configuration (`config.MARSConfig`, an ``SFTConfig``), the collator (`collator`) and the trainer
(`trainer.MARSTrainer`, an ``SFTTrainer``).

Names load lazily, so that ``import hf_mars.training.tokens`` (what the generation side and the Hub checks need)
does not import TRL.
"""

from hf_mars._moved import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
