"""The systemd guest (scripts/e2e-vm --guest systemd, scripts/e2e-vm-systemd).

`pytest -m vm tests/test_e2e_systemd.py` builds the guest image if needed (root, network to
deb.debian.org) and boots it (about 3 minutes under TCG with a cached image); the quick tests
check how the scripts take their arguments."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E2E_VM = os.path.join(ROOT, "scripts", "e2e-vm")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=60)


def test_e2e_vm_hands_the_systemd_guest_to_its_script():
    p = run(E2E_VM, "--no-install", "--guest", "systemd", "--help")
    assert p.returncode == 0 and "scripts/e2e-vm-systemd [--out DIR]" in p.stdout
    p = run(E2E_VM, "--guest", "bogus")
    assert p.returncode == 3 and "--guest must be vng or systemd" in p.stderr
    p = run(E2E_VM, "--guest", "systemd", "--writes", "bogus")
    assert p.returncode == 3 and "--writes must be auto, dbus or cgroupfs" in p.stderr


@pytest.mark.vm
def test_systemd_guest(tmp_path):
    """Boot the systemd guest; every check must pass, and the cgroupfs phase must have shown
    systemd resetting values written to the files (else the survival checks prove nothing)."""
    out = os.environ.get("E2E_OUT") or str(tmp_path / "e2e-systemd")
    p = subprocess.run(["bash", E2E_VM, "--guest", "systemd", "--out", out], capture_output=True, text=True,
                       timeout=int(os.environ.get("E2E_PYTEST_TIMEOUT", "3600")))
    print(p.stdout[-20000:])
    print(p.stderr[-5000:], file=sys.stderr)
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    failed = [f"{c['file']}: expected {c['expected']}, actual {c['actual']} ({c['step']})"
              for c in report["checks"] if not c["pass"]]
    assert not failed, "\n".join(failed)
    assert report["status"] == "pass" and p.returncode == 0, report.get("errors")
    steps = {c["step"] for c in report["checks"]}
    assert {"cgroupfs/disturbed", "dbus/disturbed", "dbus/live", "dbus/reset-disturbed"} <= steps
    assert report["systemd"]["restore"]["dbus-live"]["watch"]["wrong_samples"] == 0
    # the host install (e2e/guest_install.py): installed offline, served, survived the crash loop, removed
    assert {"install/installed", "install/traffic", "install/crash-loop", "install/uninstalled"} <= steps
    assert report["install"]["restarts_counted"] >= 10
    assert report["install"]["after_crash_loop"]["ActiveState"] == "active"
