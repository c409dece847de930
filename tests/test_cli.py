"""memqos-shim explain and config handling, run as a user would (a subprocess)."""
import json
import subprocess
import sys

import pytest

Mi = 2**20


def shim(*args, check=True):
    return subprocess.run([sys.executable, "-m", "shim", *args], capture_output=True, text=True, check=check,
                          timeout=300)


def test_explain_json_issue_example():
    out = shim("explain", "--request", "128Mi", "--limit", "256Mi", "--allocatable", "32Gi",
               "--factor", "0.9", "--page-size", "4096", "--json").stdout
    doc = json.loads(out)  # exactly one JSON object on stdout
    assert doc["unified"] == {"memory.min": "134217728", "memory.high": "255012864"}


@pytest.mark.parametrize("req,factor,high", [(0, 0.9, 900), (100, 0.9, 910), (800, 0.9, 980), (900, 0.9, 990),
                                             (500, 0.6, 800), (850, 0.8, 970), (500, 0.4, 700), (1000, 0.9, None)])
def test_explain_json_kep_examples(req, factor, high):
    doc = json.loads(shim("explain", "--request", f"{req}Mi", "--limit", "1000Mi", "--factor", str(factor),
                          "--page-size", "4096", "--json").stdout)
    assert doc["unified"].get("memory.high") == (None if high is None else str(high * Mi))


def test_explain_besteffort_and_factor_none():
    doc = json.loads(shim("explain", "--allocatable", "1000Mi", "--page-size", "4096", "--json").stdout)
    assert doc["qos"] == "BestEffort" and doc["unified"] == {"memory.high": str(900 * Mi)}
    doc = json.loads(shim("explain", "--request", "1Gi", "--limit", "2Gi", "--factor", "none", "--json").stdout)
    assert doc["unified"] == {"memory.min": str(2**30)}


def test_explain_readable_and_table():
    text = shim("explain", "--request", "128Mi", "--limit", "256Mi", "--page-size", "4096").stdout
    assert "memory.high  255012864" in text and "memory.min   134217728" in text
    table = shim("explain", "--table").stdout
    row800 = next(line for line in table.splitlines() if line.strip().startswith("800Mi"))
    assert row800.split("|")[1].strip() == "980Mi"  # not the KEP's typo 960
    row900 = next(line for line in table.splitlines() if line.strip().startswith("900Mi"))
    assert row900.split("|")[1].strip() == "990Mi"


def test_explain_bad_input_is_a_clear_error():
    r = shim("explain", "--request", "lots", check=False)
    assert r.returncode == 2 and "not a quantity" in r.stderr


def test_serve_rejects_unknown_config_keys(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("listen: /tmp/x.sock\nfactr: 0.5\n")
    r = shim("serve", "--config", str(cfg), check=False)
    assert r.returncode == 2 and "unknown settings ['factr']" in r.stderr


@pytest.mark.parametrize("value", ["grpc", "relay"])
def test_serve_refuses_a_transport_setting_naming_the_relay(tmp_path, value):
    """The relay is the only transport: a config file that picks one is refused before anything
    starts, with the reason (exit 2, like any setting the shim does not have)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"transport: {value}\nmax_concurrent_streams: 10\n")
    r = shim("serve", "--config", str(cfg), "--listen", str(tmp_path / "s.sock"), check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unknown settings ['max_concurrent_streams', 'transport']" in r.stderr
    assert "transport: the HTTP/2 relay is the only transport" in r.stderr
    assert "max_concurrent_streams: the relay's is h2-max-concurrent-streams" in r.stderr
    assert not (tmp_path / "s.sock").exists()


def test_serve_rejects_bad_factor():
    r = shim("serve", "--factor", "1.5", check=False)
    assert r.returncode == 2 and "--factor" in r.stderr


def test_config_precedence(tmp_path):
    import argparse

    from shim.app.config import add_arguments, resolve

    cfg = tmp_path / "c.yaml"
    cfg.write_text("factor: 0.7\npolicy: TieredReservation\nnode_allocatable: 30Gi\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    c = resolve(p.parse_args(["--config", str(cfg), "--factor", "none"]))
    assert c.factor is None and c.origin["factor"] == "flag"
    assert c.policy.value == "TieredReservation" and c.node_allocatable == 30 * 2**30
    assert c.listen == "unix:///run/memqos-shim/memqos-shim.sock" and c.origin["listen"] == "default"


@pytest.mark.parametrize("args,says", [
    (["--qos", "besteffort", "--request", "128Mi"], "--qos besteffort"),
    (["--qos", "besteffort", "--limit", "1Gi"], "--qos besteffort"),
    (["--qos", "guaranteed", "--request", "128Mi"], "--qos guaranteed"),
    (["--qos", "guaranteed", "--request", "128Mi", "--limit", "256Mi"], "--qos guaranteed"),
    (["--page-size", "3000"], "--page-size: 3000"),
    (["--page-size", "0"], "--page-size: 0"),
])
def test_explain_refuses_contradictions_with_one_line(args, says):
    r = shim("explain", *args, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr


def test_explain_takes_what_agrees():
    for args in (["--qos", "guaranteed", "--request", "1Gi", "--limit", "1Gi"], ["--qos", "besteffort"],
                 ["--qos", "burstable", "--request", "1Gi", "--limit", "1Gi"], ["--page-size", "65536"]):
        assert shim("explain", *args, "--json").returncode == 0


@pytest.mark.parametrize("command", ["serve", "nri"])
def test_an_unknown_log_level_is_refused(command):
    r = shim(command, "--log-level", "loud", check=False)
    assert r.returncode == 2 and "--log-level" in r.stderr and "loud" in r.stderr and "Traceback" not in r.stderr


def test_each_front_end_shows_its_own_options():
    """`nri --help` is not serve's: no kubelet socket, runtime socket, recorder or socket group;
    serve's shows none of the NRI plugin's flags."""
    nri = shim("nri", "--help").stdout
    serve = shim("serve", "--help").stdout
    for flag in ("--listen", "--upstream", "--record", "--socket-group"):
        assert flag not in nri and flag in serve
    for flag in ("--nri-socket", "--nri-index", "--health-file"):
        assert flag in nri and flag not in serve
    assert "socket the kubelet connects to" not in nri and "h2-max-frame-size" not in nri
    r = shim("nri", "--listen", "/tmp/x.sock", check=False)
    assert r.returncode == 2 and "unrecognized arguments: --listen" in r.stderr


def test_a_socket_another_process_serves_on_stops_the_start_with_one_line(tmp_path):
    """What the settings' checks cannot foresee (another process listening at --listen) ends
    the start with one line and exit 1, no traceback; that socket is left alone."""
    import socket

    path = tmp_path / "s.sock"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(path))
    live.listen()
    try:
        (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
        r = shim("serve", "--listen", str(path), "--upstream", str(tmp_path / "rt.sock"), "--kubelet-config", "none",
                 "--cgroup-root", str(tmp_path), "--meminfo", str(tmp_path / "meminfo"), "--kubelet-version", "1.30",
                 "--audit-log", "none", "--log-level", "error", check=False)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines() == [
            f"memqos-shim: cannot start: {path}: another process is serving on this socket; refusing to replace it "
            "(is another memqos-shim running?)"]
        assert path.is_socket()
    finally:
        live.close()


def test_explain_guaranteed_shows_the_capped_memory_min_and_why():
    text = shim("explain", "--request", "256Mi", "--limit", "256Mi", "--page-size", "4096").stdout
    assert "memory.min   241590272" in text and "memory.low   268435456" in text
    assert "capped at limit 268435456 - headroom 26843546 = 241591910 -> 241590272" in text
    cap = next(line for line in text.splitlines() if line.strip().startswith("cap:"))
    assert "min(request 268435456, limit 268435456 - headroom 26843546)" in cap and "= 241590272" in cap
    doc = json.loads(shim("explain", "--request", "256Mi", "--limit", "256Mi", "--page-size", "4096",
                          "--json").stdout)
    assert doc["unified"] == {"memory.min": "241590272", "memory.low": "268435456"}
    assert doc["protection_headroom_ratio"] == 0.1 and doc["protection_headroom_min"] == 8 * Mi
    # far enough under the limit: the request as it is, no cap line
    text = shim("explain", "--request", "128Mi", "--limit", "256Mi", "--page-size", "4096").stdout
    assert "memory.min   134217728" in text and "cap:" not in text
    # the headroom settings, and both 0: no cap
    off = json.loads(shim("explain", "--request", "256Mi", "--limit", "256Mi", "--protection-headroom-ratio", "0",
                          "--protection-headroom-min", "0", "--json").stdout)
    assert off["unified"] == {"memory.min": "268435456"}
    r = shim("explain", "--request", "1Mi", "--limit", "1Mi", "--protection-headroom-ratio", "1", check=False)
    assert r.returncode == 2 and "--protection-headroom-ratio" in r.stderr


@pytest.mark.parametrize("text,key", [
    ("protection-headroom-ratio: 1\n", "protection-headroom-ratio"),
    ("protection-headroom-ratio: -0.1\n", "protection-headroom-ratio"),
    ("protection-headroom-ratio: lots\n", "protection-headroom-ratio"),
    ("protection-headroom-min: -1\n", "protection-headroom-min"),
])
def test_serve_rejects_bad_protection_headroom(tmp_path, text, key):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    r = shim("serve", "--config", str(cfg), "--listen", str(tmp_path / "s.sock"), check=False)
    assert r.returncode == 2 and key in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "s.sock").exists()


def test_a_reader_that_went_away_ends_the_command_without_a_traceback():
    """`memqos-shim explain ... | head -0`: the reader closed its end before the first line. The
    command stops with 141 (128 + SIGPIPE) and says nothing on stderr."""
    import os

    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "shim", "explain", "--request", "256Mi", "--limit", "512Mi"],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (141, "")
