"""e2e/registry.py: the read-only OCI registry the real-kernel VM's critest run pulls from, run
as its CLI on a real socket and asked over HTTP/1.1 (urllib and http.client), over a small store
written with e2e/critest_images.py's Store."""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "e2e"))

import critest_images  # noqa: E402

REGISTRY = os.path.join(ROOT, "e2e", "registry.py")
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def write_store(out: str) -> dict[str, dict]:
    """Three images: one under two tags, and one path under two registry hosts."""
    store = critest_images.Store(out)
    lay1 = critest_images.layer(["etc"], {"etc/one": (b"one\n", 0o644)}, {})
    lay2 = critest_images.layer(["etc"], {"etc/two": (b"two\n", 0o644)}, {})
    images = {
        "tags": store.image(["gcr.io/k8s-staging-cri-tools/test-image-tags:1",
                             "gcr.io/k8s-staging-cri-tools/test-image-tags:2"], [lay1],
                            critest_images.config([lay1], User="1002")),
        "gcr": store.image(["gcr.io/shared/name:latest"], [lay1, lay2],
                           critest_images.config([lay1, lay2], Cmd=["sh"])),
        "k8s": store.image(["registry.k8s.io/shared/name:latest"], [lay2],
                           critest_images.config([lay2], Cmd=["true"])),
    }
    store.finish(list(images.values()))
    return images


class Registry:
    def __init__(self, store: str, tmp: str, *extra: str):
        self.log = os.path.join(tmp, "registry.log")
        port_file = os.path.join(tmp, "port")
        self.proc = subprocess.Popen(
            [sys.executable, REGISTRY, "--store", store, "--listen", "127.0.0.1:0", "--log", self.log,
             "--port-file", port_file, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line + self.proc.stderr.read()
        self.port = int(line.rsplit(":", 1)[1])
        with open(port_file) as f:
            assert int(f.read()) == self.port
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> str:
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=30)
        return err

    def get(self, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
        req = urllib.request.Request(self.base + path, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def raw(self, path: str, method: str = "GET") -> tuple[int, bytes]:
        """The path sent as it is (no client normalisation)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.putrequest(method, path, skip_host=False, skip_accept_encoding=True)
            conn.endheaders()
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("store")
    return str(out), write_store(str(out))


@pytest.fixture(scope="module")
def registry(store, tmp_path_factory):
    reg = Registry(store[0], str(tmp_path_factory.mktemp("registry")))
    yield reg
    reg.stop()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def error_code(body: bytes) -> str:
    return json.loads(body)["errors"][0]["code"]


def test_the_base_endpoint_answers(registry):
    status, headers, body = registry.get("/v2/")
    assert (status, body, headers["Docker-Distribution-API-Version"]) == (200, b"{}", "registry/2.0")
    assert registry.get("/v2")[0] == 200


def test_a_manifest_by_tag_with_the_headers_containerd_reads(registry, store):
    want = store[1]["tags"]["digest"]
    for tag in ("1", "2"):
        status, headers, body = registry.get(f"/v2/k8s-staging-cri-tools/test-image-tags/manifests/{tag}?ns=gcr.io")
        assert status == 200
        assert headers["Content-Type"] == MANIFEST
        assert headers["Docker-Content-Digest"] == want == sha(body)
        assert int(headers["Content-Length"]) == len(body)
        assert json.loads(body)["mediaType"] == MANIFEST


def test_head_gives_the_headers_without_a_body(registry, store):
    status, headers, body = registry.get("/v2/k8s-staging-cri-tools/test-image-tags/manifests/1?ns=gcr.io", "HEAD")
    assert (status, body) == (200, b"")
    assert headers["Docker-Content-Digest"] == store[1]["tags"]["digest"]
    assert int(headers["Content-Length"]) > 0


def test_a_manifest_by_digest_and_its_blobs(registry, store):
    digest = store[1]["gcr"]["digest"]
    status, headers, body = registry.get(f"/v2/shared/name/manifests/{digest}?ns=gcr.io")
    assert status == 200 and sha(body) == digest
    manifest = json.loads(body)
    assert len(manifest["layers"]) == 2
    for desc in [manifest["config"], *manifest["layers"]]:
        status, headers, blob = registry.get(f"/v2/shared/name/blobs/{desc['digest']}?ns=gcr.io")
        assert status == 200
        assert sha(blob) == desc["digest"] == headers["Docker-Content-Digest"]
        assert int(headers["Content-Length"]) == len(blob) == desc["size"]
        status, headers, empty = registry.get(f"/v2/shared/name/blobs/{desc['digest']}?ns=gcr.io", "HEAD")
        assert (status, empty, int(headers["Content-Length"])) == (200, b"", desc["size"])


def test_ns_picks_the_registry_host(registry, store):
    gcr = registry.get("/v2/shared/name/manifests/latest?ns=gcr.io")[1]["Docker-Content-Digest"]
    k8s = registry.get("/v2/shared/name/manifests/latest?ns=registry.k8s.io")[1]["Docker-Content-Digest"]
    assert (gcr, k8s) == (store[1]["gcr"]["digest"], store[1]["k8s"]["digest"])
    # without ns: a path two hosts have is ambiguous; the host as the name's first part picks one
    status, _, body = registry.get("/v2/shared/name/manifests/latest")
    assert (status, error_code(body)) == (404, "NAME_UNKNOWN")
    assert registry.get("/v2/gcr.io/shared/name/manifests/latest")[1]["Docker-Content-Digest"] == gcr
    # a path only one host has is found without ns
    assert registry.get("/v2/k8s-staging-cri-tools/test-image-tags/manifests/1")[0] == 200
    # another host than the image's
    status, _, body = registry.get("/v2/k8s-staging-cri-tools/test-image-tags/manifests/1?ns=docker.io")
    assert (status, error_code(body)) == (404, "NAME_UNKNOWN")


@pytest.mark.parametrize("path, status, code", [
    ("/v2/nothing/here/manifests/latest?ns=gcr.io", 404, "NAME_UNKNOWN"),
    ("/v2/k8s-staging-cri-tools/test-image-tags/manifests/9?ns=gcr.io", 404, "MANIFEST_UNKNOWN"),
    ("/v2/k8s-staging-cri-tools/test-image-tags/manifests/sha256:" + "0" * 64 + "?ns=gcr.io", 404, "MANIFEST_UNKNOWN"),
    ("/v2/k8s-staging-cri-tools/test-image-tags/blobs/sha256:" + "0" * 64 + "?ns=gcr.io", 404, "BLOB_UNKNOWN"),
    ("/v2/k8s-staging-cri-tools/test-image-tags/blobs/latest?ns=gcr.io", 400, "DIGEST_INVALID"),
    ("/v2/k8s-staging-cri-tools/test-image-tags/blobs/sha256:" + "A" * 64, 400, "DIGEST_INVALID"),
    ("/v2/Upper/case/manifests/latest", 400, "NAME_INVALID"),
    ("/v2/k8s-staging-cri-tools/test-image-tags/manifests/1?ns=a/b", 400, "NAME_INVALID"),
    ("/v2/k8s-staging-cri-tools/test-image-tags/manifests/.hidden", 400, "MANIFEST_INVALID"),
    ("/v2/_catalog", 404, "NOT_FOUND"),
    ("/index.json", 404, "NOT_FOUND"),
])
def test_unknown_and_malformed_requests_get_distribution_errors(registry, path, status, code):
    got, headers, body = registry.get(path)
    assert (got, error_code(body)) == (status, code)
    assert headers["Content-Type"] == "application/json"


def test_a_blob_of_another_repository_is_not_served(registry, store):
    """Blobs are served through the repositories whose manifests name them."""
    layer2 = json.loads(registry.get("/v2/shared/name/manifests/latest?ns=registry.k8s.io")[2])["layers"][0]["digest"]
    status, _, body = registry.get(f"/v2/k8s-staging-cri-tools/test-image-tags/blobs/{layer2}?ns=gcr.io")
    assert (status, error_code(body)) == (404, "BLOB_UNKNOWN")


@pytest.mark.parametrize("path", [
    "/v2/../index.json",
    "/v2/../../secret",
    "/v2/shared/name/blobs/../../../secret",
    "/v2/../../../etc/passwd/manifests/latest",
    "/v2/shared/name/../../../etc/manifests/latest",
    "/v2/%2e%2e/%2e%2e/etc/passwd/manifests/latest",
    "/v2/shared/name/blobs/sha256:../../index.json",
    "/v2/shared/name/blobs/sha256%3a..%2f..%2findex.json",
    "/v2/shared/name/blobs/..%2f..%2foci-layout",
    "/v2/shared/name/manifests/..%2f..%2findex.json?ns=gcr.io",
    "/v2/shared/name/manifests/latest?ns=..%2f..",
    "/v2//etc/passwd/manifests/latest",
    "/v2/shared/name/blobs/sha256:" + "0" * 64 + "/../../../index.json",
])
def test_path_traversal_attempts_get_nothing(registry, store, path):
    secret = os.path.join(os.path.dirname(store[0]), "secret")
    with open(secret, "w") as f:
        f.write("secret")
    status, body = registry.raw(path)
    assert status in (400, 404), (status, body)
    assert b"secret" not in body and b"imageLayoutVersion" not in body and b"manifests\"" not in body


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_the_registry_is_read_only(registry, method):
    status, body = registry.raw("/v2/k8s-staging-cri-tools/test-image-tags/manifests/1", method)
    assert (status, error_code(body)) == (405, "UNSUPPORTED")


def test_several_requests_on_one_connection(registry, store):
    conn = http.client.HTTPConnection("127.0.0.1", registry.port, timeout=30)
    try:
        for _ in range(3):
            conn.request("GET", "/v2/k8s-staging-cri-tools/test-image-tags/manifests/1?ns=gcr.io")
            r = conn.getresponse()
            assert r.status == 200 and sha(r.read()) == store[1]["tags"]["digest"]
    finally:
        conn.close()


def test_an_oversized_request_line_and_headers_are_refused(store, tmp_path):
    reg = Registry(store[0], str(tmp_path), "--max-line", "256", "--max-header-bytes", "512")
    try:
        assert reg.raw("/v2/" + "a" * 300)[0] == 414
        conn = http.client.HTTPConnection("127.0.0.1", reg.port, timeout=30)
        conn.putrequest("GET", "/v2/")
        conn.putheader("X-Big", "b" * 600)
        conn.endheaders()
        assert conn.getresponse().status == 431
        conn.close()
        assert reg.get("/v2/")[0] == 200
    finally:
        err = reg.stop()
    assert '"oversized_requests": 2' in err


def test_connections_beyond_the_limit_are_closed_and_counted(store, tmp_path):
    reg = Registry(store[0], str(tmp_path), "--max-connections", "2")
    held = [socket.create_connection(("127.0.0.1", reg.port)) for _ in range(2)]
    try:
        extra = socket.create_connection(("127.0.0.1", reg.port))
        extra.sendall(b"GET /v2/ HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            answer = extra.recv(100)
        except ConnectionResetError:
            answer = b""
        extra.close()
        assert answer == b""
        for s in held:
            s.close()
        held = []
        # the slots are free again once the held connections end
        for _ in range(10000):
            try:
                if reg.get("/v2/")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                continue
        else:
            pytest.fail("no connection slot came free")
    finally:
        for s in held:
            s.close()
        err = reg.stop()
    counters = json.loads(err.split("registry: stopped ", 1)[1])
    assert counters["refused_connections"] >= 1  # the waits for a free slot may be refused too
    with open(reg.log) as f:
        assert "connection refused: --max-connections reached" in f.read()


def test_a_store_whose_manifest_does_not_match_its_digest_is_refused(tmp_path):
    out = tmp_path / "bad"
    images = write_store(str(out))
    blob = out / "blobs" / "sha256" / images["tags"]["digest"].split(":")[1]
    blob.write_bytes(blob.read_bytes().replace(b"schemaVersion", b"schemaVersioN"))
    r = subprocess.run([sys.executable, REGISTRY, "--store", str(out), "--listen", "127.0.0.1:0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not match its digest" in r.stderr


def test_a_store_without_an_index_is_refused(tmp_path):
    r = subprocess.run([sys.executable, REGISTRY, "--store", str(tmp_path), "--listen", "127.0.0.1:0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "index.json" in r.stderr
