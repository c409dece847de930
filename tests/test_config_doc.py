"""docs/configuration.md's table of settings is what scripts/gen-config makes from the options
table: one row per option, with its flag or "file only", its default and help, and nothing else
between the markers; no page calls a file-only setting a flag."""
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shim.app.config import FILE, FLAG, OPTIONS, Option
from shim.app.config_doc import BEGIN_TABLE, END_TABLE, FILE_ONLY, configuration_doc, default_text

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
    return [line for line in table.splitlines() if re.match(r"\| `[\w-]+` \|", line)]


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


def test_one_row_per_option_in_table_order():
    names = [_cells(row)[0].strip("`") for row in _rows(DOC.read_text(encoding="utf-8"))]
    assert names == [o.name for o in OPTIONS]


def test_the_flag_column_says_which_settings_are_flags():
    by_name = {o.name: o for o in OPTIONS}
    rows = _rows(DOC.read_text(encoding="utf-8"))
    assert rows and all(len(_cells(r)) == 5 for r in rows)
    for row in rows:
        key, flag = _cells(row)[:2]
        o = by_name[key.strip("`")]
        assert flag == (f"`--{o.name}`" if o.where == FLAG else FILE_ONLY), row
    assert {_cells(r)[1] for r in rows} >= {FILE_ONLY, "`--listen`"}


def test_no_page_calls_a_file_only_setting_a_flag():
    """README.md and docs/*.md: a `--NAME` whose NAME is a setting names one that is a flag."""
    file_only = {o.name for o in OPTIONS if o.where == FILE}
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            found += [f"{page.relative_to(ROOT)}:{n}: --{m}" for m in re.findall(r"(?<![\w-])--([a-z0-9][\w-]*)", line)
                      if m in file_only]
    assert found == []


def test_a_changed_table_changes_the_doc():
    text = DOC.read_text(encoding="utf-8")
    changed = tuple(dataclasses.replace(o, default=7.0, help="seven | seconds") if o.name == "guard-window" else o
                    for o in OPTIONS)
    changed += (Option("new-one", "int | None", 64 * 1024 * 1024, int, "a new setting", "Q"),
                Option("new-two", "float", 1.5, float, "a new tuning key", "S", where=FILE))
    new = configuration_doc(text, changed)
    rows = {_cells(r)[0].strip("`"): r for r in _rows(new)}
    assert rows["guard-window"] == "| `guard-window` | file only | `float` | `7` | seven \\| seconds |"
    assert rows["new-one"] == "| `new-one` | `--new-one` | `int \\| None` | `64Mi` | a new setting |"
    assert rows["new-two"] == "| `new-two` | file only | `float` | `1.5` | a new tuning key |"
    assert list(rows)[-2:] == ["new-one", "new-two"]
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
