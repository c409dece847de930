"""The pieces of the critest run (scripts/critest-vm, e2e/guest_critest.py) that run without a VM:
reading critest's closing lines, and the containerd configuration the guest writes for each
stack's template (CNI from Debian's plugins, registry hosts sent to the guest's registry)."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "e2e"))

import guest_critest as G  # noqa: E402

# the closing lines of a critest v1.26.1 run (ginkgo v2), as the guest's log holds them
FAILED_RUN = """\
------------------------------
[k8s.io] Runtime info runtime should support returning runtime info runtime should return version info [Conformance]
• [0.012 seconds]
------------------------------

Summarizing 2 Failures:
  [FAIL] [k8s.io] Networking runtime should support networking [It] runtime should support DNS config [Conformance]
  github.com/kubernetes-sigs/cri-tools/pkg/framework/util.go:362
  [FAIL] [k8s.io] PodSandbox runtime should support sysctls [It] should support safe sysctls
  github.com/kubernetes-sigs/cri-tools/pkg/framework/util.go:362

Ran 11 of 88 Specs in 147.926 seconds
FAIL! -- 9 Passed | 2 Failed | 0 Pending | 77 Skipped
--- FAIL: TestCRISuite (120.25s)
FAIL
"""
PASSED_RUN = """\
Ran 79 of 88 Specs in 1502.113 seconds
SUCCESS! -- 79 Passed | 0 Failed | 0 Pending | 9 Skipped
PASS
"""


def test_parse_critest_counts_and_failed_specs():
    r = G.parse_critest(FAILED_RUN)
    assert (r["ran"], r["total"], r["passed"], r["failed"], r["skipped"]) == (11, 88, 9, 2, 77)
    assert r["seconds"] == 147.926
    assert r["failed_specs"] == [
        "[k8s.io] Networking runtime should support networking",
        "[k8s.io] PodSandbox runtime should support sysctls",
    ]
    ok = G.parse_critest(PASSED_RUN)
    assert (ok["ran"], ok["passed"], ok["failed"], ok["failed_specs"]) == (79, 79, 0, [])


def test_parse_critest_without_closing_lines_counts_nothing():
    """A critest that died before its summary (a timeout, a crash) leaves the counts unknown,
    which the run's checks treat as a failure, never as 0 of 0 passed."""
    r = G.parse_critest("panic: runtime error\n")
    assert r["ran"] is None and r["passed"] is None


def test_check_run_fails_a_run_that_ran_nothing(tmp_path):
    from guest_common import Report

    report = Report(str(tmp_path))
    G.check_run(report, "direct", dict(G.parse_critest(""), exit=1, endpoint="unix:///x"), None)
    assert not report.data["checks"][0]["pass"]
    report = Report(str(tmp_path))
    G.check_run(report, "shim", dict(G.parse_critest(PASSED_RUN), exit=0, endpoint="unix:///x"), 79)
    assert all(c["pass"] for c in report.data["checks"])
    report = Report(str(tmp_path))
    G.check_run(report, "shim", dict(G.parse_critest(PASSED_RUN), exit=0, endpoint="unix:///x"), 80)
    assert [c["file"] for c in report.data["checks"] if not c["pass"]] == ["specs ran"]


@pytest.mark.parametrize("template,images_plugin", [
    ("containerd.toml.in", "io.containerd.grpc.v1.cri"),
    ("containerd-v3.toml.in", "io.containerd.cri.v1.images"),
])
def test_containerd_config_sends_registry_hosts_to_the_guest_registry(tmp_path, monkeypatch, template,
                                                                        images_plugin):
    monkeypatch.setattr(G, "RUN", str(tmp_path))
    stack = {"config": os.path.join(ROOT, "e2e", template), "runc": "/usr/sbin/runc"}
    conf = tomllib.loads(open(G.containerd_config(stack)).read())
    plugins = conf["plugins"]
    assert plugins[images_plugin]["registry"]["config_path"] == str(tmp_path / "certs.d")
    cni = plugins["io.containerd.grpc.v1.cri" if template == "containerd.toml.in" else
                  "io.containerd.cri.v1.runtime"]["cni"]
    assert cni.get("bin_dir") == G.CNI_BIN or cni.get("bin_dirs") == [G.CNI_BIN]
    for host in G.REGISTRY_HOSTS:
        hosts = tomllib.loads((tmp_path / "certs.d" / host / "hosts.toml").read_text())
        assert hosts["host"][f"http://{G.REGISTRY}"]["capabilities"] == ["pull", "resolve"]
    net = (tmp_path / "cni" / "net.d" / "10-critest.conflist").read_text()
    assert '"portmap"' in net and '"bridge"' in net


def test_critest_vm_refuses_a_missing_binary(tmp_path):
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "critest-vm"), "--critest", str(tmp_path / "none"),
                        "--no-install"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "--critest" in p.stderr
