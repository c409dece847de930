"""The OCI runtime scripts/build-image gives podman (scripts/oci-runtime).

The choice is checked on cgroup trees laid out as a pure v2, a hybrid (with and without
controllers on its v2 hierarchy) and a v1 host, with crun / runc present or not as real
executables in a search path of their own; then on this host's own /sys/fs/cgroup, against
statfs and /proc/self/mountinfo; then by running an OCI bundle with the runtime it picks
(and, where it refuses crun, with crun: crun's own refusal), as root where they are installed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPER = os.path.join(ROOT, "scripts", "oci-runtime")
CRUN_REFUSAL = "cgroups in hybrid mode not supported"


def pick(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", HELPER, *args], capture_output=True, text=True, timeout=30)


def choice(*args: str) -> tuple[str, str, str, str]:
    got = pick(*args)
    assert got.returncode == 0, got.stderr
    runtime, path, layout, why = got.stdout.rstrip("\n").split("\t")
    return runtime, path, layout, why


def cgroup_tree(tmp_path, layout: str, controllers: str = "") -> str:
    root = tmp_path / "cgroup"
    root.mkdir()
    if layout == "v2":
        (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
        (root / "cgroup.subtree_control").write_text("memory pids\n")
    if layout in ("hybrid", "v1"):
        for ctl in ("cpu", "memory", "pids", "systemd"):
            (root / ctl).mkdir()
            (root / ctl / "cgroup.procs").write_text("1\n")
    if layout == "hybrid":
        (root / "unified").mkdir()
        (root / "unified" / "cgroup.controllers").write_text(controllers)
        (root / "unified" / "cgroup.procs").write_text("1\n")
    return str(root)


def runtimes(tmp_path, *names: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in names:
        exe = bin_dir / name
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    (bin_dir / "not-a-runtime").mkdir()
    return f"{bin_dir / 'not-a-runtime'}:{bin_dir}"


@pytest.mark.parametrize("layout,controllers,installed,want", [
    # pure v2: podman's default, crun, where it is there; runc runs there too
    ("v2", "", ("crun", "runc"), ("crun", True)),
    ("v2", "", ("runc",), ("runc", True)),
    ("v2", "", (), ("crun", False)),
    # hybrid with a controller on the v2 hierarchy: crun refuses it, runc only
    ("hybrid", "hugetlb\n", ("crun", "runc"), ("runc", True)),
    ("hybrid", "hugetlb\n", ("crun",), ("runc", False)),
    ("hybrid", "memory pids\n", (), ("runc", False)),
    # hybrid with an empty v2 hierarchy, and v1: runc, else crun
    ("hybrid", "", ("crun", "runc"), ("runc", True)),
    ("hybrid", "", ("crun",), ("crun", True)),
    ("v1", "", ("crun", "runc"), ("runc", True)),
    ("v1", "", ("crun",), ("crun", True)),
    ("v1", "", (), ("runc", False)),
])
def test_choice_on_faked_hosts(tmp_path, layout, controllers, installed, want):
    root = cgroup_tree(tmp_path, layout, controllers)
    search = runtimes(tmp_path, *installed)
    runtime, path, got_layout, why = choice("--cgroup-root", root, "--search", search)
    assert runtime == want[0]
    if want[1]:
        assert path == os.path.join(str(tmp_path / "bin"), runtime)
    else:
        assert path == "-" and why.endswith(f"install {runtime}")
    assert got_layout.split()[0] == layout
    if layout == "hybrid" and controllers:
        assert got_layout.split()[1:] == controllers.split()
        assert "crun refuses" in why


def test_asked_for_runtime_refused_where_it_cannot_run(tmp_path):
    root = cgroup_tree(tmp_path, "hybrid", "hugetlb\n")
    search = runtimes(tmp_path, "crun", "runc")
    got = pick("--cgroup-root", root, "--search", search, "--want", "crun")
    assert got.returncode == 1 and got.stdout == ""
    assert "crun cannot run containers on this host" in got.stderr and "install and use runc" in got.stderr
    assert choice("--cgroup-root", root, "--search", search, "--want", "runc")[0] == "runc"
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("memory\n")
    assert choice("--cgroup-root", str(v2), "--search", search, "--want", "runc")[:2] == (
        "runc", str(tmp_path / "bin" / "runc"))
    bad = pick("--want", "youki")
    assert bad.returncode == 2 and "crun or runc" in bad.stderr


def test_choice_on_this_host_matches_its_mounts():
    """The helper's layout of the real /sys/fs/cgroup is what statfs and mountinfo say."""
    if not os.path.isdir("/sys/fs/cgroup"):
        pytest.skip("no /sys/fs/cgroup")
    runtime, path, layout, why = choice()
    fs = subprocess.run(["stat", "-fc", "%T", "/sys/fs/cgroup"], capture_output=True, text=True).stdout.strip()
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mounts[fields[4]] = fields[fields.index("-") + 1]
    mode = layout.split()[0]
    if fs == "cgroup2fs":
        assert mode == "v2" and mounts.get("/sys/fs/cgroup") == "cgroup2"
    elif mounts.get("/sys/fs/cgroup/unified") == "cgroup2":
        assert mode == "hybrid"
        with open("/sys/fs/cgroup/unified/cgroup.controllers") as f:
            assert layout.split()[1:] == f.read().split()
    elif any(kind == "cgroup" for kind in mounts.values()):
        assert mode == "v1"
    if len(layout.split()) > 1:  # hybrid with controllers on v2: never crun
        assert runtime == "runc" and "crun refuses" in why
    if path != "-":
        assert path == shutil.which(runtime, path=os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin")


def run_bundle(runtime_path: str, tmp_path) -> subprocess.CompletedProcess:
    """An OCI bundle whose rootfs is the host's /usr (read-only), run in the foreground."""
    bundle = tmp_path / f"bundle-{os.path.basename(runtime_path)}"
    rootfs = bundle / "rootfs"
    (rootfs / "usr").mkdir(parents=True)
    for name in ("bin", "lib", "lib64", "sbin"):
        if os.path.isdir(f"/usr/{name}"):
            (rootfs / name).symlink_to(f"usr/{name}")
    subprocess.run([runtime_path, "spec"], cwd=bundle, check=True, capture_output=True, timeout=30)
    config = json.loads((bundle / "config.json").read_text())
    config["process"]["terminal"] = False
    config["process"]["args"] = ["/bin/sh", "-c", "echo ran-in-container"]
    config["mounts"].append({"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]})
    (bundle / "config.json").write_text(json.dumps(config))
    name = f"memqos-test-{uuid.uuid4().hex[:12]}"
    try:
        return subprocess.run([runtime_path, "run", "--bundle", str(bundle), name],
                              capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run([runtime_path, "delete", "--force", name], capture_output=True, timeout=60)


def test_picked_runtime_runs_a_container_here(tmp_path):
    """The pick for this host runs a container; crun, where the pick refuses it, fails as it says."""
    if os.geteuid() != 0:
        pytest.skip("runs an OCI bundle as root")
    runtime, path, layout, why = choice()
    if path == "-":
        pytest.skip(f"{runtime} is not installed ({why})")
    got = run_bundle(path, tmp_path)
    assert got.returncode == 0 and "ran-in-container" in got.stdout, got.stderr
    crun = shutil.which("crun", path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin")
    refused = pick("--want", "crun")
    if crun and refused.returncode == 1:
        got = run_bundle(crun, tmp_path)
        assert got.returncode != 0 and CRUN_REFUSAL in got.stderr + got.stdout


def test_build_image_refuses_a_runtime_before_building(tmp_path):
    """scripts/build-image asks the helper first: a wrong --runtime stops it before podman runs."""
    got = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build-image"), "--runtime", "youki",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert got.returncode == 1
    assert "--want youki: crun or runc" in got.stderr and "no OCI runtime for podman" in got.stderr
    assert sorted(os.listdir(tmp_path / "out")) == []
    if pick("--want", "crun").returncode == 1:  # this host's cgroups refuse crun
        got = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build-image"), "--runtime", "crun",
                              "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
        assert got.returncode == 1 and "install and use runc" in got.stderr


def test_build_image_without_apt_names_what_to_install(tmp_path):
    """Where podman is missing and apt-get too, the script stops first, naming the Debian packages."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "realpath", "mkdir", "date", "tr", "sed", "ls", "id", "cat"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    got = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build-image"), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    assert got.returncode == 1, got.stderr
    assert "no apt-get: install podman buildah mmdebstrap uidmap" in got.stderr
    runtime, path = choice()[:2]
    assert (f" {runtime} (Debian" in got.stderr) == (path == "-")
