"""Moved to `hf_mars.training.config`; `hf_mars.config` stays importable and is that same module."""

from hf_mars._moved import alias

alias(__name__, "hf_mars.training.config")
