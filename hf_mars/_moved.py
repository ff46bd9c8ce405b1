"""Old import paths of modules that moved: each alias module makes its old name the moved module itself.

``import hf_mars.trainer`` and ``from hf_mars.trainer import X`` keep working after the training modules moved to
`hf_mars.training`, and give the same objects (not copies): a class checked with ``isinstance``, a constant patched
in a test, or a private helper reached by an old script is the one the package uses.
"""

from __future__ import annotations

import importlib
import sys


def alias(old: str, new: str) -> None:
    """Make module ``old`` (being imported) the module ``new``: both names resolve to one module object."""
    sys.modules[old] = importlib.import_module(new)
