"""Moved to `hf_mars.bench.tasks`; `hf_mars.demo.data` stays importable and is that same module."""

from hf_mars._moved import alias

alias(__name__, "hf_mars.bench.tasks")
