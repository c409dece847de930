"""The YAML configuration file (--config FILE), read with where each setting is written.

Each top-level key becomes a FileValue: the value as YAML reads it, the key as the user wrote
it (`node_allocatable` or `node-allocatable`), its line, and the scalar's text as written, so
that an error names the setting the way the file spells it ("config.yaml:12: factor: ...") and
a setting whose parser wants the text (an octal mode: YAML reads an unquoted 0600 as 384, and
600 as six hundred) gets it. The line marks are PyYAML's own (the composed nodes' start_mark).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import yaml


class ConfigError(ValueError):
    """A setting or the file cannot be used; the message names the setting as the user wrote
    it: the flag (--factor), or the file, line and key (config.yaml:12: factor)."""


@dataclass(frozen=True)
class FileValue:
    """One setting as the file writes it."""

    value: Any  # as YAML reads it
    key: str  # the key as written
    line: int  # 1-based
    path: str
    text: str | None = None  # a scalar's text as written (without quotes); None for a list or map

    @property
    def where(self) -> str:
        """'config.yaml:12: factor', for an error about this value."""
        return f"{self.path}:{self.line}: {self.key}"


def _scalar_text(node: yaml.Node) -> str | None:
    return node.value if isinstance(node, yaml.ScalarNode) else None


def read_settings_file(path: str, names: Mapping[str, str],
                       not_settings: Mapping[str, str] | None = None) -> dict[str, FileValue]:
    """The settings of the file at ``path`` by setting name. ``names`` maps every key spelling
    the file may use to the setting's name; ``not_settings`` says what to do about a key that is
    known not to be one. ConfigError for anything that keeps the file from being used."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: expected a map of settings (KEY: VALUE lines)")
        pairs = []
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            value = loader.construct_object(value_node, deep=True)
            written = key if isinstance(key, str) else str(_scalar_text(key_node) or key)
            pairs.append((written, key_node.start_mark.line + 1, value, _scalar_text(value_node)))
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not YAML: {e}") from None
    finally:
        loader.dispose()
    unknown = [(key, line) for key, line, _, _ in pairs if key not in names]
    if unknown:
        hints = "".join(f"; {k}: {not_settings[k.replace('_', '-')]}" for k in sorted({k for k, _ in unknown})
                        if not_settings and k.replace("_", "-") in not_settings)
        lines = ", ".join(f"{k} on line {n}" for k, n in unknown)
        raise ConfigError(f"config file {path}: unknown settings {sorted({k for k, _ in unknown})} ({lines}){hints}; "
                        f"known: {list(dict.fromkeys(names.values()))}")
    out: dict[str, FileValue] = {}
    for key, line, value, scalar in pairs:
        name = names[key]
        if name in out:
            first = out[name]
            raise ConfigError(f"{path}:{line}: {key}: set twice (first on line {first.line} as {first.key})")
        out[name] = FileValue(value, key, line, path, scalar)
    return out
