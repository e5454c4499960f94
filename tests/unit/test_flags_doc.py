"""docs/flags.md is generated from the configs and must be current."""

from pathlib import Path

from openppo.cli.flags_doc import clis
from openppo.config.docs import render

REPO = Path(__file__).resolve().parents[2]


def test_flags_doc_is_current():
    committed = (REPO / "docs" / "flags.md").read_text()
    assert committed == render(clis()), "run: python -m openppo.cli.flags_doc > docs/flags.md"
