"""e2e/critest_images.py: the images critest v1.26.1 pulls, as its specs need them (config User,
/etc/passwd and /etc/group, tags that share an image and images that differ, the busybox applets
and commands the specs run, the web server), the store verified by digest, the build
reproducible; and, where containerd and ctr are installed and the tests run as root, a private
containerd pulling one image through a hosts.toml mirror from e2e/registry.py."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "e2e"))

import critest_images  # noqa: E402

STAGING = "gcr.io/k8s-staging-cri-tools/"
E2E = "registry.k8s.io/e2e-test-images/"
BUSYBOX = E2E + "busybox:1.29-2"
IS_ROOT = os.geteuid() == 0
# the commands critest's specs run in the default (busybox) container
SPEC_COMMANDS = ["sh", "echo", "sleep", "top", "ls", "cat", "hostname", "pidof", "id", "touch", "brctl",
                 "netstat", "grep", "chmod", "ping", "mount", "mkdir", "pgrep", "ipcs", "httpd"]


def build(out: str) -> list[str]:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "e2e", "critest_images.py"), out],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("critest-images"))
    lines = build(out)
    with open(os.path.join(out, "index.json")) as f:
        index = json.load(f)
    refs = {d["annotations"]["io.containerd.image.name"]: d for d in index["manifests"]}
    return {"out": out, "lines": lines, "refs": refs}


def blob(store, digest: str) -> bytes:
    with open(os.path.join(store["out"], "blobs", "sha256", digest.split(":", 1)[1]), "rb") as f:
        data = f.read()
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
    return data


def manifest(store, ref: str) -> dict:
    return json.loads(blob(store, store["refs"][ref]["digest"]))


def image_config(store, ref: str) -> dict:
    return json.loads(blob(store, manifest(store, ref)["config"]["digest"]))


def layers(store, ref: str) -> list[tarfile.TarFile]:
    return [tarfile.open(fileobj=io.BytesIO(blob(store, d["digest"]))) for d in manifest(store, ref)["layers"]]


def file_in(store, ref: str, name: str) -> bytes:
    """A file of the image's root filesystem (the last layer that has it)."""
    found = None
    for tar in layers(store, ref):
        try:
            found = tar.extractfile(name).read()
        except KeyError:
            continue
    assert found is not None, f"{ref} has no {name}"
    return found


def members(store, ref: str) -> dict[str, tarfile.TarInfo]:
    out = {}
    for tar in layers(store, ref):
        out.update({m.name: m for m in tar.getmembers()})
    return out


def test_every_image_critest_pulls_is_built(store):
    wanted = {E2E + "busybox:1.29-2", E2E + "nginx:1.14-2", E2E + "httpd:2.4.39-4", E2E + "nonewprivs:1.3",
              STAGING + "hostnet-nginx-amd64:latest", STAGING + "test-image-latest:latest",
              STAGING + "test-image-tag:test", STAGING + "test-image-tag:all",
              STAGING + "test-image-user-uid:latest", STAGING + "test-image-user-username:latest",
              STAGING + "test-image-user-uid-group:latest", STAGING + "test-image-user-username-group:latest",
              STAGING + "test-image-predefined-group:latest", "registry.k8s.io/pause:3.10"}
    wanted |= {f"{STAGING}test-image-{n}:latest" for n in (1, 2, 3)}
    wanted |= {f"{STAGING}test-image-tags:{n}" for n in (1, 2, 3)}
    assert wanted <= set(store["refs"])
    assert not [r for r in store["refs"] if "test-image-digest" in r]  # pinned by a digest we cannot make
    printed = {line.split()[0]: line.split()[1:] for line in store["lines"] if not line.startswith("#")}
    assert set(printed) == set(store["refs"])
    for ref, (digest, size) in printed.items():
        assert digest == store["refs"][ref]["digest"] and int(size) > 0


def test_every_manifest_config_and_layer_matches_its_digest(store):
    for ref, desc in store["refs"].items():
        body = blob(store, desc["digest"])
        assert len(body) == desc["size"]
        m = json.loads(body)
        assert m["mediaType"] == critest_images.MANIFEST_TYPE
        cfg = json.loads(blob(store, m["config"]["digest"]))
        assert (cfg["architecture"], cfg["os"]) == ("amd64", "linux")
        diff_ids = []
        for lay in m["layers"]:
            data = blob(store, lay["digest"])
            assert len(data) == lay["size"]
            diff_ids.append("sha256:" + hashlib.sha256(data).hexdigest())
        assert cfg["rootfs"]["diff_ids"] == diff_ids, ref


def test_tags_of_one_image_share_a_digest_and_the_three_images_differ(store):
    refs = store["refs"]
    assert len({refs[f"{STAGING}test-image-tags:{n}"]["digest"] for n in (1, 2, 3)}) == 1
    configs = {manifest(store, f"{STAGING}test-image-{n}:latest")["config"]["digest"] for n in (1, 2, 3)}
    assert len(configs) == 3
    # each repository is an image of its own (its own image ID), pause aside
    by_repo = {}
    for ref in refs:
        by_repo.setdefault(ref.rsplit(":", 1)[0], set()).add(manifest(store, ref)["config"]["digest"])
    assert all(len(ids) == 1 for ids in by_repo.values())
    ids = [next(iter(v)) for v in by_repo.values()]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name, user", [
    ("test-image-user-uid", "1002"), ("test-image-user-username", "www-data"),
    ("test-image-user-uid-group", "1003:users"), ("test-image-user-username-group", "www-data:www-data"),
    ("test-image-predefined-group", "default-user")])
def test_the_config_user_is_what_image_status_reports(store, name, user):
    """ImageStatus gives Uid for a numeric User, Username otherwise (the part before ':')."""
    assert image_config(store, f"{STAGING}{name}:latest")["config"]["User"] == user


def test_the_users_and_groups_the_specs_resolve(store):
    passwd = file_in(store, BUSYBOX, "etc/passwd").decode().splitlines()
    group = file_in(store, BUSYBOX, "etc/group").decode().splitlines()
    assert "nobody:x:65534:65534:nobody:/home:/bin/false" in passwd  # RunAsUsername: nobody
    assert any(line.startswith("www-data:x:33:33:") for line in passwd)
    assert {"users:x:100:", "www-data:x:33:", "nobody:x:65534:"} <= set(group)
    ref = f"{STAGING}test-image-predefined-group:latest"
    passwd = file_in(store, ref, "etc/passwd").decode().splitlines()
    group = file_in(store, ref, "etc/group").decode().splitlines()
    assert any(line.startswith("default-user:x:1000:1000:") for line in passwd)
    assert "group-defined-in-image:x:50000:default-user" in group


def test_busybox_applets_are_hard_links_and_the_spec_commands_exist(store):
    files = members(store, BUSYBOX)
    assert files["bin/busybox"].isfile()
    # a masked /bin/ls (MaskedPaths spec) must not be a symlink: that would mask /bin/busybox
    assert files["bin/ls"].islnk() and files["bin/ls"].linkname == "bin/busybox"
    missing = [c for c in SPEC_COMMANDS if f"bin/{c}" not in files]
    assert missing == []
    assert not [m for m in files.values() if m.issym()]


def test_the_nonewprivs_program_is_set_user_id_root(store):
    nnp = members(store, E2E + "nonewprivs:1.3")["usr/local/bin/nnp"]
    assert (nnp.mode, nnp.uid) == (0o4755, 0)
    assert image_config(store, E2E + "nonewprivs:1.3")["config"]["Cmd"] == ["/usr/local/bin/nnp"]
    out = subprocess.run([os.path.join(store["out"], "work", "nonewprivs")], capture_output=True, text=True)
    assert out.stdout == f"Effective uid: {os.geteuid()}\n"


def test_the_web_server_images(store):
    nginx = image_config(store, E2E + "nginx:1.14-2")["config"]
    hostnet = image_config(store, STAGING + "hostnet-nginx-amd64:latest")["config"]
    assert nginx["Cmd"] == ["nginx", "-g", "daemon off;"]
    assert hostnet["Cmd"][-2:] == ["-l", "12003"]
    assert members(store, E2E + "nginx:1.14-2")["usr/sbin/nginx"].mode == 0o755
    httpd = image_config(store, E2E + "httpd:2.4.39-4")["config"]["Cmd"]
    script = file_in(store, E2E + "httpd:2.4.39-4", "usr/local/bin/" + httpd[0]).decode()
    assert "httpd -D FOREGROUND" in script and "exec httpd -f" in script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nginx_answers_200_writes_its_pid_and_is_found_by_name(store, tmp_path):
    """What the networking, streaming and security-context specs ask of the nginx process."""
    binary = tmp_path / "nginx"
    shutil.copy(os.path.join(store["out"], "work", "nginx"), binary)
    port, pidfile = free_port(), tmp_path / "nginx.pid"
    proc = subprocess.Popen([str(binary), "-g", "daemon off;", "-l", str(port), "-P", str(pidfile)],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stderr.readline()
        assert int(pidfile.read_text()) == proc.pid
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as r:
            assert r.status == 200 and b"<html>" in r.read()
        assert open(f"/proc/{proc.pid}/comm").read() == "nginx\n"
        assert "master process" in open(f"/proc/{proc.pid}/cmdline").read()
        pidof = subprocess.run(["/bin/busybox", "pidof", "nginx"], capture_output=True, text=True)
        assert str(proc.pid) in pidof.stdout.split()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_the_build_is_reproducible(store, tmp_path):
    assert build(str(tmp_path / "again")) == store["lines"]


# -- in a chroot of the busybox image (root only) --------------------------------------------------

def rootfs(store, ref: str, into) -> str:
    for tar in layers(store, ref):
        tar.extractall(into, filter="fully_trusted")
    return str(into)


def in_chroot(root: str, script: str, *, proc: bool = False) -> subprocess.CompletedProcess:
    """SCRIPT (which chroots into ROOT) in a mount namespace with ROOT/dev/null, and with
    proc=True in a PID namespace of its own with ROOT/proc."""
    setup = f"touch {root}/dev/null && mount --bind /dev/null {root}/dev/null && "
    if proc:
        setup += f"mount -t proc proc {root}/proc && "
    unshare = ["unshare", "-m", "-p", "-f"] if proc else ["unshare", "-m"]
    return subprocess.run(unshare + ["sh", "-c", setup + script], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


needs_root = pytest.mark.skipif(not IS_ROOT or not shutil.which("unshare"), reason="needs root and unshare")


@needs_root
def test_a_masked_ls_fails_as_the_masked_paths_spec_expects(store, tmp_path):
    root = rootfs(store, BUSYBOX, tmp_path / "root")
    if "busybox_" not in store["lines"][0]:
        pytest.skip("built with busybox-static (no busybox .deb): its shell runs ls without /bin/ls")
    r = in_chroot(root, f"mount --bind /dev/null {root}/bin/ls && chroot {root} /bin/sh -c ls")
    assert r.stderr == "/bin/sh: ls: Permission denied\n"


@needs_root
def test_ipcs_and_pgrep_in_the_image(store, tmp_path):
    root = rootfs(store, BUSYBOX, tmp_path / "root")
    shmid = subprocess.run(["ipcmk", "-M", "4096"], capture_output=True, text=True, check=True).stdout.split()[-1]
    try:
        r = in_chroot(root, f"chroot {root} ipcs -m", proc=True)
        assert r.returncode == 0 and shmid in r.stdout.split(), r.stdout + r.stderr
    finally:
        subprocess.run(["ipcrm", "-m", shmid], check=True)
    r = in_chroot(root, f"chroot {root} sh -c 'sleep 1000 & pgrep sleep; kill $!'", proc=True)
    assert r.returncode == 0 and r.stdout.split()[0].isdigit() and r.stderr == ""
    r = in_chroot(root, f"chroot {root} sh -c 'pgrep sleep || true'", proc=True)
    assert (r.stdout, r.stderr) == ("", "")


# -- a private containerd pulls through a hosts.toml mirror ----------------------------------------

@pytest.mark.skipif(not IS_ROOT, reason="needs root (a private containerd)")
def test_containerd_pulls_through_a_hosts_toml_mirror_of_the_registry(store, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_registry import Registry
    from tools import require_tool

    containerd, ctr_bin = require_tool("containerd"), require_tool("ctr")  # scripts/install-test-deps

    reg = Registry(store["out"], str(tmp_path))
    cd = tmp_path / "containerd"
    sock = cd / "containerd.sock"
    (cd / "config.toml").parent.mkdir()
    (cd / "config.toml").write_text(f'''version = 2
root = "{cd}/root"
state = "{cd}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
''')
    hosts = tmp_path / "hosts"
    for host in ("gcr.io", "registry.k8s.io"):
        (hosts / host).mkdir(parents=True)
        (hosts / host / "hosts.toml").write_text(
            f'server = "https://{host}"\n\n[host."http://127.0.0.1:{reg.port}"]\n  capabilities = ["pull", "resolve"]\n')
    daemon = subprocess.Popen([containerd, "--config", str(cd / "config.toml")],
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "containerd.log", "w"))
    ctr = [ctr_bin, "--address", str(sock), "-n", "k8s.io"]
    try:
        for _ in range(600):
            if subprocess.run(ctr + ["version"], capture_output=True).returncode == 0:
                break
            assert daemon.poll() is None, (tmp_path / "containerd.log").read_text()
        for ref in (STAGING + "test-image-tag:test", BUSYBOX):
            r = subprocess.run(ctr + ["images", "pull", "--snapshotter", "native", "--hosts-dir", str(hosts), ref],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
        listed = subprocess.run(ctr + ["images", "ls"], capture_output=True, text=True, check=True).stdout
        rows = {line.split()[0]: line.split()[2] for line in listed.splitlines()[1:]}
        assert rows[STAGING + "test-image-tag:test"] == store["refs"][STAGING + "test-image-tag:test"]["digest"]
        assert rows[BUSYBOX] == store["refs"][BUSYBOX]["digest"]
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        reg.stop()
    with open(reg.log) as f:
        log = f.read()
    assert "/manifests/test?ns=gcr.io" in log and "/manifests/1.29-2?ns=registry.k8s.io" in log
