"""The public names are a contract with users: each resolves from `hf_mars` itself."""

import subprocess
import sys
from pathlib import Path

import pytest

import hf_mars

ROOT = Path(__file__).resolve().parents[1]


def test_public_names_resolve():
    for name in hf_mars.__all__:
        assert getattr(hf_mars, name) is not None, name
    for name in ("MARSConfig", "MARSTrainer", "add_mask_token", "mars_generate", "enable_mars", "save_for_hub",
                 "push_to_hub"):
        assert name in hf_mars.__all__


def test_cli_has_the_documented_commands():
    from hf_mars.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"demo", "bench", "push", "serve"}


def test_submodules_are_reachable_after_a_plain_import_which_stays_light():
    """The README calls `hf_mars.hub.write_mars_extras` and `hf_mars.generation.reference_decode` after a plain
    `import hf_mars`; that import alone must not load torch or transformers. A fresh interpreter: in this one
    other tests have imported the submodules already."""
    code = ("import sys, hf_mars\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'trl', 'datasets') if m in sys.modules)\n"
            "assert not heavy, heavy\n"
            "assert callable(hf_mars.hub.write_mars_extras) and callable(hf_mars.generation.reference_decode)\n"
            "assert hf_mars.hub is sys.modules['hf_mars.hub']\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with pytest.raises(AttributeError, match="no_such_module"):
        hf_mars.no_such_module  # noqa: B018
