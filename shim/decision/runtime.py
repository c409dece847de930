"""What the container runtime does with the ``unified`` keys it is sent, by runtime and version.

The behaviour of each runtime release, with the source line it comes from, is the table in
docs/nri-mode.md ("What the runtimes do with unified"); docs/decisions.md ("Runtimes that drop
unified on update") says what the shim does about it. Every switch here names the row it
follows.

The one that matters to the container path: ``UpdateContainerResources``.

* containerd 1.7 and 2.x merge the request's ``unified`` into the container's OCI spec and the
  task update (``opts.WithResources``): the keys reach the kernel.
* CRI-O before 1.36.0 builds the update from cpuset, shares, period, quota, memory limit and
  swap only (``toOCIResources``): ``unified`` is dropped, the kernel keeps the values the
  container was created with. The plugin's ``unified`` of NRI's UpdateContainer goes through the
  same function and is dropped too.
* CRI-O 1.36.0 and later copy ``unified`` on cgroup v2.

A runtime the table does not know, or a CRI-O version that does not parse, is taken to drop
the keys: the shim then checks the kernel after an update and writes what differs, which
costs a few reads where the runtime did apply them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

CONTAINERD = "containerd"
CRIO = "cri-o"
_NAMES = {"containerd": CONTAINERD, "cri-o": CRIO, "crio": CRIO}
# docs/nri-mode.md, "What the runtimes do with unified": CRI-O's toOCIResources copies unified
# from v1.36.0 on (server/container_update_resources.go)
CRIO_APPLIES_UNIFIED_ON_UPDATE = (1, 36, 0)
_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """'1.34.11', 'v2.1.9', '2.1.9+unknown', '1.36.0-rc.1' -> the release's numbers; None otherwise."""
    m = _VERSION.match((text or "").strip())
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


@dataclass(frozen=True)
class Runtime:
    """The runtime as its CRI Version answer (or NRI's Configure) names it."""

    name: str = ""  # as the runtime said it
    version: str = ""

    @property
    def kind(self) -> str:
        """"containerd", "cri-o", or "" for a runtime the table does not know."""
        return _NAMES.get(self.name.strip().lower(), "")

    @property
    def release(self) -> tuple[int, int, int] | None:
        return parse_version(self.version)

    @property
    def known(self) -> bool:
        return bool(self.name)

    def label(self) -> str:
        return f"{self.name} {self.version}".strip() or "unknown runtime"

    def applies_unified_on_update(self) -> bool:
        """Whether UpdateContainerResources (and NRI's UpdateContainer) brings ``unified`` to
        the kernel. False also for a runtime not known (yet): see the module's doc."""
        kind = self.kind
        if kind == CONTAINERD:  # every containerd release with CRI v1 (1.7, 2.x): opts.WithResources
            return True
        if kind == CRIO:
            release = self.release
            return release is not None and release >= CRIO_APPLIES_UNIFIED_ON_UPDATE
        return False

    def why_update_drops(self) -> str:
        """Why the shim writes the keys itself after an update on this runtime (audit records)."""
        kind = self.kind
        if kind == CRIO and self.release is not None:
            return (f"{self.label()}: CRI-O before 1.36.0 leaves unified out of UpdateContainerResources "
                    "(toOCIResources in server/container_update_resources.go)")
        if kind == CRIO:
            return f"{self.label()}: a CRI-O version that does not parse is taken to drop unified on update"
        if not self.known:
            return "runtime not known yet (no Version answer seen): the kernel is checked after the update"
        return f"{self.label()}: a runtime the shim does not know is taken to drop unified on update"
