"""The declared transformers floor: one number everywhere, and a release that checks trust before fetching code.

A MARS checkpoint ships ``custom_generate/generate.py``. transformers 5.15.1-5.16.1 fetched that file (and ran
its import checks) *before* checking ``trust_remote_code``; 5.17.0 checks first. CI runs this file against the
current release and against the declared floor itself (`.ci/run`'s floors job), so a floor that fetches untrusted
code fails here.
"""

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.version import Version

from hf_mars import custom_generate, hub

ROOT = Path(__file__).resolve().parents[1]


def _declared_floor() -> str:
    return re.search(r'"transformers>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


def test_one_floor_everywhere():
    floor = _declared_floor()
    assert Version(floor) >= Version("5.17.0"), "releases before 5.17.0 fetch custom_generate code before trust"
    assert custom_generate._FALLBACK_FLOORS["transformers"] == f"transformers>={floor}"
    assert f"transformers>={floor}" in custom_generate.requirement_floors()  # what saved checkpoints pin
    assert f"transformers ≥ {floor}" in (ROOT / "README.md").read_text()
    assert Version(importlib.metadata.version("transformers")) >= Version(floor)


def test_custom_generate_refused_before_any_fetch(tmp_path, monkeypatch):
    """`generate(custom_generate=folder)` without trust must raise before transformers reads the folder's code."""
    import transformers.generation.utils as gen_utils

    from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2

    folder = tmp_path / "ckpt"
    hub.write_custom_generate(folder)
    fetched = []
    for name in ("get_cached_module_file", "check_python_requirements", "get_class_in_module"):
        if hasattr(gen_utils, name):
            real = getattr(gen_utils, name)
            monkeypatch.setattr(gen_utils, name, lambda *a, _n=name, _r=real, **k: fetched.append(_n) or _r(*a, **k))
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok)
    inputs = tok(["ab"], return_tensors="pt")
    with pytest.raises(ValueError, match="trust_remote_code"):
        model.generate(**inputs, custom_generate=str(folder), trust_remote_code=False, max_new_tokens=2)
    assert fetched == [], f"transformers {importlib.metadata.version('transformers')} read {fetched} before trust"
