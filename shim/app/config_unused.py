"""The settings of a config file that a command does not use, named rather than dropped.

Every command that takes ``--config`` (serve, nri, doctor, reset, replay) refuses a key that is
no setting at all (shim.app.config: a typo must not leave a node with defaults), and reads the
file with the same parser as `serve`, so one file can serve them all. A known setting that a
command does not use -- `replay` given the node's own file with `listen` and `audit-log` in it,
`reset` given `factor`, `serve` given the NRI plugin's `nri-socket` -- is named in a note (a
line on stderr, in `serve` and `nri` a log line at start): the command goes on, with nothing
dropped silently. Refusing it instead would make the operator keep one file per command, and
test a rule change with a file that is not the node's (docs/configuration.md).
"""
from __future__ import annotations

from shim.app.config import Option, load_entries


def unused_settings(path: str | None, used: tuple[Option, ...]) -> list[str]:
    """The settings of the config file at ``path`` that a command taking only ``used`` does not
    use, each as the file writes it (``c.yaml:3: listen``). Unknown keys and bad values are
    refused by ``resolve`` before this is asked; a file that cannot be read again gives none."""
    if not path:
        return []
    from shim.app.config_file import ConfigError

    names = {o.name for o in used}
    try:
        entries = load_entries(path)
    except ConfigError:
        return []
    return [value.where for name, value in entries.items() if name not in names]


def unused_note(command: str, path: str | None, used: tuple[Option, ...]) -> str | None:
    """One line naming the config file's settings ``command`` does not use; None when none."""
    unused = unused_settings(path, used)
    if not unused:
        return None
    return f"note: {command} does not use these settings of its config file, left as they are: {'; '.join(unused)}"
