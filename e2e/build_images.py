#!/usr/bin/env python3
"""Build the local images of the real-kernel suite, without a registry or a daemon.

  localhost/busybox:latest  a rootfs with busybox-static (/bin/busybox + applet links)
  localhost/pause:e2e       a static pause binary compiled from e2e/pause.c
  localhost/hog:e2e         a static memory grower compiled from e2e/hog.c (guard scenario)
and, beside the images, OUT_DIR/hog and OUT_DIR/pressure (e2e/pressure.c), the static binaries the
protection benchmark (e2e/guest_pressure.py) runs straight in cgroups.

These are the image names of the recorded kubelet traffic in tests/data/traces (the kubelet
ran with imagePullPolicy: Never and --pod-infra-container-image=localhost/pause:e2e).

Each image is written as an OCI image-layout tarball (plus a docker-archive manifest.json,
so either importer works) for `ctr -n k8s.io images import`. Output is reproducible (fixed
mtimes, sorted entries): the same inputs give the same digests.

Usage: build_images.py OUT_DIR   (stdlib only; needs gcc and /bin/busybox from busybox-static)
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
BUSYBOX = os.environ.get("E2E_BUSYBOX", "/bin/busybox")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _add(tar: tarfile.TarFile, name: str, *, data: bytes | None = None, mode: int = 0o755,
         kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = mode
    info.type = kind
    if kind == tarfile.SYMTYPE:
        info.linkname = link
        tar.addfile(info)
    elif kind == tarfile.DIRTYPE:
        tar.addfile(info)
    else:
        info.size = len(data or b"")
        tar.addfile(info, io.BytesIO(data or b""))


def _layer(files: dict[str, bytes], links: dict[str, str], dirs: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for d in sorted(dirs):
            _add(tar, d, kind=tarfile.DIRTYPE, mode=0o1777 if d == "tmp" else 0o755)
        for name in sorted(files):
            _add(tar, name, data=files[name])
        for name in sorted(links):
            _add(tar, name, kind=tarfile.SYMTYPE, link=links[name], mode=0o777)
    return buf.getvalue()


def _image_tar(path: str, ref: str, layer: bytes, config: dict) -> dict:
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    layer_digest, config_digest = _sha(layer), _sha(config_bytes)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": len(layer)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest_digest = _sha(manifest_bytes)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest, "size": len(manifest_bytes),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": ref,
                            "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]},
        }],
    }
    blob = lambda d: "blobs/sha256/" + d.split(":", 1)[1]  # noqa: E731
    docker_manifest = [{"Config": blob(config_digest), "RepoTags": [ref], "Layers": [blob(layer_digest)]}]
    tmp = path + ".tmp"
    with tarfile.open(tmp, mode="w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, "blobs", kind=tarfile.DIRTYPE)
        _add(tar, "blobs/sha256", kind=tarfile.DIRTYPE)
        for digest, data in sorted(((layer_digest, layer), (config_digest, config_bytes),
                                    (manifest_digest, manifest_bytes))):
            _add(tar, blob(digest), data=data, mode=0o644)
        _add(tar, "index.json", data=json.dumps(index, sort_keys=True).encode(), mode=0o644)
        _add(tar, "manifest.json", data=json.dumps(docker_manifest).encode(), mode=0o644)
        _add(tar, "oci-layout", data=b'{"imageLayoutVersion":"1.0.0"}', mode=0o644)
    os.replace(tmp, path)
    return {"ref": ref, "tar": path, "manifest": manifest_digest, "config": config_digest,
            "layer": layer_digest, "layer_bytes": len(layer)}


def _config(layer: bytes, **cfg) -> dict:
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Env": [PATH_ENV], **cfg},
        "rootfs": {"type": "layers", "diff_ids": [_sha(layer)]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "memqos-shim e2e/build_images.py"}],
    }


BASE_DIRS = ["bin", "dev", "etc", "proc", "sys", "tmp", "var", "run", "root"]


def build_busybox(out: str) -> dict:
    with open(BUSYBOX, "rb") as f:
        busybox = f.read()
    if not busybox.startswith(b"\x7fELF"):
        raise SystemExit(f"{BUSYBOX} is not an ELF binary")
    applets = subprocess.run([BUSYBOX, "--list"], check=True, capture_output=True, text=True).stdout.split()
    links = {f"bin/{a}": "busybox" for a in applets if a and "/" not in a and a != "busybox"}
    files = {
        "bin/busybox": busybox,
        "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
        "etc/group": b"root:x:0:\nnobody:x:65534:\n",
    }
    layer = _layer(files, links, BASE_DIRS)
    return _image_tar(os.path.join(out, "busybox.tar"), "localhost/busybox:latest", layer,
                      _config(layer, Cmd=["sh"]))


def _static(out: str, name: str) -> bytes:
    binary = os.path.join(out, name)
    subprocess.run(["gcc", "-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror", "-o", binary,
                    os.path.join(HERE, f"{name}.c")], check=True)
    with open(binary, "rb") as f:
        return f.read()


def build_pause(out: str) -> dict:
    layer = _layer({"pause": _static(out, "pause")}, {}, ["dev", "etc", "proc", "sys"])
    return _image_tar(os.path.join(out, "pause.tar"), "localhost/pause:e2e", layer,
                      _config(layer, Entrypoint=["/pause"]))


def build_hog(out: str) -> dict:
    layer = _layer({"hog": _static(out, "hog")}, {}, ["dev", "etc", "proc", "sys", "tmp"])
    return _image_tar(os.path.join(out, "hog.tar"), "localhost/hog:e2e", layer,
                      _config(layer, Entrypoint=["/hog"]))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = argv[1]
    os.makedirs(out, exist_ok=True)
    images = [build_busybox(out), build_pause(out), build_hog(out)]
    _static(out, "pressure")  # not an image: the protection benchmark runs it straight in cgroups
    with open(os.path.join(out, "images.json"), "w") as f:
        json.dump(images, f, indent=1)
    for im in images:
        print(f"built {im['ref']}: {im['tar']} (config {im['config'][:19]}, layer {im['layer_bytes']} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
