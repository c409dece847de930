#!/usr/bin/env python3
"""A stand-in for systemctl in the unit tests: the subcommands the shim (and the tests) use,
with systemctl's arguments and its failure modes, acting on a fake cgroup tree the way
systemd acts on /sys/fs/cgroup.

State (JSON, path in $FAKE_SYSTEMD_STATE):
  {"root": cgroup root, "units": {unit: cgroup path relative to root},
   "props": {unit: {property: value}}, "calls": [argv, ...], "bus": true}

  systemctl set-property [--runtime] [--] UNIT PROP=VALUE...
      MemoryMin/MemoryLow/MemoryMax/CPUWeight only; sizes must be bytes, "infinity" or K/M/G
      suffixed; stores the properties and writes memory.min / memory.low of the unit's cgroup
      (systemd applies what it is told). A service or scope systemd does not know: "Unit UNIT
      not found."; a slice it does not know is loaded on the spot, gets the property and a
      cgroup (what systemd 252 did in the systemd guest, report["systemd"]["systemctl_failures"])
  systemctl daemon-reload
      re-applies every loaded unit's memory.min / memory.low from its properties (0 when
      unset): what systemd does to values written behind its back
  systemctl show -p PROP --value UNIT
  "bus": false  -> every call fails as without a system bus
"""
from __future__ import annotations

import json
import os
import re
import sys

FILES = {"MemoryMin": "memory.min", "MemoryLow": "memory.low"}
KNOWN = {"MemoryMin", "MemoryLow", "MemoryMax", "CPUWeight"}
_SIZE = re.compile(r"^(\d+)([KMGT]?)$")


def fail(msg: str, code: int = 1) -> None:
    print(msg, file=sys.stderr)
    sys.exit(code)


def parse_size(prop: str, text: str) -> int | str:
    if prop == "CPUWeight":
        if text.isdigit() and 1 <= int(text) <= 10000:
            return int(text)
        fail(f"Failed to parse {prop}={text}: Invalid argument")
    if text == "infinity":
        return text
    m = _SIZE.match(text)
    if not m:
        fail(f"Failed to parse {prop}={text}: Invalid argument")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2)]


def apply(state: dict, unit: str) -> None:
    path = os.path.join(state["root"], state["units"][unit])
    props = state["props"].get(unit, {})
    for prop, file in FILES.items():
        f = os.path.join(path, file)
        if os.path.exists(f):
            with open(f, "w") as fh:
                fh.write(f"{props.get(prop, 0)}\n")


def main(argv: list[str]) -> int:
    path = os.environ["FAKE_SYSTEMD_STATE"]
    with open(path) as f:
        state = json.load(f)
    state.setdefault("calls", []).append(argv)
    try:
        if not state.get("bus", True):
            fail("Failed to connect to bus: No such file or directory")
        if not argv:
            fail("fake systemctl: no command")
        cmd, rest = argv[0], argv[1:]
        if cmd == "set-property":
            args = [a for a in rest if a not in ("--runtime", "--")]
            if len(args) < 2:
                fail("Too few arguments.")
            unit, assignments = args[0], args[1:]
            parsed = {}
            for a in assignments:
                prop, eq, value = a.partition("=")
                if not eq:
                    fail(f"Not an assignment: {a}")
                if prop not in KNOWN:
                    fail(f"Unknown assignment: {a}")
                parsed[prop] = parse_size(prop, value)
            if unit not in state["units"]:
                if not unit.endswith(".slice"):
                    fail(f"Failed to set unit properties on {unit}: Unit {unit} not found.")
                words = unit[: -len(".slice")].split("-")
                where = "/".join("-".join(words[: i + 1]) + ".slice" for i in range(len(words)))
                state["units"][unit] = where
                d = os.path.join(state["root"], where)
                os.makedirs(d, exist_ok=True)
                for file in FILES.values():
                    if not os.path.exists(os.path.join(d, file)):
                        with open(os.path.join(d, file), "w") as fh:
                            fh.write("0\n")
            state.setdefault("props", {}).setdefault(unit, {}).update(parsed)
            apply(state, unit)
        elif cmd == "daemon-reload":
            for unit in state["units"]:
                apply(state, unit)
        elif cmd == "show":
            if len(rest) != 4 or rest[0] != "-p" or rest[2] != "--value":
                fail("fake systemctl: only 'show -p PROP --value UNIT'")
            print(state.get("props", {}).get(rest[3], {}).get(rest[1], 0))
        else:
            fail(f"Unknown command verb {cmd}.")
        return 0
    finally:
        with open(path, "w") as f:
            json.dump(state, f)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
