"""`python -m shim.tools.enable_nri`: switch NRI on in the runtime's configuration file, for
containerd 1.7 and CRI-O < 1.30 (both ship it off; containerd 2.x and CRI-O >= 1.30 have it on).

It never restarts the runtime: the change takes effect at the runtime's next restart, which
the operator does (drain the node, `systemctl restart containerd` or `crio`). It edits only
what it must, and refuses (touching nothing) what it cannot edit safely:

- containerd (``etc/containerd/config.toml`` under ``--root``): in a ``version = 2`` or ``3``
  file, ``[plugins."io.containerd.nri.v1.nri"]`` gets ``disable = false`` (an existing
  ``disable`` line in that table is rewritten, else the line is added under the header, else
  the table is appended). A version 3 file (containerd 2.x) without ``disable = true`` is
  already on and left alone. A version 1 file, a file TOML cannot parse, or an edit that does
  not read back as ``disable = false`` is refused. The original is kept once as
  ``config.toml.memqos-shim.bak``; the new text replaces the file by rename.
- CRI-O (``etc/crio``): unless the files CRI-O reads (``crio.conf``, then
  ``crio.conf.d/*.conf`` in order) end with ``enable_nri = true`` in ``[crio.nri]``, the drop-in
  ``crio.conf.d/99-memqos-shim-nri.conf`` is written (last in order, so it wins).

Exit code: 0 when NRI is on in the files (changed now or already), 2 when it refused or
found no runtime configuration; ``--exit-zero`` makes that 0 too (the DaemonSet's init
container uses it so that the plugin still starts: its readiness probe then tells).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

try:
    import tomllib
    TOMLError: type[Exception] = tomllib.TOMLDecodeError
except ModuleNotFoundError:  # Python 3.10: no TOML reader in the standard library
    tomllib = None
    TOMLError = ValueError

NRI_TABLE = "io.containerd.nri.v1.nri"
HEADER = re.compile(r"""^\s*\[\s*plugins\s*\.\s*(?:"io\.containerd\.nri\.v1\.nri"|'io\.containerd\.nri\.v1\.nri')\s*\]\s*(?:#.*)?$""")
ANY_HEADER = re.compile(r"^\s*\[")
DISABLE = re.compile(r"^(\s*)disable\s*=")
CRIO_DROPIN = "99-memqos-shim-nri.conf"
CRIO_TEXT = "# written by memqos-shim (python -m shim.tools.enable_nri): NRI on for the memqos plugin\n" \
            "[crio.nri]\nenable_nri = true\n"
RESTART = "takes effect when {rt} restarts (drain the node, then `systemctl restart {rt}`); nothing was restarted"


def nri_disable(doc: dict) -> object:
    """The ``disable`` value of containerd's NRI table in a parsed config.toml (None: not set)."""
    plugins = doc.get("plugins", {})
    table = plugins.get(NRI_TABLE, {}) if isinstance(plugins, dict) else {}
    return table.get("disable") if isinstance(table, dict) else None


def read_toml(path: str) -> dict:
    """A parsed TOML file; ValueError when it does not parse (or there is no TOML reader)."""
    if tomllib is None:
        raise ValueError("reading TOML needs Python >= 3.11 (tomllib)")
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except TOMLError as e:
            raise ValueError(str(e))


def containerd_text(text: str) -> tuple[str | None, str]:
    """(new text, or None for no change / refused; what was done). Raises ValueError to refuse."""
    if tomllib is None:
        raise ValueError("reading TOML needs Python >= 3.11 (tomllib); edit it by hand")
    try:
        doc = tomllib.loads(text)
    except TOMLError as e:
        raise ValueError(f"not valid TOML ({e}); edit it by hand")
    version = doc.get("version", 1)
    if version not in (2, 3):
        raise ValueError(f"config version {version!r}: only version 2 (containerd 1.7) and 3 (2.x) files are edited")
    current = nri_disable(doc)
    if current is False or (version == 3 and current is None):
        return None, "NRI already on (disable = false" + (", the 2.x default)" if current is None else ")")
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if HEADER.match(ln)), None)
    if start is None:
        sep = "" if not text or text.endswith("\n") else "\n"
        new = f'{text}{sep}\n[plugins."{NRI_TABLE}"]\n  disable = false\n'
        how = f'appended [plugins."{NRI_TABLE}"] disable = false'
    else:
        end = next((i for i in range(start + 1, len(lines)) if ANY_HEADER.match(lines[i])), len(lines))
        at = next((i for i in range(start + 1, end) if DISABLE.match(lines[i])), None)
        if at is None:
            lines.insert(start + 1, "  disable = false\n")
            how = "added disable = false under its NRI table"
        else:
            indent = DISABLE.match(lines[at]).group(1)
            lines[at] = f"{indent}disable = false\n"
            how = "rewrote its NRI table's disable line to false"
        new = "".join(lines)
    try:
        check = nri_disable(tomllib.loads(new))
    except TOMLError as e:
        raise ValueError(f"the edit would not parse ({e}); edit it by hand")
    if check is not False:
        raise ValueError(f"the edit does not read back as disable = false (NRI set elsewhere, e.g. inline); "
                         "edit it by hand")
    return new, how


def _replace(path: str, text: str) -> None:
    """``path`` replaced by ``text`` through a new file of a unique name beside it (created with
    O_EXCL, so nothing already there is truncated or written through), with ``path``'s mode."""
    st = os.stat(path) if os.path.exists(path) else None
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".memqos-shim.tmp",
                               dir=os.path.dirname(path) or ".")
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, st.st_mode & 0o7777 if st is not None else 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def enable_containerd(root: str) -> tuple[bool, str]:
    """(NRI on in the file now, message)."""
    path = os.path.join(root, "etc/containerd/config.toml")
    if not os.path.isfile(path):
        return False, (f"containerd: no {path}: containerd 2.x runs NRI by default; on 1.7 write a version = 2 "
                       f'config.toml with [plugins."{NRI_TABLE}"] disable = false by hand')
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        new, how = containerd_text(text)
    except ValueError as e:
        return False, f"containerd: {path} left unchanged: {e}"
    if new is None:
        return True, f"containerd: {path}: {how}"
    backup = f"{path}.memqos-shim.bak"
    if not os.path.lexists(backup):  # a new file only: never one written through a symlink or over another
        fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
    _replace(path, new)
    return True, f"containerd: {path}: {how} (original in {backup}); " + RESTART.format(rt="containerd")


def crio_effective(root: str) -> tuple[object, list[str]]:
    """(the last enable_nri value CRI-O reads from its files, or None; the files read)."""
    if tomllib is None:
        raise OSError("reading TOML needs Python >= 3.11 (tomllib)")
    etc = os.path.join(root, "etc/crio")
    files = [os.path.join(etc, "crio.conf")]
    d = os.path.join(etc, "crio.conf.d")
    if os.path.isdir(d):
        files += [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith(".conf")]
    value, read = None, []
    for p in files:
        if not os.path.isfile(p):
            continue
        read.append(p)
        with open(p, "rb") as f:
            doc = tomllib.load(f)
        v = doc.get("crio", {}).get("nri", {}).get("enable_nri")
        if v is not None:
            value = v
    return value, read


def enable_crio(root: str) -> tuple[bool, str]:
    try:
        value, read = crio_effective(root)
    except (OSError, TOMLError) as e:
        return False, f"cri-o: a configuration file does not parse ({e}); nothing written"
    if not read:
        return False, f"cri-o: no crio.conf or crio.conf.d/*.conf under {os.path.join(root, 'etc/crio')}"
    if value is True:
        return True, f"cri-o: enable_nri = true already ({', '.join(read)})"
    d = os.path.join(root, "etc/crio/crio.conf.d")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, CRIO_DROPIN)
    _replace(path, CRIO_TEXT)
    return True, f"cri-o: wrote {path} ([crio.nri] enable_nri = true); " + RESTART.format(rt="crio")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shim.tools.enable_nri", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/", help="where the host's /etc is (the init container mounts it at /host)")
    p.add_argument("--runtime", choices=["auto", "containerd", "crio"], default="auto",
                   help="auto: every runtime whose configuration files exist")
    p.add_argument("--nri-socket", default="/var/run/nri/nri.sock",
                   help="reported on: present means the runtime already runs NRI")
    p.add_argument("--exit-zero", action="store_true", help="exit 0 even when nothing could be enabled")
    args = p.parse_args(argv)
    results = []
    if args.runtime in ("auto", "containerd") and (
            args.runtime == "containerd" or os.path.isfile(os.path.join(args.root, "etc/containerd/config.toml"))):
        results.append(enable_containerd(args.root))
    crio_dir = os.path.join(args.root, "etc/crio")
    if args.runtime == "crio" or (args.runtime == "auto" and (
            os.path.isfile(os.path.join(crio_dir, "crio.conf")) or os.path.isdir(os.path.join(crio_dir, "crio.conf.d"))
            and os.listdir(os.path.join(crio_dir, "crio.conf.d")))):
        results.append(enable_crio(args.root))
    if not results:
        results.append((False, f"no containerd or CRI-O configuration under {args.root}: nothing to do"))
    for _, msg in results:
        print(msg)
    sock = "present: the runtime runs NRI now" if os.path.exists(args.nri_socket) else \
        "absent: NRI is not running yet (a runtime restart is needed after an edit)"
    print(f"socket {args.nri_socket}: {sock}")
    ok = all(r[0] for r in results)
    return 0 if ok or args.exit_zero else 2


if __name__ == "__main__":
    sys.exit(main())
