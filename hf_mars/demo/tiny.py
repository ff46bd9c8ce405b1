"""Moved to `hf_mars.testing_utils`; `hf_mars.demo.tiny` stays importable and is that same module."""

from hf_mars._moved import alias

alias(__name__, "hf_mars.testing_utils")
