"""The rendered cards in model_cards/: each parses as a Hub model card with MARS's metadata, and its measured table
is exactly the one its run's report gives (so a card never drifts from the figures it claims)."""

import re
from pathlib import Path

import pytest

from hf_mars.bench.report import BenchmarkReport
from hf_mars.model_card import CARD_TAGS

ROOT = Path(__file__).resolve().parents[1]
CARDS = {  # card -> the report it was rendered from (model_cards/README.md says by which command)
    "demo-mars.md": ROOT / "docs" / "demo_report.json",
    "gemma3-270m-mars.md": ROOT / "model_cards" / "gemma3-270m_report.json",
}


def _table_lines(text: str) -> list:
    start = text.index("| decoding | τ | accuracy | tokens per forward | speedup vs AR |")
    lines = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        lines.append(line)
    return lines


@pytest.mark.parametrize("card", sorted(CARDS))
def test_card_parses_and_its_table_is_its_reports(card):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    text = (ROOT / "model_cards" / card).read_text(encoding="utf-8")
    parsed = huggingface_hub.ModelCard(text, ignore_metadata_errors=False)
    assert parsed.data.library_name == "transformers" and set(CARD_TAGS) <= set(parsed.data.tags)
    rows = BenchmarkReport.load(CARDS[card]).card_table()["rows"]
    expected = [f"| {r['name']} | {r['threshold']} | {r['accuracy']} | {r['tokens_per_forward']} | {r['speedup']} |"
                for r in rows]
    assert _table_lines(text) == expected, f"model_cards/{card} is stale: regenerate it (model_cards/README.md)"


def test_every_card_is_listed():
    listed = set(re.findall(r"\[`([\w.-]+\.md)`\]", (ROOT / "model_cards" / "README.md").read_text()))
    on_disk = {p.name for p in (ROOT / "model_cards").glob("*.md") if p.name != "README.md"}
    assert listed == on_disk == set(CARDS)
