"""Moved to `hf_mars.bench.table`; `hf_mars.demo.bench_format` stays importable and is that same module."""

from hf_mars._moved import alias

alias(__name__, "hf_mars.bench.table")
