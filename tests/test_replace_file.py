"""shim.effects.files.replace_file: a file written by rename (the guard's episodes, the heartbeat
file) replaces only a file of the caller's kind, is never written through a symlink, gets its
mode, and leaves no temporary file behind when it fails."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from shim.effects.files import ForeignFile, foreign_json, replace_file

KEYS = ("version", "items")


def write(path: Path, **kw) -> None:
    replace_file(str(path), json.dumps({"version": 1, "items": []}).encode(), keys=KEYS, max_bytes=4096, **kw)


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_a_new_file_is_written_with_the_mode_asked_for(tmp_path):
    path = tmp_path / "f.json"
    write(path)
    assert json.loads(path.read_text()) == {"version": 1, "items": []}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    write(path, mode=0o644, fsync=False)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and leftovers(tmp_path) == []


@pytest.mark.parametrize("text", ["", '{"version": 7, "items": {}, "more": 1}'])
def test_an_empty_file_or_one_of_the_callers_kind_is_replaced(tmp_path, text):
    path = tmp_path / "f.json"
    path.write_text(text)
    before = path.stat().st_ino
    write(path)
    assert json.loads(path.read_text())["version"] == 1 and path.stat().st_ino != before


@pytest.mark.parametrize("text, what", [
    ("precious\n", "not JSON"),
    ('{"version": 1}', "not a JSON object with version, items"),
    ('[1, 2]', "not a JSON object with version, items"),
    ('{"version": 1, "items": "' + "x" * 5000 + '"}', "not JSON"),  # beyond max_bytes: not read whole
])
def test_a_file_of_someone_elses_is_refused_and_kept(tmp_path, text, what):
    path = tmp_path / "f.json"
    path.write_text(text)
    with pytest.raises(ForeignFile) as e:
        write(path)
    assert e.value.what == what and path.read_text() == text and leftovers(tmp_path) == []
    assert isinstance(e.value, OSError) and str(path) in str(e.value)


def test_a_symlink_or_a_directory_is_refused_and_nothing_written_through_it(tmp_path):
    target = tmp_path / "target"
    target.write_text("precious\n")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ForeignFile, match="a symbolic link"):
        write(tmp_path / "link")
    assert target.read_text() == "precious\n" and (tmp_path / "link").is_symlink()
    (tmp_path / "dir").mkdir()
    with pytest.raises(ForeignFile, match="not a regular file"):
        write(tmp_path / "dir")
    assert leftovers(tmp_path) == []


def test_missing_directories_are_made_only_when_asked(tmp_path):
    with pytest.raises(FileNotFoundError):
        write(tmp_path / "a" / "b" / "f.json")
    write(tmp_path / "a" / "b" / "f.json", make_parent=True)
    assert (tmp_path / "a" / "b" / "f.json").exists()


def test_a_failed_rename_leaves_no_temporary_file(tmp_path, monkeypatch):
    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="No space"):
        write(tmp_path / "f.json")
    assert list(tmp_path.iterdir()) == []


def test_foreign_json_says_nothing_of_a_missing_file(tmp_path):
    assert foreign_json(str(tmp_path / "none"), KEYS, 4096) is None
