"""Effects: the only code that writes cgroup files (validated paths, write-on-difference, audited)."""
from shim.effects.cgroupfs import MANAGED_FILES, CgroupFS, PathRefused, ValueRefused, Write, parse_value, split_path  # noqa: F401
from shim.effects.layout import CGROUPFS, SYSTEMD, CgroupLayout, detect_driver  # noqa: F401
from shim.effects.container import READ_FILES, RECLAIM_READ_FILES, ContainerCgroups  # noqa: F401
