"""The host install: deploy/install.sh and deploy/uninstall.sh run for real into a temporary
root (--root: a real virtual environment from a real wheel, no systemctl), and the units
(deploy/memqos-shim.service, deploy/memqos-shim-podman.service) checked by
`systemd-analyze verify` against an installed tree.

The wheelhouse (the wheel of this checkout and what `pip download` resolves for it) is made
once per session; every install from it is offline (--no-index). The systemd guest
(e2e/guest_install.py) runs the same scripts with systemctl, a crash loop and no network."""
from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import require_tool

from shim.app.config import OPTIONS
from shim.app.limits import DESCRIPTORS_BESIDE_CONNECTIONS, DESCRIPTORS_PER_CONNECTION

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
INSTALL = DEPLOY / "install.sh"
UNINSTALL = DEPLOY / "uninstall.sh"
SOCK_FLAG = "--container-runtime-endpoint=unix:///run/memqos-shim/memqos-shim.sock"


def run(*argv, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *map(str, argv)], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)


def unit(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None, strict=False, delimiters=("=",))
    cp.optionxform = str  # keys are case-sensitive
    cp.read_string(path.read_text().replace("\\\n", " "))
    return cp


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory) -> Path:
    """This checkout's wheel (built from a copy of the sources, without build isolation: no
    network for the build) and its dependencies as `pip download` resolves them."""
    wh = tmp_path_factory.mktemp("wheelhouse")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "shim", src / "shim", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wh, src], check=True, timeout=300)
    [whl] = wh.glob("memqos_shim-*.whl")
    # setuptools and wheel: install.sh without --wheel builds one from the checkout (offline too)
    subprocess.run([*pip, "download", "--dest", wh, whl, "setuptools>=68", "wheel"], check=True, timeout=600)
    return wh


def the_wheel(wh: Path) -> Path:
    [whl] = wh.glob("memqos_shim-*.whl")
    return whl


def install(root: Path, wh: Path, *extra) -> subprocess.CompletedProcess:
    return run(INSTALL, "--root", root, "--find-links", wh, "--no-index", *extra)


@pytest.fixture(scope="session")
def installed(tmp_path_factory, wheelhouse) -> Path:
    """One real install into a temporary root, from the wheel, offline."""
    root = tmp_path_factory.mktemp("root")
    p = install(root, wheelhouse, "--wheel", the_wheel(wheelhouse))
    assert p.returncode == 0, p.stdout + p.stderr
    return root


def systemd_analyze() -> str:
    return require_tool("systemd-analyze")


def verify(root: Path, unit_file: Path) -> subprocess.CompletedProcess:
    """`systemd-analyze verify` of ``unit_file`` installed in ``root`` (with systemd's own units
    beside it, which the verification loads: sysinit.target and the like)."""
    dest = root / "etc/systemd/system" / unit_file.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(unit_file, dest)
    for d in ("usr/lib/systemd/system", "lib/systemd/system"):
        if (Path("/") / d).is_dir() and not (root / d).exists():
            shutil.copytree(Path("/") / d, root / d, symlinks=True)
            break
    return subprocess.run([systemd_analyze(), "verify", f"--root={root}", unit_file.name],
                          capture_output=True, text=True, timeout=120)


# -- the units ---------------------------------------------------------------------------------
def test_unit_verifies_clean_against_the_installed_tree(installed):
    p = verify(installed, DEPLOY / "memqos-shim.service")
    assert (p.returncode, p.stdout + p.stderr) == (0, "")


def test_verify_catches_what_systemd_ignores(tmp_path):
    """The check means something: a start limit in [Service] (ignored by systemd) and an
    ExecStart that is not there are both reported."""
    bad = tmp_path / "bad" / "memqos-shim.service"
    bad.parent.mkdir()
    text = (DEPLOY / "memqos-shim.service").read_text()
    bad.write_text(text.replace("StartLimitIntervalSec=0\n", "").replace("[Service]\n",
                                                                          "[Service]\nStartLimitIntervalSec=0\n"))
    p = verify(tmp_path / "root", bad)
    out = p.stdout + p.stderr
    assert "Unknown key 'StartLimitIntervalSec' in section [Service]" in out
    assert "/opt/memqos-shim/bin/memqos-shim is not executable" in out


def test_unit_never_stays_failed_and_starts_the_installed_shim():
    u = unit(DEPLOY / "memqos-shim.service")
    assert u["Unit"]["StartLimitIntervalSec"] == "0"
    assert "StartLimitIntervalSec" not in u["Service"] and "StartLimitBurst" not in u["Service"]
    assert u["Service"]["Restart"] == "always" and u["Service"]["RestartSec"]
    assert u["Service"]["Type"] == "notify"
    assert u["Service"]["ExecStart"] == \
        "/opt/memqos-shim/bin/memqos-shim serve --config /etc/memqos-shim/config.yaml"
    assert "kubelet.service" in u["Unit"]["Before"].split()
    assert {"containerd.service", "crio.service"} <= set(u["Unit"]["After"].split())
    assert u["Unit"]["Documentation"].split()[0].startswith("https://github.com/memqos/memqos-shim/")


@pytest.mark.parametrize("name", ["memqos-shim.service", "memqos-shim-podman.service"])
def test_descriptor_limit_holds_the_connection_limit(name):
    """LimitNOFILE (or podman's --ulimit) holds the max-connections key's default several times over."""
    text = (DEPLOY / name).read_text()
    if name.endswith("podman.service"):
        value = text.split("--ulimit nofile=", 1)[1].split(":", 1)[0]
    else:
        value = unit(DEPLOY / name)["Service"]["LimitNOFILE"]
    [max_conn] = [o.default for o in OPTIONS if o.name == "max-connections"]
    needed = max_conn * DESCRIPTORS_PER_CONNECTION + DESCRIPTORS_BESIDE_CONNECTIONS
    assert int(value) >= 4 * needed


def test_podman_unit_verifies_clean_and_mounts_what_the_shim_needs(tmp_path):
    root = tmp_path / "root"
    podman = root / "usr/bin/podman"  # verify checks that ExecStart's executable exists
    podman.parent.mkdir(parents=True)
    podman.write_text("#!/bin/sh\n")
    podman.chmod(0o755)
    p = verify(root, DEPLOY / "memqos-shim-podman.service")
    assert (p.returncode, p.stdout + p.stderr) == (0, "")
    u = unit(DEPLOY / "memqos-shim-podman.service")
    assert u["Unit"]["StartLimitIntervalSec"] == "0" and "kubelet.service" in u["Unit"]["Before"].split()
    assert (u["Service"]["Type"], u["Service"]["NotifyAccess"]) == ("notify", "all")
    start = u["Service"]["ExecStart"]
    assert "--sdnotify=container" in start and "--network=host" in start and "--pid=host" in start
    mounts = [w for w in start.split() if w.count(":") >= 1 and w.startswith("/")]
    hosts = {m.split(":")[0]: m.split(":")[2] if m.count(":") == 2 else "rw" for m in mounts}
    config = (DEPLOY / "config.yaml").read_text()
    sock_dir = config.split("listen: unix://", 1)[1].split()[0].rsplit("/", 1)[0]
    runtime_dir = config.split("upstream: unix://", 1)[1].split()[0].rsplit("/", 1)[0]
    kubelet_config = config.split("kubelet-config:", 1)[1].split()[0]
    audit_dir = config.split("audit-log:", 1)[1].split()[0].rsplit("/", 1)[0]
    assert hosts[sock_dir] == "rw" and hosts[runtime_dir] == "rw" and hosts["/sys/fs/cgroup"] == "rw"
    assert hosts[kubelet_config] == "ro" and hosts["/etc/memqos-shim"] == "ro" and hosts[audit_dir] == "rw"
    assert "serve --config /etc/memqos-shim/config.yaml" in start


# -- install.sh --------------------------------------------------------------------------------
def test_install_puts_a_working_shim_unit_and_config_under_the_root(installed):
    venv = installed / "opt/memqos-shim"
    assert (venv / "pyvenv.cfg").is_file()
    p = subprocess.run([venv / "bin/memqos-shim", "explain", "--request", "1Gi", "--limit", "2Gi"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "memory.min" in p.stdout, p.stdout + p.stderr
    # the package came from the wheel, not from this checkout
    p = subprocess.run([venv / "bin/python", "-c", "import shim; print(shim.__file__)"], capture_output=True,
                       text=True, timeout=60, cwd="/")
    assert p.stdout.startswith(str(venv / "lib")), p.stdout + p.stderr
    assert (installed / "etc/systemd/system/memqos-shim.service").read_bytes() == \
        (DEPLOY / "memqos-shim.service").read_bytes()
    assert (installed / "etc/memqos-shim/config.yaml").read_bytes() == (DEPLOY / "config.yaml").read_bytes()


def test_install_again_keeps_the_config_repairs_the_package_then_uninstall_removes_it(tmp_path, wheelhouse):
    root = tmp_path / "root"
    assert install(root, wheelhouse, "--wheel", the_wheel(wheelhouse)).returncode == 0
    config = root / "etc/memqos-shim/config.yaml"
    config.write_text("upstream: unix:///var/run/crio/crio.sock\n")
    [decision] = (root / "opt/memqos-shim/lib").glob("python3*/site-packages/shim/decision/memory.py")
    decision.unlink()  # the same version again must still put the wheel's files back
    p = install(root, wheelhouse, "--wheel", the_wheel(wheelhouse))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "upgrading the virtual environment" in p.stdout
    assert config.read_text() == "upstream: unix:///var/run/crio/crio.sock\n"
    assert "kept" in p.stdout
    assert (root / "etc/memqos-shim/config.yaml.example").read_bytes() == (DEPLOY / "config.yaml").read_bytes()
    assert decision.is_file()
    # and removed again: the environment and the unit, the config kept, then purged
    p = run(UNINSTALL, "--root", root)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not (root / "opt/memqos-shim").exists()
    assert not (root / "etc/systemd/system/memqos-shim.service").exists()
    assert (root / "etc/memqos-shim/config.yaml").is_file() and "kept" in p.stdout
    p = run(UNINSTALL, "--root", root, "--purge")
    assert p.returncode == 0 and not (root / "etc/memqos-shim").exists()


def test_install_builds_the_wheel_from_the_checkout_offline(tmp_path, wheelhouse):
    root = tmp_path / "root"
    had_build = (REPO / "build").exists()
    p = install(root, wheelhouse)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "building the wheel from" in p.stdout
    assert subprocess.run([root / "opt/memqos-shim/bin/memqos-shim", "--help"], capture_output=True,
                          timeout=120).returncode == 0
    assert not (REPO / "build").exists() or had_build  # built from a copy: the checkout stays as it was


def test_install_without_venv_names_the_package_to_install(tmp_path):
    """A Python without ensurepip (Debian/Ubuntu without python3-venv): a clear error, nothing made."""
    fake = tmp_path / "fake"
    (fake / "ensurepip").mkdir(parents=True)
    (fake / "ensurepip" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'ensurepip'\")\n")
    python = tmp_path / "python3"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    root = tmp_path / "root"
    p = run(INSTALL, "--root", root, "--python", python, "--no-index")
    assert p.returncode == 1
    assert "install the package python3-venv" in p.stderr and "apt-get install python3-venv" in p.stderr
    assert not (root / "opt/memqos-shim").exists()


@pytest.mark.parametrize("args, message, code", [
    (["--wheel", "/nonexistent/memqos_shim-0.1.0-py3-none-any.whl"], "no such file", 1),
    (["--wheel", __file__], "not a wheel", 1),
    (["--python", "/nonexistent/python3"], "no /nonexistent/python3", 1),
    (["--bogus"], "unknown argument --bogus", 2),
])
def test_install_refuses_bad_arguments_clearly(tmp_path, args, message, code):
    p = run(INSTALL, "--root", tmp_path / "root", *args)
    assert p.returncode == code and message in p.stderr, p.stderr
    assert not (tmp_path / "root/opt").exists()


# -- uninstall.sh ------------------------------------------------------------------------------
def fake_install(root: Path) -> None:
    """What install.sh leaves, without the cost of a virtual environment."""
    (root / "opt/memqos-shim/bin").mkdir(parents=True)
    (root / "opt/memqos-shim/pyvenv.cfg").write_text("home = /usr/bin\n")
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(DEPLOY / "memqos-shim.service", root / "etc/systemd/system/memqos-shim.service")
    (root / "etc/memqos-shim").mkdir(parents=True)
    shutil.copy(DEPLOY / "config.yaml", root / "etc/memqos-shim/config.yaml")


@pytest.mark.parametrize("path, text", [
    ("var/lib/kubelet/kubeadm-flags.env", f'KUBELET_KUBEADM_ARGS="--node-ip=10.0.0.5 {SOCK_FLAG}"\n'),
    ("etc/default/kubelet", f"KUBELET_EXTRA_ARGS={SOCK_FLAG}\n"),
    ("var/lib/kubelet/config.yaml", "kind: KubeletConfiguration\n"
                                    "containerRuntimeEndpoint: unix:///var/run/memqos-shim/memqos-shim.sock\n"),
])
def test_uninstall_refuses_while_the_kubelet_is_configured_for_the_shim(tmp_path, path, text):
    root = tmp_path / "root"
    fake_install(root)
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)
    p = run(UNINSTALL, "--root", root, "--purge")
    assert p.returncode == 1
    assert "the kubelet uses the shim's socket" in p.stderr and path in p.stderr and "--force" in p.stderr
    assert (root / "opt/memqos-shim").is_dir() and (root / "etc/systemd/system/memqos-shim.service").is_file()
    p = run(UNINSTALL, "--root", root, "--purge", "--force")
    assert p.returncode == 0, p.stderr
    assert not (root / "opt/memqos-shim").exists() and not (root / "etc/memqos-shim").exists()


def test_uninstall_follows_the_socket_the_config_names_and_ignores_comments(tmp_path):
    for name, flags, refused in (("commented", f"# {SOCK_FLAG}\nKUBELET_KUBEADM_ARGS=--container-runtime-endpoint="
                                               "unix:///run/containerd/containerd.sock\n", False),
                                 ("configured", "KUBELET_KUBEADM_ARGS=--container-runtime-endpoint="
                                                "unix:///run/qos/shim.sock\n", True)):
        root = tmp_path / name
        fake_install(root)
        (root / "etc/memqos-shim/config.yaml").write_text("listen: unix:///run/qos/shim.sock\n")
        env = root / "var/lib/kubelet/kubeadm-flags.env"
        env.parent.mkdir(parents=True)
        env.write_text(flags)
        p = run(UNINSTALL, "--root", root)
        assert p.returncode == (1 if refused else 0), p.stderr
        assert ("run/qos/shim.sock" in p.stderr) == refused


def test_uninstall_leaves_a_directory_it_did_not_make(tmp_path):
    root = tmp_path / "root"
    (root / "opt/memqos-shim").mkdir(parents=True)
    (root / "opt/memqos-shim/data").write_text("someone else's\n")
    p = run(UNINSTALL, "--root", root)
    assert p.returncode == 1 and "not a virtual environment" in p.stderr
    assert (root / "opt/memqos-shim/data").is_file()


@pytest.mark.parametrize("script, words", [(INSTALL, ["--wheel FILE", "--no-index", "--root DIR", "Exit codes"]),
                                           (UNINSTALL, ["--purge", "--force", "--root DIR", "Exit codes"])])
def test_help_is_the_scripts_header(script, words):
    p = run(script, "--help")
    assert p.returncode == 0 and all(w in p.stdout for w in words)
    assert "set -euo" not in p.stdout and not p.stdout.startswith("!")
