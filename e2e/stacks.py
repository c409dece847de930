#!/usr/bin/env python3
"""The containerd + runc stacks the real-kernel suite can run (scripts/e2e-vm --stack NAME).

  1.6  the host's own Debian packages (bookworm: containerd 1.6.20, runc 1.1.5), as installed;
  1.7  Debian trixie's containerd 1.7.x and runc 1.1.x;
  2.x  Debian sid's containerd 2.x and runc 1.3.x (whatever sid holds at the time).

For 1.7 and 2.x the .debs are taken from the Debian archive of the host's own apt sources (the
first `/debian` URI there; E2E_DEBIAN_MIRROR overrides it), never installed: the suite's
InRelease is checked with gpgv against the host's Debian keyring, Packages.xz against the
InRelease's SHA256, each .deb against its Packages entry's SHA256, and the .debs are unpacked
with `dpkg-deb -x` into OUT/stacks/NAME/root (cached; `prepare` re-resolves only with
--refresh or when the cache was made for another path).

runc of trixie and sid is built against glibc >= 2.38 (it imports __isoc23_strtol@GLIBC_2.38),
bookworm has 2.36. Such a runc gets the same suite's libc6 and libseccomp2 unpacked beside it
and its ELF interpreter and RUNPATH pointed at them (patchelf): the whole runc process, also
its `runc init` re-exec (which executes the same file), then runs on that suite's glibc. The
binary still comes from the .deb; only its two dynamic-loading fields change. containerd and
containerd-shim-runc-v2 need glibc 2.34 and run as shipped.

    python3 e2e/stacks.py prepare NAME --out OUT [--refresh]   # prints OUT/stacks/NAME/stack.json
    python3 e2e/stacks.py names                                 # the stack names
    python3 e2e/stacks.py deb SUITE PACKAGE --into DIR          # one checked .deb unpacked in DIR
    python3 e2e/stacks.py matrix OUT STACK=CODE...              # the table after several runs
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
ARCH = "amd64"
MULTIARCH = "x86_64-linux-gnu"

STACKS = {
    "1.6": {"source": "host", "containerd": "1.6.", "runc": "1.1.", "config": "containerd.toml.in",
            "about": "the host's Debian bookworm packages"},
    "1.7": {"source": "debian", "suite": "trixie", "containerd": "1.7.", "runc": "1.1.",
            "config": "containerd.toml.in", "about": "Debian trixie's containerd 1.7 and runc 1.1"},
    "2.x": {"source": "debian", "suite": "sid", "containerd": "2.", "runc": "1.3.",
            "config": "containerd-v3.toml.in", "about": "Debian sid's containerd 2.x and runc 1.3"},
}


class StackError(Exception):
    pass


def log(msg: str) -> None:
    print(f"stacks: {msg}", file=sys.stderr, flush=True)


def mirror() -> str:
    """The host's Debian archive URI (deb822 .sources or one-line sources.list)."""
    if os.environ.get("E2E_DEBIAN_MIRROR"):
        return os.environ["E2E_DEBIAN_MIRROR"].rstrip("/")
    files = sorted(glob.glob("/etc/apt/sources.list.d/*.sources")) + ["/etc/apt/sources.list"] + \
        sorted(glob.glob("/etc/apt/sources.list.d/*.list"))
    for path in files:
        try:
            text = open(path).read()
        except OSError:
            continue
        for m in re.finditer(r"^\s*URIs:\s*(\S+)|^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)", text, re.M):
            uri = (m.group(1) or m.group(2)).rstrip("/")
            if uri.startswith(("http://", "https://")) and uri.endswith("/debian"):
                return uri
    raise StackError("no Debian archive URI in /etc/apt/sources.list*: set E2E_DEBIAN_MIRROR")


def fetch(url: str, dest: str) -> None:
    tmp = dest + ".part"
    with urllib.request.urlopen(url, timeout=120) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    os.replace(tmp, dest)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def packages_index(base: str, suite: str, work: str) -> dict[str, dict]:
    """Package name -> its stanza, from a Packages.xz whose hash the signed InRelease gives."""
    inrelease = os.path.join(work, f"{suite}-InRelease")
    fetch(f"{base}/dists/{suite}/InRelease", inrelease)
    p = subprocess.run(["gpgv", "--keyring", KEYRING, inrelease], capture_output=True, text=True)
    if p.returncode != 0:
        raise StackError(f"{suite} InRelease: bad or unknown signature (gpgv against {KEYRING}): {p.stderr.strip()}")
    good = [line.split("Good signature from", 1)[1].strip() for line in p.stderr.splitlines() if "Good signature" in line]
    want = None
    section = None
    for line in open(inrelease, encoding="utf-8", errors="replace"):
        if not line.startswith(" "):
            section = line.split(":", 1)[0]
            continue
        parts = line.split()
        if section == "SHA256" and len(parts) == 3 and parts[2] == f"main/binary-{ARCH}/Packages.xz":
            want = parts[0]
    if not want:
        raise StackError(f"{suite} InRelease lists no SHA256 for main/binary-{ARCH}/Packages.xz")
    pxz = os.path.join(work, f"{suite}-Packages.xz")
    fetch(f"{base}/dists/{suite}/main/binary-{ARCH}/Packages.xz", pxz)
    if sha256(pxz) != want:
        raise StackError(f"{suite} Packages.xz: SHA256 {sha256(pxz)} is not the InRelease's {want}")
    index: dict[str, dict] = {}
    for stanza in lzma.open(pxz, "rt", encoding="utf-8", errors="replace").read().split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            if line and not line[0].isspace() and ":" in line:
                k, v = line.split(":", 1)
                fields[k] = v.strip()
        if "Package" in fields:
            index[fields["Package"]] = fields
    index["_signed_by"] = {"InRelease signatures": good}
    return index


def deb(base: str, index: dict, name: str, work: str, root: str) -> dict:
    st = index.get(name)
    if not st:
        raise StackError(f"no package {name} in the index")
    path = os.path.join(work, os.path.basename(st["Filename"]))
    if not os.path.exists(path) or sha256(path) != st["SHA256"]:
        fetch(f"{base}/{st['Filename']}", path)
    got = sha256(path)
    if got != st["SHA256"]:
        raise StackError(f"{st['Filename']}: SHA256 {got} is not the Packages entry's {st['SHA256']}")
    subprocess.run(["dpkg-deb", "-x", path, root], check=True)
    return {"package": name, "version": st["Version"], "filename": st["Filename"], "sha256": got,
            "depends": st.get("Depends", "")}


def run_version(cmd: list[str]) -> tuple[int, str]:
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, (p.stdout + p.stderr).strip()


def glibc_needs(binary: str) -> str:
    """The highest GLIBC_x.y version the binary imports (objdump -T), '' when unknown."""
    try:
        p = subprocess.run(["objdump", "-T", binary], capture_output=True, text=True)
    except FileNotFoundError:
        return ""
    vers = set(re.findall(r"\(GLIBC_([0-9.]+)\)", p.stdout))
    return max(vers, key=lambda v: tuple(int(x) for x in v.split("."))) if vers else ""


def host_glibc() -> str:
    return os.confstr("CS_GNU_LIBC_VERSION").split()[-1]


def prepare_host(spec: dict) -> dict:
    info = {"source": "host packages", "bin_dirs": [], "root": None}
    for tool in ("containerd", "containerd-shim-runc-v2", "runc", "ctr"):
        path = shutil.which(tool)
        if not path:
            raise StackError(f"no {tool} on the host (apt-get install containerd runc)")
        info[tool] = os.path.realpath(path)
    pkgs = []
    for name in ("containerd", "runc"):
        p = subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True)
        pkgs.append({"package": name, "version": p.stdout.strip() or "(not from dpkg)"})
    info["packages"] = pkgs
    return info


def prepare_debian(name: str, spec: dict, stack_dir: str) -> dict:
    base = mirror()
    root = os.path.join(stack_dir, "root")
    work = os.path.join(stack_dir, "debs")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    os.makedirs(work, exist_ok=True)
    log(f"{name}: resolving containerd and runc in {spec['suite']} ({base})")
    index = packages_index(base, spec["suite"], work)
    pkgs = [deb(base, index, n, work, root) for n in ("containerd", "runc")]
    info = {"source": f"Debian {spec['suite']}", "archive": base, "suite": spec["suite"], "root": root,
            "bin_dirs": [os.path.join(root, "usr/bin"), os.path.join(root, "usr/sbin")],
            "signed_by": index["_signed_by"]["InRelease signatures"], "notes": []}
    for tool, rel in (("containerd", "usr/bin/containerd"), ("containerd-shim-runc-v2", "usr/bin/containerd-shim-runc-v2"),
                      ("ctr", "usr/bin/ctr"), ("runc", "usr/sbin/runc")):
        path = os.path.join(root, rel)
        if not os.access(path, os.X_OK):
            raise StackError(f"{name}: {rel} not in the unpacked packages")
        info[tool] = path
    runc = info["runc"]
    rc, out = run_version([runc, "--version"])
    if rc != 0:
        need = glibc_needs(runc)
        if "GLIBC_" not in out:
            raise StackError(f"{name}: {runc} --version fails on this host: {out[-400:]}")
        if not shutil.which("patchelf"):
            raise StackError(f"{name}: runc needs glibc {need} (host {host_glibc()}) and patchelf is missing")
        # the same suite's C library and libseccomp beside it; the loader from that libc6
        pkgs += [deb(base, index, n, work, root) for n in ("libc6", "libseccomp2")]
        libdir = os.path.join(root, "usr/lib", MULTIARCH)
        loader = os.path.join(libdir, "ld-linux-x86-64.so.2")
        if not os.path.exists(loader):
            raise StackError(f"{name}: no {loader} in {spec['suite']}'s libc6")
        subprocess.run(["patchelf", "--set-interpreter", loader, "--set-rpath", libdir, runc], check=True)
        info["notes"].append(
            f"runc imports GLIBC_{need} symbols, the host's glibc is {host_glibc()}: runc runs on {spec['suite']}'s "
            f"libc6 {next(p['version'] for p in pkgs if p['package'] == 'libc6')} and libseccomp2 "
            f"{next(p['version'] for p in pkgs if p['package'] == 'libseccomp2')} unpacked beside it "
            f"(patchelf: interpreter {loader}, RUNPATH {libdir})")
        rc, out = run_version([runc, "--version"])
        if rc != 0:
            raise StackError(f"{name}: patched runc still does not run: {out[-400:]}")
    for tool in ("containerd", "containerd-shim-runc-v2", "ctr"):
        need = glibc_needs(info[tool])
        if need and tuple(map(int, need.split("."))) > tuple(map(int, host_glibc().split("."))):
            raise StackError(f"{name}: {tool} needs glibc {need}, host has {host_glibc()}")
    info["packages"] = pkgs
    return info


def prepare(name: str, out: str, refresh: bool) -> dict:
    if name not in STACKS:
        raise StackError(f"unknown stack {name!r} (one of {', '.join(STACKS)})")
    spec = STACKS[name]
    stack_dir = os.path.join(out, name)
    meta = os.path.join(stack_dir, "stack.json")
    if spec["source"] == "debian" and not refresh and os.path.exists(meta):
        with open(meta) as f:
            info = json.load(f)
        if info.get("root") == os.path.join(stack_dir, "root") and all(
                os.access(info.get(t) or "", os.X_OK) for t in ("containerd", "runc")):
            rc, _ = run_version([info["runc"], "--version"])
            if rc == 0:
                log(f"{name}: cached in {stack_dir} ({', '.join(p['package'] + ' ' + p['version'] for p in info['packages'])})")
                return info
    os.makedirs(stack_dir, exist_ok=True)
    info = prepare_host(spec) if spec["source"] == "host" else prepare_debian(name, spec, stack_dir)
    info.update(name=name, about=spec["about"], config=os.path.join(HERE, spec["config"]),
                host_glibc=host_glibc())
    _, cv = run_version([info["containerd"], "--version"])
    _, rv = run_version([info["runc"], "--version"])
    info["containerd_version"] = cv.split()[2] if len(cv.split()) > 2 else cv
    info["runc_version"] = rv.splitlines()[0].split()[-1] if rv else ""
    info["runc_version_text"] = rv
    for key, prefix in (("containerd_version", spec["containerd"]), ("runc_version", spec["runc"])):
        if not info[key].startswith(prefix):
            raise StackError(f"stack {name}: {key} {info[key]!r} is not {prefix}* ({spec['about']})")
    with tempfile.NamedTemporaryFile("w", dir=stack_dir, delete=False) as f:
        json.dump(info, f, indent=1)
    os.replace(f.name, meta)
    log(f"{name}: containerd {info['containerd_version']}, runc {info['runc_version']} ({info['source']})")
    return info


def unpack_one(suite: str, name: str, into: str) -> dict:
    """One package of SUITE, checked as the stacks' packages are, unpacked into INTO (its .deb
    kept in INTO/debs); INTO/package.json records what it is. Used for tools the tests run that
    the host's release does not ship (kubectl: scripts/install-test-deps)."""
    base = mirror()
    work = os.path.join(into, "debs")
    os.makedirs(work, exist_ok=True)
    info = deb(base, packages_index(base, suite, work), name, work, into)
    info.update(suite=suite, archive=base)
    with open(os.path.join(into, "package.json"), "w") as f:
        json.dump(info, f, indent=1)
    log(f"{name} {info['version']} from {suite} unpacked in {into}")
    return info


def matrix(out: str, codes: list[str]) -> int:
    """After one VM run per stack (scripts/e2e-vm --stack A,B): OUT/matrix.json and one row per
    stack, then the totals. Exit code: the worst of the runs (3 error > 2 boot > 1 fail > 0)."""
    rows, worst = [], 0
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for item in codes:
        name, code = item.rsplit("=", 1)
        code = int(code)
        row = {"stack": name, "exit_code": code, "report": os.path.join(out, name, "report.json")}
        try:
            with open(row["report"]) as f:
                rep = json.load(f)
            st, s, host = rep.get("stack", {}), rep.get("summary", {}), rep.get("host", {})
            row.update({k: st.get(k) for k in ("containerd_version", "runc_version", "cgroup_driver", "kernel", "source")})
            row.update(status=rep.get("status"), wall_s=host.get("wall_s"),
                       **{k: s.get(k, 0) for k in ("passed", "failed", "skipped")})
            for k in totals:
                totals[k] += s.get(k, 0)
        except (OSError, ValueError) as e:
            row.update(status="no report", error=str(e))
        rows.append(row)
        worst = max(worst, {0: 0, 1: 1, 2: 2}.get(code, 3))
    with open(os.path.join(out, "matrix.json"), "w") as f:
        json.dump({"stacks": rows, "totals": totals}, f, indent=1)
    print("== matrix (stack | containerd | runc | driver | kernel | status | passed/failed/skipped | wall)")
    for r in rows:
        print(f"MATRIX {r['stack']} | {r.get('containerd_version')} | {r.get('runc_version')} | {r.get('cgroup_driver')} | "
              f"{r.get('kernel')} | {r['status']} (exit {r['exit_code']}) | {r.get('passed', 0)}/{r.get('failed', 0)}/"
              f"{r.get('skipped', 0)} | {r.get('wall_s')}s")
    print(f"e2e-vm: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return worst


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("name")
    p.add_argument("--out", required=True, help="directory of the stacks (e.g. out/stacks)")
    p.add_argument("--refresh", action="store_true", help="resolve and download again")
    sub.add_parser("names")
    d = sub.add_parser("deb")
    d.add_argument("suite")
    d.add_argument("package")
    d.add_argument("--into", required=True, help="directory to unpack it in (dpkg-deb -x)")
    m = sub.add_parser("matrix")
    m.add_argument("out")
    m.add_argument("codes", nargs="*", help="STACK=EXIT_CODE of each run, in order")
    args = ap.parse_args(argv)
    if args.cmd == "names":
        print(" ".join(STACKS))
        return 0
    if args.cmd == "matrix":
        return matrix(args.out, args.codes)
    if args.cmd == "deb":
        try:
            unpack_one(args.suite, args.package, os.path.abspath(args.into))
        except (StackError, OSError, subprocess.CalledProcessError) as e:
            log(f"ERROR: {e}")
            return 3
        return 0
    try:
        info = prepare(args.name, os.path.abspath(args.out), args.refresh)
    except (StackError, OSError, subprocess.CalledProcessError) as e:
        log(f"ERROR: {e}")
        return 3
    print(os.path.join(os.path.abspath(args.out), args.name, "stack.json"))
    return 0 if info else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
