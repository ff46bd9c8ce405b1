"""Render docs/architectures.md's architecture table from a fresh run of tests/test_architectures.py.

    python tests/compat_table.py            # runs the tests (about a minute on 2 cores), prints the table

A cell is ✓ when every test of that column passed for the architecture (skips, e.g. no sdpa path in
transformers, are listed in the notes), ✗ when any failed.
"""

import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from architectures import ARCHITECTURES  # noqa: E402

COLUMNS = {  # column -> test functions that decide it
    "training": ("test_training_consistency", "test_training_steps_lower_the_loss_and_checkpoint_loads",
                 "test_moe_aux_loss_is_the_models_own_on_the_clean_stream"),
    "decoding": ("test_decoding_equivalences", "test_half_precision_tau1_is_greedy",
                 "test_sliding_window_prompt_longer_than_window"),
    "Hub custom_generate": ("test_hub_custom_generate_decodes_identically",),
}


class Collector:
    def __init__(self):
        self.outcomes = defaultdict(list)  # (arch, column) -> outcomes
        self.skips = defaultdict(set)

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.when == "setup" and report.skipped):
            return
        m = re.match(r".*::(\w+)\[(.*)\]$", report.nodeid)
        name, params = (m.group(1), m.group(2)) if m else (report.nodeid.split("::")[-1], "")
        archs = [a for a in ARCHITECTURES if re.search(rf"(^|-){re.escape(a)}($|-)", params)]
        if name == "test_sliding_window_prompt_longer_than_window":
            archs = ["mistral"]
        for column, tests in COLUMNS.items():
            if name in tests:
                for arch in archs:
                    self.outcomes[arch, column].append(report.outcome)
                    if report.skipped:
                        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                        self.skips[arch].add(reason.replace("Skipped: ", ""))


def main() -> int:
    collector = Collector()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", str(HERE / "test_architectures.py")], plugins=[collector])
    print()
    print("| architecture | config class | training | decoding | Hub `custom_generate` | notes |")
    print("|---|---|---|---|---|---|")
    for arch, (config_class, _, note) in ARCHITECTURES.items():
        cells = []
        for column in COLUMNS:
            got = collector.outcomes.get((arch, column), [])
            cells.append("✗" if "failed" in got else ("✓" if "passed" in got else "–"))
        notes = "; ".join([note] * bool(note) + sorted(collector.skips[arch]))
        print(f"| {arch} | `{config_class}` | " + " | ".join(cells) + f" | {notes} |")
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
