"""A checkpoint's ``custom_generate/``: MARS decoding shipped inside the model folder.

transformers loads ``custom_generate/generate.py`` from a checkpoint when it is asked with ``trust_remote_code=True``
and copies the siblings that module imports beside it. So the folder holds the modules of `hf_mars.generation` that
``generate.py`` needs, byte for byte, and a ``requirements.txt`` with hf-mars' own floors; every shipped module may
import only torch, transformers, the standard library and its siblings, because it runs where hf-mars is not
installed (`check_standalone`, applied when the folder is written and again before a push).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

__all__ = ["CUSTOM_GENERATE_DIR", "check_standalone", "generation_package_files", "requirement_floors",
           "write_custom_generate"]

CUSTOM_GENERATE_DIR = "custom_generate"
GENERATION_MODULE = "hf_mars.generation"
# Floors for custom_generate/requirements.txt when hf-mars' own metadata is not available.
_FALLBACK_FLOORS = {"transformers": "transformers>=5.17.0", "torch": "torch>=2.4"}


def generation_package_files() -> list[Path]:
    """The modules of hf_mars/generation/ a checkpoint ships (found through the import system, not imported):
    ``generate.py``, the entry transformers loads, and the siblings it imports, directly or not (transformers
    copies a module's relative imports next to it; the package's ``__init__`` is not needed)."""
    import importlib.util

    spec = importlib.util.find_spec(GENERATION_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Cannot find the source of {GENERATION_MODULE} (needed for custom_generate/); "
            "reinstall hf-mars from source (`pip install -e .`)."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    needed, todo = set(), ["generate"]
    while todo:
        name = todo.pop()
        if name in needed or not (folder / f"{name}.py").is_file():
            continue
        needed.add(name)
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(node.module)
    return sorted(folder / f"{name}.py" for name in needed)


def check_standalone(source: str, origin, siblings: set) -> None:
    """A shipped module may import only torch, transformers, the stdlib and its siblings, the latter as
    ``from .module import ...`` (the form transformers follows when it copies a custom_generate file's imports)."""
    allowed = {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names)
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level != 1 or node.module not in siblings:
                bad.append("relative import from " + "." * node.level + (node.module or ""))
        elif isinstance(node, ast.ImportFrom):
            if node.module.split(".")[0] not in allowed:
                bad.append(node.module)
        elif isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[0] not in allowed]
    if bad:
        raise RuntimeError(
            f"{origin} imports {sorted(set(bad))}; custom_generate/ may import only torch, transformers, the "
            "standard library and its own modules (`from .module import name`), because it runs where hf-mars is "
            "not installed."
        )


def requirement_floors() -> list[str]:
    """transformers and torch floors, taken from hf-mars' own requirements so they stay in sync."""
    import importlib.metadata
    import re

    floors = dict(_FALLBACK_FLOORS)
    try:
        reqs = importlib.metadata.requires("hf-mars") or []
    except importlib.metadata.PackageNotFoundError:
        reqs = []
    for req in reqs:
        if ";" in req:  # extras / markers
            continue
        m = re.match(r"^\s*(torch|transformers)\s*(>=\s*[\w.]+)", req)
        if m:
            floors[m.group(1)] = m.group(1) + m.group(2).replace(" ", "")
    return [floors["transformers"], floors["torch"]]


def write_custom_generate(save_directory) -> Path:
    """Copy the modules of hf_mars/generation/ into ``custom_generate/`` (byte for byte) with the requirements;
    returns the path of its ``generate.py``."""
    files = generation_package_files()
    siblings = {p.stem for p in files}
    if "generate" not in siblings:
        raise RuntimeError(f"{GENERATION_MODULE} has no generate.py entry point for custom_generate/.")
    out = Path(save_directory) / CUSTOM_GENERATE_DIR
    out.mkdir(parents=True, exist_ok=True)
    for src in files:
        data = src.read_bytes()
        check_standalone(data.decode("utf-8"), src, siblings)
        (out / src.name).write_bytes(data)
    (out / "requirements.txt").write_text("\n".join(requirement_floors()) + "\n", encoding="utf-8")
    return out / "generate.py"
