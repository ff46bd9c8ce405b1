"""Old import paths of modules that moved (each alias module makes its old name the moved module itself), and
packages whose names load lazily.

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


def lazy_exports(package: str, exports: dict[str, str]):
    """``(__getattr__, __dir__)`` for a package whose names load on first use: ``exports`` maps each name to the
    submodule defining it, so importing the package (or one light submodule) imports none of the heavy ones."""

    def __getattr__(name):
        if name in exports:
            value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(exports)

    return __getattr__, __dir__
