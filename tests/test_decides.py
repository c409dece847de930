"""The deciding settings' mark (``decides=True`` in OPTIONS) and what it asks of a setting:
a JSON form that its parser takes back (shim.app.decides)."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from types import MappingProxyType

import pytest

from shim.app.config import OPTIONS
from shim.app.decides import DECIDING, attr, header_settings, json_form, parse_recorded
from shim.app.settings import Config


def test_the_deciding_settings_are_the_marked_ones_and_cover_the_decision():
    assert DECIDING == tuple(o for o in OPTIONS if o.decides)
    # the settings issue 34 names as changing what is decided (more may be marked later)
    assert {"mode", "kubelet-version", "node-allocatable", "factor", "policy", "protection-headroom-ratio",
            "protection-headroom-min", "correct-kubelet-min", "page-size"} <= {o.name for o in DECIDING}
    # paths to files whose content the header's node object carries are not marked
    assert not {"kubelet-config", "meminfo", "cgroup-root"} & {o.name for o in DECIDING}


@pytest.mark.parametrize("option", DECIDING, ids=lambda o: o.name)
def test_a_deciding_settings_default_goes_through_json_and_back(option):
    form = json_form(option.default)
    assert json.loads(json.dumps(form)) == form
    assert parse_recorded(option, form) == option.default


def test_header_settings_are_every_deciding_setting_with_the_resolved_values_over_the_configs():
    cfg = Config(factor="auto", protection_headroom_ratio=0.3)
    written = header_settings(cfg, {"factor": 0.8, "node-allocatable": 10**9})
    assert list(written) == [o.name for o in DECIDING]
    assert written["factor"] == 0.8 and written["node-allocatable"] == 10**9
    assert written["protection-headroom-ratio"] == 0.3 and written["policy"] == "Hard"
    assert json.loads(json.dumps(written)) == written
    assert all(getattr(Config(), attr(o)) == o.default for o in DECIDING)


class Colour(enum.Enum):
    RED = "red"


@dataclass(frozen=True)
class PerContainer:
    low: int
    tags: frozenset


def test_structured_values_have_a_json_form():
    """A mapping setting (class name -> per-container settings) is written as JSON objects."""
    value = MappingProxyType({"gold": PerContainer(low=5, tags=frozenset({"b", "a"})), "x": (Colour.RED, None)})
    assert json_form(value) == {"gold": {"low": 5, "tags": ["a", "b"]}, "x": ["red", None]}
