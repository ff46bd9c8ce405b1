"""Moved to `hf_mars.bench.short_answers`; `hf_mars.demo.short_answers` stays importable and is that same module."""

from hf_mars._moved import alias

alias(__name__, "hf_mars.bench.short_answers")
