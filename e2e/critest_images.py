#!/usr/bin/env python3
"""Build the images critest v1.26.1 pulls (linux/amd64) into a store e2e/registry.py serves.

critest's specs pull public images from gcr.io and registry.k8s.io. None is reachable from the
real-kernel VM, so these stand-ins are built here, from Debian's busybox and a few small static
C programs, with what each spec looks at (read from the specs of cri-tools v1.26.1):

  registry.k8s.io/e2e-test-images/busybox:1.29-2  the default container: busybox applets as
      hard links in /bin (a masked /bin/ls must not mask /bin/busybox), plus /bin/pgrep and
      /bin/ipcs (-m), which Debian's busybox lacks, as small shell scripts
  registry.k8s.io/e2e-test-images/nginx:1.14-2    e2e/nginx.c as /usr/sbin/nginx on port 80:
      HTTP 200, /var/run/nginx.pid, process name "nginx", command line "nginx: master process"
  gcr.io/k8s-staging-cri-tools/hostnet-nginx-amd64  the same server on port 12003
  registry.k8s.io/e2e-test-images/httpd:2.4.39-4  busybox httpd on port 80, started by a script
      that first prints the command line "httpd -D FOREGROUND" (the log spec looks for it)
  registry.k8s.io/e2e-test-images/nonewprivs:1.3  e2e/nonewprivs.c set-user-ID root: prints
      "Effective uid: N"
  gcr.io/k8s-staging-cri-tools/test-image-*       image-service specs: config User "1002",
      "www-data", "1003:users", "www-data:www-data"; default-user (1000) in the group
      group-defined-in-image (50000); test-image-tags:1/2/3 one image, test-image-1/2/3 three
  registry.k8s.io/pause:3.6 ... 3.10.1            e2e/pause.c, the same image as build_images.py's
      localhost/pause:e2e (same digest), under the sandbox image names containerd defaults to

Not built: gcr.io/k8s-staging-cri-tools/test-image-digest@sha256:9700f9a2...: critest pins it
by the digest of a manifest that only its publisher has.

The shell is Debian's dynamically linked busybox (package busybox, with the host's libc beside
it), not busybox-static: the static build runs applets inside the shell without executing
/bin/<applet>, and the MaskedPaths spec needs `/bin/sh -c ls` to execute the masked /bin/ls
("/bin/sh: ls: Permission denied"). The .deb is BUSYBOX_DEB (--busybox-deb), else the newest
busybox_*.deb in the cache directory (out/cache/debs), else fetched there with
`apt-get download busybox`. Without one, /bin/busybox of busybox-static is used and that spec
fails; the build says so.

Layers are uncompressed tars with fixed mtimes and sorted entries, manifests and configs compact
sorted JSON: the same inputs give the same digests. The store is an OCI image layout
(oci-layout, index.json naming each image by io.containerd.image.name, blobs/sha256/), so
`ctr images import` reads it too.

Usage: critest_images.py OUT_DIR [--busybox-deb FILE] [--static-busybox]
prints one line per image: reference, manifest digest, size (manifest + config + layers).
stdlib only; needs gcc (static libc), ldd and dpkg-deb.
"""
from __future__ import annotations

import argparse
import glob
import io
import json
import os
import re
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build_images  # noqa: E402  (the suite's image helpers: same pause image, same digests)

REPO = os.path.dirname(HERE)
DEFAULT_CACHE = os.path.join(REPO, "out", "cache", "debs")
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
STAGING = "gcr.io/k8s-staging-cri-tools/"
E2E = "registry.k8s.io/e2e-test-images/"
PAUSE_TAGS = ["3.6", "3.7", "3.8", "3.9", "3.10", "3.10.1"]

PASSWD = """root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/bin/false
bin:x:2:2:bin:/bin:/bin/false
sys:x:3:3:sys:/dev:/bin/false
sync:x:4:100:sync:/bin:/bin/sync
mail:x:8:8:mail:/var/spool/mail:/bin/false
www-data:x:33:33:www-data:/var/www:/bin/false
operator:x:37:37:Operator:/var:/bin/false
nobody:x:65534:65534:nobody:/home:/bin/false
"""
GROUP = """root:x:0:
daemon:x:1:
bin:x:2:
sys:x:3:
adm:x:4:
tty:x:5:
disk:x:6:
mail:x:8:
wheel:x:10:
www-data:x:33:
operator:x:37:
users:x:100:
nobody:x:65534:
"""
# test-image-predefined-group: default-user (1000) is also in group-defined-in-image (50000)
PREDEFINED_PASSWD = PASSWD + "default-user:x:1000:1000:default-user:/home/default-user:/bin/sh\n"
PREDEFINED_GROUP = GROUP + "default-user:x:1000:\ngroup-defined-in-image:x:50000:default-user\n"

PGREP = """#!/bin/sh
# pgrep PATTERN: the PIDs of the processes whose name matches PATTERN (extended regular
# expression), this one aside; exit 1 when none. (Debian's busybox has no pgrep.)
[ $# -eq 1 ] || { echo "usage: pgrep PATTERN" >&2; exit 2; }
found=1
for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$pid" = "$$" ] && continue
    name=$(cat "$d/comm" 2>/dev/null) || continue
    if echo "$name" | grep -Eq -- "$1"; then
        echo "$pid"
        found=0
    fi
done
exit $found
"""
IPCS = """#!/bin/sh
# ipcs -m: the System V shared memory segments of this IPC namespace, from /proc/sysvipc/shm
# (which shows the reader's namespace). (Debian's busybox has no ipcs.)
[ "$*" = "-m" ] || { echo "usage: ipcs -m" >&2; exit 2; }
echo "------ Shared Memory Segments --------"
echo "key        shmid      owner      perms      bytes      nattch"
while read -r key shmid perms size cpid lpid nattch uid rest; do
    [ "$key" = key ] && continue
    echo "$key $shmid $uid $perms $size $nattch"
done < /proc/sysvipc/shm
"""
HTTPD_FOREGROUND = """#!/bin/sh
# Starts the web server in the foreground as the Apache httpd image does, first printing the
# command line the httpd image logs at start ("httpd -D FOREGROUND"): busybox httpd serving
# /usr/local/apache2/htdocs on port 80, logging to stderr.
echo "[core:notice] [pid $$] AH00094: Command line: 'httpd -D FOREGROUND'"
exec httpd -f -v -p 80 -h /usr/local/apache2/htdocs
"""
INDEX_HTML = b"<html><body><h1>It works!</h1></body></html>\n"
BASE_DIRS = ["bin", "dev", "etc", "home", "proc", "root", "sys", "tmp", "usr", "usr/local",
             "usr/local/bin", "usr/sbin", "var", "var/run", "var/www"]


# -- layers ----------------------------------------------------------------------------------

def _entry(tar: tarfile.TarFile, name: str, kind: bytes, mode: int, data: bytes = b"",
           link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = mode
    info.type = kind
    info.linkname = link
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    else:
        tar.addfile(info)


def layer(dirs: list[str], files: dict[str, tuple[bytes, int]], hardlinks: dict[str, str]) -> bytes:
    """An uncompressed layer tar: directories, then files (name -> (bytes, mode)), then hard
    links (name -> the file they share), each group sorted; owner root, mtime 0."""
    parents = {os.path.dirname(p) for p in list(files) + list(hardlinks)} - {""}
    every_dir = set(dirs) | parents
    for d in list(every_dir):
        while "/" in d:
            d = os.path.dirname(d)
            every_dir.add(d)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for d in sorted(every_dir):
            _entry(tar, d, tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o700 if d == "root" else 0o755)
        for name in sorted(files):
            data, mode = files[name]
            _entry(tar, name, tarfile.REGTYPE, mode, data)
        for name in sorted(hardlinks):
            _entry(tar, name, tarfile.LNKTYPE, 0o755, link=hardlinks[name])
    return buf.getvalue()


def config(layers: list[bytes], **cfg) -> dict:
    env = cfg.pop("Env", [build_images.PATH_ENV])
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Env": env, **cfg},
        "rootfs": {"type": "layers", "diff_ids": [build_images._sha(lay) for lay in layers]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "memqos-shim e2e/critest_images.py"}
                    for _ in layers],
    }


# -- busybox ------------------------------------------------------------------------------------

def busybox_deb(explicit: str | None, cache: str) -> str | None:
    """The busybox .deb to take the dynamic busybox from (see the module's docstring)."""
    if explicit:
        return explicit
    found = sorted(glob.glob(os.path.join(cache, "busybox_*.deb")))
    if found:
        return found[-1]
    os.makedirs(cache, exist_ok=True)
    try:
        subprocess.run(["apt-get", "download", "-q", "busybox"], cwd=cache, check=True,
                       capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"critest_images: cannot fetch Debian's busybox package ({e})", file=sys.stderr)
        return None
    found = sorted(glob.glob(os.path.join(cache, "busybox_*.deb")))
    return found[-1] if found else None


def _deb_member(deb: str, member: str) -> bytes:
    tar_bytes = subprocess.run(["dpkg-deb", "--fsys-tarfile", deb], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for info in tar:
            if info.name.lstrip("./") == member and info.isfile():
                f = tar.extractfile(info)
                assert f is not None
                return f.read()
    raise SystemExit(f"critest_images: {deb} has no {member}")


def _libraries(binary: str) -> dict[str, bytes]:
    """The shared objects `ldd` lists for BINARY (interpreter included), by their path."""
    out = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
    libs = {}
    for line in out.splitlines():
        m = re.match(r"\s*(?:\S+ => )?(/\S+) \(0x[0-9a-f]+\)$", line)
        if m:
            with open(m.group(1), "rb") as f:
                libs[m.group(1).lstrip("/")] = f.read()
    return libs


def busybox_files(work: str, deb: str | None) -> tuple[dict[str, tuple[bytes, int]], str]:
    """/bin/busybox and the libraries it needs (name -> (bytes, mode)), and what it is."""
    if deb is None:
        with open(build_images.BUSYBOX, "rb") as f:
            return {"bin/busybox": (f.read(), 0o755)}, f"{build_images.BUSYBOX} (static; the MaskedPaths spec fails)"
    path = os.path.join(work, "busybox")
    with open(path, "wb") as f:
        f.write(_deb_member(deb, "bin/busybox"))
    os.chmod(path, 0o755)
    with open(path, "rb") as f:
        files = {"bin/busybox": (f.read(), 0o755)}
    files.update({p: (data, 0o755) for p, data in _libraries(path).items()})
    return files, os.path.basename(deb)


def applets(busybox: str) -> list[str]:
    names = subprocess.run([busybox, "--list"], check=True, capture_output=True, text=True).stdout.split()
    return sorted(a for a in names if re.fullmatch(r"[a-z0-9_.\[-]+", a) and a != "busybox")


# -- the images -----------------------------------------------------------------------------------

class Store:
    """An OCI image layout being written: blobs by digest, one index entry per reference."""

    def __init__(self, out: str):
        self.out = out
        self.index: list[dict] = []
        os.makedirs(os.path.join(out, "blobs", "sha256"), exist_ok=True)

    def blob(self, data: bytes) -> str:
        digest = build_images._sha(data)
        path = os.path.join(self.out, "blobs", "sha256", digest.split(":", 1)[1])
        if not os.path.exists(path):
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
        return digest

    def image(self, refs: list[str], layers: list[bytes], cfg: dict) -> dict:
        cfg_bytes = json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": CONFIG_TYPE, "digest": self.blob(cfg_bytes), "size": len(cfg_bytes)},
            "layers": [{"mediaType": LAYER_TYPE, "digest": self.blob(lay), "size": len(lay)} for lay in layers],
        }
        body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        digest = self.blob(body)
        size = len(body) + len(cfg_bytes) + sum(len(lay) for lay in layers)
        for ref in refs:
            self.index.append({"mediaType": MANIFEST_TYPE, "digest": digest, "size": len(body),
                               "platform": {"architecture": "amd64", "os": "linux"},
                               "annotations": {"io.containerd.image.name": ref,
                                               "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}})
        return {"refs": refs, "digest": digest, "size": size, "config": manifest["config"]["digest"],
                "user": cfg["config"].get("User", "")}

    def finish(self, images: list[dict]) -> None:
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                 "manifests": sorted(self.index, key=lambda d: d["annotations"]["io.containerd.image.name"])}
        for name, data in (("index.json", json.dumps(index, sort_keys=True, indent=1)),
                           ("oci-layout", '{"imageLayoutVersion":"1.0.0"}'),
                           ("images.json", json.dumps(images, sort_keys=True, indent=1))):
            with open(os.path.join(self.out, name + ".tmp"), "w") as f:
                f.write(data + "\n")
            os.replace(os.path.join(self.out, name + ".tmp"), os.path.join(self.out, name))


def titled(name: str, **cfg) -> dict:
    """Config fields that give each repository an image of its own (its own image ID)."""
    labels = {"org.opencontainers.image.title": name}
    return {"Labels": labels, **cfg}


def build(out: str, deb: str | None) -> tuple[list[dict], str]:
    work = os.path.join(out, "work")
    os.makedirs(work, exist_ok=True)
    store = Store(out)
    files, busybox_about = busybox_files(work, deb)
    names = applets(os.path.join(work, "busybox") if deb else build_images.BUSYBOX)
    files.update({"etc/passwd": (PASSWD.encode(), 0o644), "etc/group": (GROUP.encode(), 0o644),
                  "bin/pgrep": (PGREP.encode(), 0o755), "bin/ipcs": (IPCS.encode(), 0o755)})
    links = {f"bin/{a}": "bin/busybox" for a in names if f"bin/{a}" not in files}
    base = layer(BASE_DIRS, files, links)

    def static(name: str) -> bytes:
        return build_images._static(work, name)

    nginx = layer(["var/run", "usr/share/nginx/html"], {"usr/sbin/nginx": (static("nginx"), 0o755),
                  "usr/share/nginx/html/index.html": (INDEX_HTML, 0o644)}, {})
    httpd = layer([], {"usr/local/bin/httpd-foreground": (HTTPD_FOREGROUND.encode(), 0o755),
                       "usr/local/apache2/htdocs/index.html": (INDEX_HTML, 0o644)}, {})
    nnp = layer([], {"usr/local/bin/nnp": (static("nonewprivs"), 0o4755)}, {})
    predefined = layer([], {"etc/passwd": (PREDEFINED_PASSWD.encode(), 0o644),
                            "etc/group": (PREDEFINED_GROUP.encode(), 0o644)}, {})
    nginx_cmd = ["nginx", "-g", "daemon off;"]
    images = [
        store.image([E2E + "busybox:1.29-2"], [base], config([base], Cmd=["sh"])),
        store.image([E2E + "nginx:1.14-2"], [base, nginx],
                    config([base, nginx], Cmd=nginx_cmd, ExposedPorts={"80/tcp": {}}, StopSignal="SIGQUIT")),
        store.image([STAGING + "hostnet-nginx-amd64:latest"], [base, nginx],
                    config([base, nginx], Cmd=nginx_cmd + ["-l", "12003"], ExposedPorts={"12003/tcp": {}},
                           StopSignal="SIGQUIT")),
        store.image([E2E + "httpd:2.4.39-4"], [base, httpd],
                    config([base, httpd], Cmd=["httpd-foreground"], ExposedPorts={"80/tcp": {}})),
        store.image([E2E + "nonewprivs:1.3"], [base, nnp], config([base, nnp], Cmd=["/usr/local/bin/nnp"])),
        store.image([STAGING + "test-image-predefined-group:latest"], [base, predefined],
                    config([base, predefined], **titled("test-image-predefined-group", User="default-user",
                                                        Cmd=["sh"]))),
    ]
    for name, user in (("test-image-user-uid", "1002"), ("test-image-user-username", "www-data"),
                       ("test-image-user-uid-group", "1003:users"),
                       ("test-image-user-username-group", "www-data:www-data")):
        images.append(store.image([f"{STAGING}{name}:latest"], [base],
                                  config([base], **titled(name, User=user, Cmd=["sh"]))))
    for name, tags in (("test-image-latest", ["latest"]), ("test-image-tag", ["test", "all"]),
                       ("test-image-tags", ["1", "2", "3"]), ("test-image-1", ["latest"]),
                       ("test-image-2", ["latest"]), ("test-image-3", ["latest"])):
        images.append(store.image([f"{STAGING}{name}:{t}" for t in tags], [base],
                                  config([base], **titled(name, Cmd=["sh"]))))
    pause = build_images._layer({"pause": static("pause")}, {}, ["dev", "etc", "proc", "sys"])
    images.append(store.image([f"registry.k8s.io/pause:{t}" for t in PAUSE_TAGS], [pause],
                              build_images._config(pause, Entrypoint=["/pause"])))
    store.finish(images)
    return images, busybox_about


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Build critest v1.26.1's images into a registry store.")
    p.add_argument("out", metavar="OUT_DIR")
    p.add_argument("--busybox-deb", default=os.environ.get("BUSYBOX_DEB"),
                   help="Debian's busybox .deb (default: the cache's, else apt-get download)")
    p.add_argument("--cache", default=DEFAULT_CACHE, help="where .debs are kept (default out/cache/debs)")
    p.add_argument("--static-busybox", action="store_true", help="use busybox-static's /bin/busybox")
    args = p.parse_args(argv[1:])
    deb = None if args.static_busybox else busybox_deb(args.busybox_deb, args.cache)
    images, about = build(args.out, deb)
    print(f"# busybox: {about}")
    for im in images:
        for ref in im["refs"]:
            print(f"{ref} {im['digest']} {im['size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
