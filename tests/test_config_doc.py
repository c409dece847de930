"""docs/configuration.md's table of settings is what scripts/gen-config makes from the options
table: one row per option, with its default and help, and nothing else between the markers."""
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shim.app.config import OPTIONS, Option
from shim.app.config_doc import BEGIN_TABLE, END_TABLE, configuration_doc, default_text

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


def test_configuration_doc_is_current():
    text = DOC.read_text(encoding="utf-8")
    assert configuration_doc(text) == text, "docs/configuration.md is stale: run scripts/gen-config"


def test_gen_config_writes_the_doc(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-config"), str(tmp_path / "settings.py"),
                    str(tmp_path / "configuration.md")], check=True)
    assert (tmp_path / "configuration.md").read_text(encoding="utf-8") == DOC.read_text(encoding="utf-8")


def _rows(text: str) -> list[str]:
    table = text.split(BEGIN_TABLE, 1)[1].split(END_TABLE, 1)[0]
    return [line for line in table.splitlines() if line.startswith("| `") and not line.startswith("| flag")]


def test_one_row_per_option_in_table_order():
    names = [re.match(r"\| `(?:--)?([\w-]+)`", row).group(1) for row in _rows(DOC.read_text(encoding="utf-8"))]
    assert names == [o.name for o in OPTIONS]


def test_a_config_file_key_is_not_shown_as_a_flag():
    rows = {re.match(r"\| `(?:--)?([\w-]+)`", r).group(1): r for r in _rows(DOC.read_text(encoding="utf-8"))}
    for o in OPTIONS:
        if o.where == "file":
            assert rows[o.name].startswith(f"| `{o.name}` (config file only) |") and f"--{o.name}`" not in rows[o.name]
        else:
            assert rows[o.name].startswith(f"| `--{o.name}` / `{o.name}` |")
    assert rows["max-connections"].startswith("| `max-connections` (config file only) |")


def test_a_changed_table_changes_the_doc():
    text = DOC.read_text(encoding="utf-8")
    changed = tuple(dataclasses.replace(o, default=7.0, help="seven | seconds") if o.name == "guard-window" else o
                    for o in OPTIONS)
    changed += (Option("new-one", "int | None", 64 * 1024 * 1024, int, "a new setting", "Q"),)
    new = configuration_doc(text, changed)
    rows = {re.match(r"\| `(?:--)?([\w-]+)`", r).group(1): r for r in _rows(new)}
    assert rows["guard-window"] == "| `guard-window` (config file only) | `float` | `7` | seven \\| seconds |"
    assert rows["new-one"] == "| `--new-one` / `new-one` | `int \\| None` | `64Mi` | a new setting |"
    # the prose around the table is kept
    assert new.split(BEGIN_TABLE)[0] == text.split(BEGIN_TABLE)[0]
    assert new.split(END_TABLE)[1] == text.split(END_TABLE)[1]
    with pytest.raises(ValueError):
        configuration_doc(text.replace(END_TABLE, ""))


def test_defaults_as_the_config_file_spells_them():
    by_name = {o.name: o for o in OPTIONS}
    assert default_text(by_name["policy"]) == "`Hard`"
    assert default_text(by_name["reconcile"]) == "`true`"
    assert default_text(by_name["record-max-bytes"]) == "`64Mi`"
    assert default_text(by_name["max-connections"]) == "`128`"
    assert default_text(by_name["resync-interval"]) == "`30`"
    assert default_text(by_name["record"]) == "none"
