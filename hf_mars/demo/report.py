"""Moved to `hf_mars.bench.report`; `hf_mars.demo.report` stays importable and is that same module."""

from hf_mars._moved import alias

alias(__name__, "hf_mars.bench.report")
