"""The memory.high guard's open episodes, kept in a small file so that a restarted shim resumes
them.

Without it, a container the guard relaxed (memory.high ``max``) keeps ``max`` after a shim
restart (an upgrade, a crash) until the kubelet updates it or it restarts: the new shim has no
memory of the computed value to restore. With it, the new shim picks the episode up (the
cool-down starts again) and restores memory.high once the container is calm -- or stands down
if someone else wrote memory.high meanwhile, as in any episode.

The file holds what the monitor needs to find the container's cgroup again and the value to
restore; it is written by the monitor's thread only when the set of open episodes changes
(rare), atomically (a new file of a unique name, created with O_EXCL | O_NOFOLLOW, renamed
over the old one), mode 0600. Only an episode file is ever replaced or removed: anything else at
the path (a symlink, a directory, a file that is not a JSON object with ``version`` and
``episodes``) is left as it is and the episodes are kept in memory only (logged). It is read once, at start,
and trusted only if it is a regular file owned by the shim's user and writable by no one else
(a forged file could otherwise make the guard write a tiny memory.high); every entry is checked
(id, sizes, mode, value) and paths are validated like any request data when they are resolved.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
from dataclasses import dataclass

from shim.effects.files import ForeignFile, foreign_json, replace_file

log = logging.getLogger(__name__)

VERSION = 1
MAX_FILE_BYTES = 1 << 20
MAX_EPISODES = 10000
MODES = ("relaxed", "reported")
REF_FIELDS = ("id", "namespace", "pod", "container", "uid", "cgroup_parent", "qos")


@dataclass(frozen=True)
class Episode:
    """One open episode: the container (ContainerRef fields) and the guard's state."""

    ref: dict  # REF_FIELDS -> str
    mode: str  # "relaxed" | "reported"
    restore_high: int | None


def _valid(entry: object) -> Episode | None:
    if not isinstance(entry, dict):
        return None
    ref = entry.get("ref")
    if not isinstance(ref, dict) or set(ref) != set(REF_FIELDS):
        return None
    if not all(isinstance(ref[k], str) and len(ref[k]) <= 4096 for k in REF_FIELDS) or not ref["id"]:
        return None
    mode = entry.get("mode")
    high = entry.get("restore_high")
    if mode not in MODES:
        return None
    if high is not None and (not isinstance(high, int) or isinstance(high, bool) or not 0 < high < 2**63):
        return None
    if mode == "relaxed" and high is None:
        return None
    return Episode(dict(ref), mode, high)


#: the keys that make a JSON file an episode file, whatever its version or entries: the only
#: kind save() replaces or removes
EPISODE_KEYS = ("version", "episodes")


class EpisodeFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.problem = ""  # why the last load() ignored the file or some entries ("" if it did not)

    def load(self) -> list[Episode]:
        """The episodes a previous shim left; [] when there is no file or it cannot be trusted
        (logged; ``problem`` says why)."""
        self.problem = ""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        except OSError as e:
            # a symlink is never followed; the next save renames a file over it
            why = "it is a symbolic link (not followed)" if e.errno == errno.ELOOP else str(e)
            self.problem = f"cannot open it: {why}"
            log.warning("guard episodes: cannot open %s: %s; starting without them", self.path, why)
            return []
        try:
            st = os.fstat(fd)
            why = None
            if not stat.S_ISREG(st.st_mode):
                why = "not a regular file"
            elif st.st_uid != os.geteuid():
                why = f"owned by uid {st.st_uid}, not {os.geteuid()}"
            elif st.st_mode & 0o022:
                why = f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
            elif st.st_size > MAX_FILE_BYTES:
                why = f"{st.st_size} bytes, more than {MAX_FILE_BYTES}"
            if why:
                self.problem = f"ignored: {why}"
                log.warning("guard episodes: ignoring %s: %s", self.path, why)
                return []
            raw = os.read(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
        try:
            doc = json.loads(raw)
        except ValueError as e:
            self.problem = f"ignored: not JSON ({e})"
            log.warning("guard episodes: ignoring %s: not JSON (%s)", self.path, e)
            return []
        if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("episodes"), list):
            self.problem = f"ignored: not a version {VERSION} episode file"
            log.warning("guard episodes: ignoring %s: not a version %d episode file", self.path, VERSION)
            return []
        out = []
        bad = 0
        for entry in doc["episodes"][:MAX_EPISODES]:
            e = _valid(entry)
            if e is None:
                bad += 1
            else:
                out.append(e)
        if bad:
            self.problem = f"{bad} malformed entries ignored"
            log.warning("guard episodes: %d malformed entries in %s ignored", bad, self.path)
        return out

    def save(self, episodes: list[Episode]) -> bool:
        """Replace the file with ``episodes`` (an empty list removes it). False, logged, when
        it cannot be written: the episodes then live in memory only, as without a file."""
        try:
            if not episodes:
                foreign = foreign_json(self.path, EPISODE_KEYS, MAX_FILE_BYTES)
                if foreign:
                    raise ForeignFile(self.path, foreign)
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                return True
            doc = {"version": VERSION, "episodes": [
                {"ref": e.ref, "mode": e.mode, "restore_high": e.restore_high} for e in episodes[:MAX_EPISODES]]}
            replace_file(self.path, json.dumps(doc, separators=(",", ":")).encode(), keys=EPISODE_KEYS,
                         max_bytes=MAX_FILE_BYTES, mode=0o600, make_parent=True)
            return True
        except ForeignFile as e:
            log.warning("guard episodes: %s is %s, not a file the shim wrote: left alone; a restart would "
                        "forget the episodes", self.path, e.what)
            return False
        except OSError as e:
            log.warning("guard episodes: cannot write %s: %s; a restart would forget them", self.path, e)
            return False
