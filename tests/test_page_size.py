"""The page size: a power of two from 4096 to 65536 (the base pages Linux is built with), refused
otherwise by every command that takes it, named as given (the flag, or the file, line and key)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shim.decision.quantity import QuantityError, parse_page_size

ROOT = Path(__file__).resolve().parents[1]
BAD = ["3000", "0", "2048", "6144", "131072", "1Mi", "-4096", "x"]


def shim(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shim", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


@pytest.mark.parametrize("text, page", [("4096", 4096), (4096, 4096), ("8192", 8192), ("16Ki", 16384),
                                        (65536, 65536), ("64Ki", 65536)])
def test_a_base_page_size_is_taken(text, page):
    assert parse_page_size(text) == page


@pytest.mark.parametrize("text", BAD + [True, None, 4096.0, [4096]])
def test_anything_else_is_refused(text):
    with pytest.raises(QuantityError):
        parse_page_size(text)


@pytest.mark.parametrize("command", ["serve", "nri"])
@pytest.mark.parametrize("bad", ["3000", "131072"])
def test_the_front_ends_refuse_a_bad_page_size_from_a_flag_or_the_file(tmp_path, command, bad):
    r = shim(command, "--kubelet-config", "none", "--audit-log", str(tmp_path / "a.jsonl"), "--page-size", bad)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"memqos-shim: --page-size: {bad} is not a page size: a power of two from 4096 " \
                               "to 65536 (4096 on x86-64; 4096, 16384 or 65536 on arm64)"
    (tmp_path / "c.yaml").write_text(f"mode: observe\npage_size: {bad}\n")
    r = shim(command, "--kubelet-config", "none", "--audit-log", str(tmp_path / "a.jsonl"),
             "--config", str(tmp_path / "c.yaml"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"memqos-shim: {tmp_path / 'c.yaml'}:2: page_size: {bad} is not a page size")
    assert not (tmp_path / "a.jsonl").exists()


@pytest.mark.parametrize("bad", BAD)
def test_explain_refuses_what_serve_refuses(bad):
    r = shim("explain", "--page-size", bad)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("memqos-shim explain: --page-size: "), r.stderr


def test_explain_takes_a_16k_page():
    r = shim("explain", "--request", "128Mi", "--limit", "256Mi", "--page-size", "16384", "--json")
    assert r.returncode == 0 and '"page_size": 16384' in r.stdout


@pytest.mark.parametrize("flag", [True, False])
def test_doctor_fails_the_config_check_naming_the_setting(tmp_path, flag):
    (tmp_path / "c.yaml").write_text("mode: observe\n" + ("" if flag else "page-size: 3000\n"))
    r = shim("doctor", "--config", str(tmp_path / "c.yaml"), *(["--page-size", "3000"] if flag else []))
    assert "Traceback" not in r.stderr + r.stdout
    config = next(line for line in r.stdout.splitlines() if line.split()[1:2] == ["config"])
    named = "--page-size" if flag else f"{tmp_path / 'c.yaml'}:2: page-size"
    assert config.split()[0] == "FAIL" and f"{named}: 3000 is not a page size" in config, r.stdout
