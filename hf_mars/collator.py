"""Moved to `hf_mars.training.collator`; `hf_mars.collator` stays importable and is that same module."""

from hf_mars._moved import alias

alias(__name__, "hf_mars.training.collator")
