"""The recorded kubelet traffic this repository carries (``tests/data/traces/``).

The tests, the benchmark (its 110-pod load), the golden replays and the real-kernel suite
read these files; nothing outside the repository is needed. Traces are stored compressed
(``.jsonl.xz``) and read through ``shim.evidence.trace.open_text``, which decompresses
them on the fly. ``tests/data/traces/README.md`` says what each file is.
"""
from __future__ import annotations

from pathlib import Path

from shim.evidence.trace import SUFFIXES, trace_stem

REPO = Path(__file__).resolve().parents[2]
TRACES_DIR = REPO / "tests" / "data" / "traces"

# the two recordings of a real kubelet v1.23 in front of containerd 1.6.20 (cgroupfs driver)
MEMQOS_OFF = "kubelet-1.23-cgroupfs-memqos-off"
MEMQOS_ON = "kubelet-1.23-cgroupfs-memqos-on"
# crictl through the recorder: the only NOT_FOUND, UNIMPLEMENTED and v1alpha2 examples
SMOKE = "recorder-smoke"


def all_traces(directory: Path = TRACES_DIR) -> list[Path]:
    """Every trace file in the directory, plain or compressed, sorted by name."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(SUFFIXES))


def kubelet_traces(directory: Path = TRACES_DIR) -> list[Path]:
    """The recordings of a real kubelet (``kubelet-*``)."""
    return [p for p in all_traces(directory) if p.name.startswith("kubelet-")]


def trace_file(stem: str, directory: Path = TRACES_DIR) -> Path:
    """The file of a trace named by its stem (``kubelet-1.23-cgroupfs-memqos-off``),
    whichever of the accepted suffixes it has. FileNotFoundError names the place looked in."""
    for p in all_traces(directory):
        if trace_stem(p.name) == stem:
            return p
    raise FileNotFoundError(f"no trace {stem} ({' / '.join(SUFFIXES)}) in {directory}")


def data_file(name: str) -> Path:
    """A companion file of the traces: ``manifests``, ``*.cgroups.txt``, ``kubelet-config-*.json``."""
    return TRACES_DIR / name
