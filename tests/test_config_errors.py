"""A setting's error names it the way the user gave it: the flag (`--factor: ...`), or the config
file, its line and the key as written (`c.yaml:3: factor: ...`); a file-only setting is never
called a flag. An octal socket mode written unquoted in the file is the mode the user wrote."""
from __future__ import annotations

import argparse
import grp
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shim.cli.main import build_parser
from shim.app.config import FILE, OPTIONS, ConfigError, add_arguments, reread, resolve

ROOT = Path(__file__).resolve().parents[1]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def from_file(tmp_path: Path, text: str, *flags: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return resolve(parser().parse_args(["--config", str(path), *flags]))


def error_of(tmp_path: Path, text: str, *flags: str) -> str:
    with pytest.raises(ConfigError) as e:
        from_file(tmp_path, text, *flags)
    return str(e.value)


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shim", "serve", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_a_bad_file_value_names_the_file_line_and_key(tmp_path):
    path = tmp_path / "c.yaml"
    msg = error_of(tmp_path, "listen: /x.sock\n# a comment\nfactor: 7\n")
    assert msg == f"{path}:3: factor: must be in (0, 1], not 7.0"
    msg = error_of(tmp_path, "policy: soft\nh2_max_frame_size: 0\n")
    assert msg.startswith(f"{path}:2: h2_max_frame_size: ") and "--" not in msg


def test_every_file_only_setting_is_named_as_a_key_never_as_a_flag(tmp_path):
    """Each file-only setting given a value no parser takes: the error has the key, not --KEY."""
    for o in (o for o in OPTIONS if o.where == FILE):
        path = tmp_path / "c.yaml"
        path.write_text(f"mode: enforce\n{o.name}: [not, a, value]\n")
        try:
            resolve(parser().parse_args(["--config", str(path)]))
        except ConfigError as e:
            assert str(e).startswith(f"{path}:2: {o.name}: ") and f"--{o.name}" not in str(e), str(e)


def test_a_bad_flag_names_the_flag(tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve(parser().parse_args(["--factor", "1.5"]))
    assert str(e.value) == "--factor: must be in (0, 1], not 1.5"
    # the flag wins over the file, and so its error is the flag's
    assert error_of(tmp_path, "factor: 0.5\n", "--factor", "7").startswith("--factor: ")


def test_serve_says_the_file_line_and_key(tmp_path):
    (tmp_path / "c.yaml").write_text("listen: /x.sock\nguard-window: -1\n")
    r = serve("--config", str(tmp_path / "c.yaml"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'c.yaml'}:2: guard-window: must be positive" in r.stderr
    assert "--guard-window" not in r.stderr
    r = serve("--socket-mode", "0600")
    assert r.returncode == 2 and "unrecognized arguments: --socket-mode" in r.stderr


def test_unknown_and_repeated_keys_are_named_with_their_lines(tmp_path):
    msg = error_of(tmp_path, "listen: /x.sock\nfactr: 0.5\n")
    assert "unknown settings ['factr'] (factr on line 2)" in msg
    msg = error_of(tmp_path, "node-allocatable: 1Gi\npolicy: Soft\nnode_allocatable: 2Gi\n")
    assert msg == f"{tmp_path / 'c.yaml'}:3: node_allocatable: set twice (first on line 1 as node-allocatable)"


@pytest.mark.parametrize("text, why", [
    ("- a\n- b\n", "1: expected a map of settings"),
    ("factor: [0.5\n", "not YAML"),
    ("? [a, b]\n: 1\n", "unknown settings"),
])
def test_a_file_that_is_no_map_of_settings_is_an_error_not_a_crash(tmp_path, text, why):
    assert why in error_of(tmp_path, text)


def test_a_reread_names_the_file_line_and_key(tmp_path):
    cfg = from_file(tmp_path, "mode: observe\n")
    (tmp_path / "c.yaml").write_text("mode: observe\n\nmode_: x\n")
    with pytest.raises(ConfigError, match=r"unknown settings \['mode_'\] \(mode_ on line 3\)"):
        reread(cfg, str(tmp_path / "c.yaml"))
    (tmp_path / "c.yaml").write_text("log-level: info\nmode: audit\n")
    with pytest.raises(ConfigError) as e:
        reread(cfg, str(tmp_path / "c.yaml"))
    assert str(e.value).startswith(f"{tmp_path / 'c.yaml'}:2: mode: mode must be one of")


# -- socket-mode: octal as written ------------------------------------------------------------
@pytest.mark.parametrize("written", ["0600", "600", "0o600", "'0600'", '"600"'])
def test_socket_mode_is_the_octal_the_file_writes(tmp_path, written):
    assert from_file(tmp_path, f"socket-mode: {written}\n").socket_mode == 0o600


def test_socket_mode_with_a_group_and_the_underscore_key(tmp_path):
    cfg = from_file(tmp_path, "socket_mode: 0660\nsocket-group: adm\n")
    assert (cfg.socket_mode, cfg.origin["socket_mode"]) == (0o660, "file")


@pytest.mark.parametrize("written, said", [
    ("0606", "0606 gives access to other users; refused"),
    ("0666", "0666 gives access to other users; refused"),
    ("384", "must be an octal mode, e.g. 0600, not '384'"),
    ("1600", "must be permission bits 0000..0777, not 0o1600"),
    ("rw", "must be an octal mode"),
    ("[1]", "must be an octal mode"),
])
def test_a_bad_socket_mode_is_shown_back_as_written_or_in_octal(tmp_path, written, said):
    msg = error_of(tmp_path, f"socket-mode: {written}\n")
    assert msg.startswith(f"{tmp_path / 'c.yaml'}:1: socket-mode: ") and said in msg, msg


def test_socket_mode_in_code_takes_the_bits():
    parse = next(o for o in OPTIONS if o.name == "socket-mode").parse
    assert parse(0o640) == 0o640 and parse("0640") == 0o640
    with pytest.raises(ConfigError, match="0644 gives access"):
        parse(0o644)


def test_serve_makes_its_socket_with_the_unquoted_mode(tmp_path):
    """A real serve: `socket-mode: 0640` unquoted (YAML's integer 416) gives a 0640 socket."""
    import tempfile

    from tests.test_serve import Shim
    from memqos_dev.testing.fake_runtime import FakeRuntimeServer

    base = Path(tempfile.mkdtemp(prefix="mqs-"))
    group = grp.getgrgid(os.getgid()).gr_name
    (base / "c.yaml").write_text(f"socket-mode: 0640\nsocket-group: {group}\nmonitor-interval: 0\n")
    with FakeRuntimeServer(base / "runtime.sock") as runtime:
        shim = Shim(base, runtime.address, extra=("--config", str(base / "c.yaml")))
        try:
            assert stat.S_IMODE(os.lstat(shim.sock).st_mode) == 0o640
        finally:
            shim.stop()


def test_the_cli_parser_takes_no_file_only_flag():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--h2-max-frame-size", "16384"])
