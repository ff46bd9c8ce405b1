"""The package layout is a contract too: moved modules keep their old import paths (as the same module objects),
and the library does not depend on its demo."""

import ast
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
    "hf_mars.demo.bench": "hf_mars.bench",
    "hf_mars.demo.bench_format": "hf_mars.bench.table",
    "hf_mars.demo.prompts": "hf_mars.bench.prompts",
    "hf_mars.demo.timing": "hf_mars.bench.timing",
    "hf_mars.demo.report": "hf_mars.bench.report",
    "hf_mars.demo.data": "hf_mars.bench.tasks",
    "hf_mars.demo.tiny": "hf_mars.testing_utils",
    "hf_mars.demo.short_answers": "hf_mars.bench.short_answers",
}
# Imports from hf_mars/demo/ allowed outside it, as (file, module): none.
DEMO_IMPORTS_ALLOWED: set = set()


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_import_paths_are_the_moved_modules(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_old_names_import_as_before_and_stay_light():
    """`from hf_mars.trainer import ...` gives the objects `hf_mars` exports; importing the tokens module by its old
    name still does not load TRL, nor reading a benchmark report torch (a fresh interpreter: other tests have
    imported them here)."""
    code = ("import sys\n"
            "import hf_mars.bench.report\n"
            "assert 'torch' not in sys.modules\n"
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


def _imported_modules(source: str, package: str) -> set[str]:
    """Every module a module of ``package`` with this ``source`` imports, relative imports resolved,
    ``from pkg import name`` counted as ``pkg.name`` too (it may be a submodule)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_library_imports_nothing_from_the_demo():
    """Everything in hf_mars outside hf_mars/demo/ (the library, the bench, the server, the CLI's modules) works
    without the demo: the demo builds on them, never the other way round."""
    offenders = []
    for path in sorted((ROOT / "hf_mars").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("hf_mars/demo/"):
            continue
        package = ".".join(path.relative_to(ROOT).parts[:-1])
        for module in _imported_modules(path.read_text(encoding="utf-8"), package):
            if _within(module, "hf_mars.demo") and not any(
                    rel == where and _within(module, allowed) for where, allowed in DEMO_IMPORTS_ALLOWED):
                offenders.append(f"{rel} imports {module}")
    assert not offenders, offenders


def test_the_import_scan_sees_demo_imports():
    """The scan above finds each form of import (so its silence means something)."""
    forms = {"import hf_mars.demo.pipeline": "hf_mars.demo.pipeline",
             "from hf_mars.demo.stats import wilson_interval": "hf_mars.demo.stats",
             "from hf_mars import demo": "hf_mars.demo",
             "from ..demo import outputs": "hf_mars.demo.outputs",
             "def f():\n    from ..demo.real import run\n": "hf_mars.demo.real"}
    for source, module in forms.items():
        assert module in _imported_modules(source, "hf_mars.bench"), source


# Modules and functions over the size targets (none today); nothing may join them.
OVER_SIZE_ALLOWED: set = set()
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60


def test_modules_and_functions_stay_short():
    """No module in hf_mars over 500 lines, no function (decorators included) over 60: each one short enough to
    hold in one's head."""
    over = []
    for path in sorted((ROOT / "hf_mars").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        source = path.read_text(encoding="utf-8")
        if len(source.splitlines()) > MAX_MODULE_LINES and rel not in OVER_SIZE_ALLOWED:
            over.append(f"{rel}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > MAX_FUNCTION_LINES and f"{rel}::{node.name}" not in OVER_SIZE_ALLOWED:
                    over.append(f"{rel}::{node.name}: {length} lines")
    assert not over, over


MAX_CLASS_ATTRIBUTES = 20


def _assigned_attributes(source: str) -> dict:
    """Per class, the distinct attributes its own methods assign on ``self`` (``self.x = ...``, ``self.x += ...``,
    ``self.x, self.y = ...``, ``self.x: int = ...``); a nested class counts for itself."""
    found = {}

    def targets(node):
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        return []

    def flatten(target):
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                yield from flatten(t)
        else:
            yield target

    def visit(cls):
        names = found.setdefault(cls.name, set())
        todo = list(cls.body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.ClassDef):
                visit(node)
                continue
            for target in (t for tt in targets(node) for t in flatten(tt)):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    names.add(target.attr)
            todo.extend(ast.iter_child_nodes(node))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.col_offset == 0:
            visit(node)
    return found


def test_no_generation_class_holds_more_than_20_attributes():
    """No class in hf_mars/generation assigns more than 20 distinct attributes: a class with more holds several
    ideas, and each belongs in a small object of its own (the decoder's limits, prompt, model calls, history,
    outputs)."""
    over = []
    for path in sorted((ROOT / "hf_mars" / "generation").rglob("*.py")):
        for cls, names in _assigned_attributes(path.read_text(encoding="utf-8")).items():
            if len(names) > MAX_CLASS_ATTRIBUTES:
                over.append(f"{path.relative_to(ROOT).as_posix()}::{cls}: {len(names)} attributes {sorted(names)}")
    assert not over, over


def test_the_attribute_scan_counts_every_form_of_assignment():
    """The scan above sees each way of assigning an attribute, once per name (so its silence means something)."""
    source = ("class A:\n"
              "    def __init__(self):\n"
              "        self.a = 1\n"
              "        self.b, (self.c, self.d) = 2, (3, 4)\n"
              "        self.e: int = 5\n"
              "        if True:\n"
              "            self.a += 1\n"
              "            self.f = self.g = 6\n"
              "        other.h = 7\n"
              "        self.i[0] = 8\n"
              "    class B:\n"
              "        def m(self):\n"
              "            self.x = 1\n")
    assert _assigned_attributes(source) == {"A": {"a", "b", "c", "d", "e", "f", "g"}, "B": {"x"}}
