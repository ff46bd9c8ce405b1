"""The package layout is a contract too: moved modules keep their old import paths (as the same module objects),
and the library does not depend on its demo."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MOVED = {  # old path -> where the module lives now
    "hf_mars.trainer": "hf_mars.training.trainer",
    "hf_mars.config": "hf_mars.training.config",
    "hf_mars.collator": "hf_mars.training.collator",
    "hf_mars.masking": "hf_mars.training.masking",
    "hf_mars.tokens": "hf_mars.training.tokens",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_import_paths_are_the_moved_modules(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_old_names_import_as_before_and_stay_light():
    """`from hf_mars.trainer import ...` gives the objects `hf_mars` exports; importing the tokens module by its old
    name still does not load TRL (a fresh interpreter: other tests have imported it here)."""
    code = ("import sys\n"
            "import hf_mars.tokens, hf_mars.masking\n"
            "assert 'trl' not in sys.modules\n"
            "import hf_mars\n"
            "from hf_mars.trainer import MARSConfig, MARSDataCollator, MARSTrainer, checkpointing_argument\n"
            "from hf_mars.tokens import add_mask_token\n"
            "assert MARSConfig is hf_mars.MARSConfig and MARSTrainer is hf_mars.MARSTrainer\n"
            "assert MARSDataCollator is hf_mars.MARSDataCollator and add_mask_token is hf_mars.add_mask_token\n"
            "assert hf_mars.trainer is hf_mars.training.trainer\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
