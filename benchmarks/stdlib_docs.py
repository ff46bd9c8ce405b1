"""Write a small real-text dataset in TRL's ``text`` format: the module docstrings of this Python's standard
library (prose nobody here wrote, on as many topics as there are modules), for trying ``hf-mars demo --dataset``
on a real base model offline.

    python benchmarks/stdlib_docs.py runs/stdlib_docs.jsonl
    hf-mars demo --base gemma3-270m --quick --dataset runs/stdlib_docs.jsonl --output-dir runs/gemma3-dataset-quick

Rows: every importable public stdlib module whose docstring has at least ``--min-words`` words, whitespace
collapsed, cut to ``--max-chars`` characters, in module-name order (so the demo's held-out rows, the last ones,
are the last modules alphabetically). The rows depend on the Python version; it is printed.
"""

import argparse
import importlib
import json
import sys
import warnings

# modules whose import does something (opens a browser, prints, needs a display) or that are not prose
SKIPPED = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}


def stdlib_docs(min_words: int = 40, max_chars: int = 2000) -> list[str]:
    texts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules warn on import
        for name in sorted(sys.stdlib_module_names):
            if name.startswith("_") or name in SKIPPED:
                continue
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - not built on this platform
                continue
            text = " ".join((module.__doc__ or "").split())
            if len(text.split()) >= min_words:
                texts.append(text[:max_chars])
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the .jsonl file to write")
    parser.add_argument("--min-words", type=int, default=40)
    parser.add_argument("--max-chars", type=int, default=2000)
    args = parser.parse_args()
    texts = stdlib_docs(args.min_words, args.max_chars)
    with open(args.output, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    print(f"wrote {len(texts)} rows to {args.output} (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
