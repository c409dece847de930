"""docs/trace-format.md is executable: its version, its key tables and its example trace are
checked against shim.evidence.trace (the reader and writer) and the recorder's header.

Change a key in the code without the page, or the page without the code, and a test here
fails: the spec and the code cannot drift apart silently."""
from __future__ import annotations

import copy
import gzip
import inspect
import json
import lzma
import re
from pathlib import Path

import pytest

from shim.evidence import trace
from shim.evidence.recorder import shim_header
from shim.evidence.trace import TraceCall, TraceError, TraceHeader, read_trace, write_trace
from shim.tools.replay import replay_settings

SPEC = Path(__file__).resolve().parent.parent / "docs" / "trace-format.md"


# -- reading the page ----------------------------------------------------------------------
def spec_text() -> str:
    return SPEC.read_text(encoding="utf-8")


def jsonl_blocks(text: str) -> list[str]:
    """The bodies of the ```jsonl fenced blocks."""
    return re.findall(r"^```jsonl[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.M | re.S)


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table: (header cells, rows of cells)."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            head = _cells(lines[i])
            rows = []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append((head, rows))
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def key_rows(kind: str) -> dict[str, dict[str, str]]:
    """{key: {column: cell}} from every table whose first column is '<kind> key'."""
    rows: dict[str, dict[str, str]] = {}
    for head, body in tables(spec_text()):
        if head[0] != f"{kind} key":
            continue
        for cells in body:
            m = re.fullmatch(r"`([A-Za-z0-9_.-]+)`", cells[0])
            assert m, f"{kind} table: first cell {cells[0]!r} is not a `key`"
            assert m.group(1) not in rows, f"{kind} key {m.group(1)} listed twice"
            rows[m.group(1)] = dict(zip(head, cells))
    assert rows, f"docs/trace-format.md has no table whose first column is '{kind} key'"
    return rows


def example_lines() -> list[str]:
    blocks = jsonl_blocks(spec_text())
    assert blocks, "docs/trace-format.md has no ```jsonl example"
    return [line for block in blocks for line in block.splitlines() if line.strip()]


# -- what the code writes ------------------------------------------------------------------
def flat_keys(obj: dict, prefix: str = "") -> dict[str, object]:
    """{"node.page_size": 4096, "shim.settings.factor": 0.9, ...}: keys of the header, of its
    objects and of shim.settings (the KubeletConfiguration inside node.kubelet_config and a
    structured setting's value are not the format's business)."""
    out: dict[str, object] = {}
    for k, v in obj.items():
        out[prefix + k] = v
        if isinstance(v, dict) and prefix.count(".") == 0 and prefix + k != "node.kubelet_config" \
                or isinstance(v, dict) and prefix + k == "shim.settings":
            out.update(flat_keys(v, prefix + k + "."))
    return out


def written_header() -> dict:
    """The header `serve --record` writes (shim.app.service.start_recorder builds it this way)."""
    from shim.app.decides import header_settings
    from shim.app.settings import Config

    allocatable = (8 << 30) - (100 << 20)
    settings = header_settings(Config(), {"node-allocatable": allocatable, "factor": 0.9, "page-size": 4096,
                                          "kubelet-version": "1.37"})
    return shim_header(version="0.0.0", mem_total_bytes=8 << 30, page_size=4096, cgroup_driver="systemd",
                       kubelet_config={"kubeReserved": {"memory": "100Mi"}}, allocatable=allocatable,
                       factor=0.9, policy="Hard", cgroup_v2=True, listen="/run/x.sock", upstream="/run/y.sock",
                       methods="default", kubelet_version="1.37", settings=settings)


def written_call() -> dict:
    """A call line with every optional key the writer can produce."""
    return TraceCall(seq=7, start=1795236684.5, duration_ms=1.23456, method="/runtime.v1.RuntimeService/X",
                     request=b"\x0a\x02v1", forwarded=b"\x0a\x02v2", responses=[b"", b"\x08\x01"],
                     code="OK", details="", truncated=True).to_json()


# -- reading with a probe: which keys does the reader look at? ------------------------------
class Probe(dict):
    """A dict that notes every key looked up in it (get, [], in)."""

    def __init__(self, data: dict, prefix: str, seen: set[str]):
        super().__init__(data)
        self._prefix, self._seen = prefix, seen

    def _note(self, key):
        self._seen.add(self._prefix + str(key))

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)


def probed_header(obj: dict, seen: set[str]) -> Probe:
    data = dict(obj)
    for sub in ("node", "shim"):
        if isinstance(data.get(sub), dict):
            inner = dict(data[sub])
            if sub == "shim" and isinstance(inner.get("settings"), dict):
                inner["settings"] = Probe(inner["settings"], "shim.settings.", seen)
            data[sub] = Probe(inner, sub + ".", seen)
    return Probe(data, "", seen)


def header_keys_read() -> set[str]:
    """Header keys read by the reader and by what uses the header (replay's settings)."""
    from shim.tools.replay import replay_settings

    seen: set[str] = set()
    header = trace.parse_header(probed_header(written_header(), seen))
    for prop in ("created", "source", "node", "mem_total_bytes", "page_size", "cgroup_driver",
                 "kubelet_config", "shim"):
        getattr(header, prop)
    replay_settings(header)
    return seen


def call_keys_read() -> set[str]:
    seen: set[str] = set()
    trace.parse_call(Probe(written_call(), "", seen), "probe")
    # A call line is checked for "format" only to refuse a second header (the page says so).
    seen.discard("format")
    return seen


# -- the tests -----------------------------------------------------------------------------
def test_version_on_the_page_is_the_code_version():
    text = spec_text()
    title = re.search(r"^# .*version (\d+)\s*$", text, flags=re.M)
    assert title, "the page's title must name the version"
    assert int(title.group(1)) == trace.VERSION
    stated = re.search(r"^Format name: `([^`]+)`\. Version: \*\*(\d+)\*\*\.", text, flags=re.M)
    assert stated, "the page must state 'Format name: `...`. Version: **N**.'"
    assert stated.group(1) == trace.FORMAT
    assert int(stated.group(2)) == trace.VERSION
    header = json.loads(example_lines()[0])
    assert header["format"] == trace.FORMAT and header["version"] == trace.VERSION


def test_example_reads_without_problems(tmp_path):
    lines = example_lines()
    path = tmp_path / "example.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    t = read_trace(str(path))
    assert t.problems == []
    assert len(t.calls) == len(lines) - 1 >= 2
    assert t.header.raw == json.loads(lines[0])
    assert t.header.mem_total_bytes and t.header.page_size and t.header.cgroup_driver
    for call, line in zip(t.calls, lines[1:]):
        obj = json.loads(line)
        assert call.seq == obj["seq"] and call.method == obj["method"] and call.code == obj["code"]
        assert call.method.startswith("/runtime.v1.")


def test_example_protobuf_decodes_with_the_projects_proto(tmp_path):
    """The example's bytes are real CRI messages, not placeholders."""
    from shim.tools.trace_view import call_view

    path = tmp_path / "example.jsonl"
    path.write_text("\n".join(example_lines()) + "\n", encoding="utf-8")
    for call in read_trace(str(path)).calls:
        shown = call_view(call)
        assert shown["decoded_as"], shown
        for msg in [shown["request"], *shown["responses"]]:
            assert "_error" not in msg and "_unknown_fields" not in msg, shown


def test_example_written_back_gives_the_same_objects(tmp_path):
    lines = example_lines()
    src = tmp_path / "example.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    t = read_trace(str(src))
    out = tmp_path / "again.jsonl"
    write_trace(str(out), t.header.raw, t.calls)
    again = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert again == [json.loads(line) for line in lines]
    # and byte for byte: the example is in the writer's own key order and spacing
    assert out.read_text(encoding="utf-8").splitlines() == lines


def test_every_key_the_writer_emits_is_in_the_spec():
    header = set(flat_keys(written_header()))
    calls = set(written_call())
    assert header - set(key_rows("header")) == set(), "header keys written but not in docs/trace-format.md"
    assert calls - set(key_rows("call")) == set(), "call keys written but not in docs/trace-format.md"


def test_every_key_the_reader_reads_is_in_the_spec():
    assert header_keys_read() - set(key_rows("header")) == set()
    assert call_keys_read() - set(key_rows("call")) == set()


def test_every_key_in_the_spec_is_written_or_read():
    header = set(flat_keys(written_header())) | header_keys_read()
    calls = set(written_call()) | call_keys_read()
    assert set(key_rows("header")) - header == set(), "docs list header keys the code neither writes nor reads"
    assert set(key_rows("call")) - calls == set(), "docs list call keys the code neither writes nor reads"


def test_plain_make_header_writes_the_keys_marked_always():
    """What any writer using make_header() produces is exactly the rows marked 'always'."""
    plain = set(flat_keys(trace.make_header(source="x", mem_total_bytes=1, page_size=4096,
                                            cgroup_driver="cgroupfs", kubelet_config=None)))
    always = {k for k, row in key_rows("header").items() if row["written by the shim's recorder"] == "always"}
    assert plain == always


def test_call_keys_marked_always_are_in_every_written_line():
    minimal = TraceCall(seq=1, start=1.0, duration_ms=0.0, method="/a/B", request=b"").to_json()
    rows = key_rows("call")
    always = {k for k, row in rows.items() if row["written by the shim's recorder"] == "always"}
    assert set(minimal) == always


_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "number or null": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "base64 string": lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9+/]*={0,2}", v) is not None,
    "list of base64 strings": lambda v: isinstance(v, list) and all(
        isinstance(x, str) and re.fullmatch(r"[A-Za-z0-9+/]*={0,2}", x) for x in v),
}


def test_written_values_have_the_types_the_spec_says():
    for kind, written in (("header", flat_keys(written_header())), ("call", written_call())):
        for key, row in key_rows(kind).items():
            assert row["type"] in _TYPES, f"{kind} key {key}: unknown type {row['type']!r} in the table"
            if key in written:
                assert _TYPES[row["type"]](written[key]), f"{kind} key {key}: {written[key]!r} is not {row['type']}"


def _read_call_line(obj: dict, tmp_path) -> None:
    path = tmp_path / "one.jsonl"
    header = json.loads(example_lines()[0])
    # the call line is not the last line, so a broken one is never excused as "cut short"
    filler = written_call()
    path.write_text(json.dumps(header) + "\n" + json.dumps(obj) + "\n" + json.dumps(filler) + "\n",
                    encoding="utf-8")
    read_trace(str(path))


@pytest.mark.parametrize("key", sorted(key_rows("call")))
def test_required_column_matches_the_reader_for_call_keys(key, tmp_path):
    row = key_rows("call")[key]
    line = written_call()
    line.pop(key, None)
    if row["required by readers"] == "yes":
        with pytest.raises(TraceError):
            _read_call_line(line, tmp_path)
    else:
        assert row["required by readers"] == "no"
        _read_call_line(line, tmp_path)


@pytest.mark.parametrize("key", sorted(k for k in key_rows("header") if "." not in k))
def test_required_column_matches_the_reader_for_header_keys(key):
    row = key_rows("header")[key]
    header = written_header()
    header.pop(key)
    if row["required by readers"] == "yes":
        with pytest.raises(TraceError):
            trace.parse_header(header)
    else:
        assert row["required by readers"] == "no"
        trace.parse_header(header)


def test_nested_header_keys_are_optional_for_the_reader():
    rows = key_rows("header")
    for key in (k for k in rows if "." in k):
        assert rows[key]["required by readers"] == "no", key
        *outer, inner = key.split(".")
        header = copy.deepcopy(written_header())
        where = header
        for name in outer:
            where = where[name]
        where.pop(inner)
        # and replay takes it from elsewhere (replay refuses no capacity unless --mem-total gives one)
        replay_settings(trace.parse_header(header), mem_total=8 << 30 if inner == "mem_total_bytes" else None)


def test_unknown_keys_are_ignored_and_a_cut_last_line_is_skipped(tmp_path):
    """Two reader rules the page states."""
    lines = example_lines()
    header = json.loads(lines[0])
    header["node"]["future_key"] = 1
    header["future"] = {"x": 1}
    call = json.loads(lines[1])
    call["future_key"] = [1, 2]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(call) + "\n" + lines[2][: len(lines[2]) // 2],
                    encoding="utf-8")
    t = read_trace(str(path))
    assert len(t.calls) == 1 and len(t.problems) == 1
    # the same cut line anywhere else is an error
    path.write_text(json.dumps(header) + "\n" + lines[2][: len(lines[2]) // 2] + "\n" + lines[1] + "\n",
                    encoding="utf-8")
    with pytest.raises(TraceError):
        read_trace(str(path))


def test_a_second_header_and_another_version_are_refused(tmp_path):
    lines = example_lines()
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([lines[0], lines[1], lines[0], lines[1]]) + "\n", encoding="utf-8")
    with pytest.raises(TraceError, match="second header"):
        read_trace(str(path))
    header = json.loads(lines[0])
    header["version"] = trace.VERSION + 1
    path.write_text("\n".join([json.dumps(header), lines[1]]) + "\n", encoding="utf-8")
    with pytest.raises(TraceError, match="version"):
        read_trace(str(path))


def test_compression_table_lists_the_three_suffixes():
    suffixes = {row[0] for head, body in tables(spec_text()) if head[0] == "suffix" for row in body}
    assert suffixes == {"`.jsonl`", "`.jsonl.gz`", "`.jsonl.xz`"}


@pytest.mark.parametrize("suffix,opener", [(".jsonl.gz", gzip.open), (".jsonl.xz", lzma.open)])
def test_compressed_example_reads_the_same(suffix, opener, tmp_path):
    text = "\n".join(example_lines()) + "\n"
    plain = tmp_path / "t.jsonl"
    plain.write_text(text, encoding="utf-8")
    packed = tmp_path / ("t" + suffix)
    with opener(packed, "wt", encoding="utf-8") as f:
        f.write(text)
    a, b = read_trace(str(plain)), read_trace(str(packed))
    assert b.problems == [] and b.header.raw == a.header.raw
    assert [c.to_json() for c in b.calls] == [c.to_json() for c in a.calls]


def test_header_object_reads_back_unknown_keys():
    h = TraceHeader(written_header())
    assert h.shim["policy"] == "Hard" and h.node["cgroup_v2"] is True


# -- shim.settings: the deciding settings ------------------------------------------------------
SETTINGS = "shim.settings."


def settings_rows() -> dict[str, dict[str, str]]:
    return {k[len(SETTINGS):]: row for k, row in key_rows("header").items() if k.startswith(SETTINGS)}


def test_the_settings_table_lists_exactly_the_deciding_settings_in_the_tables_order():
    """A setting marked decides=True in OPTIONS is recorded and replayed without more code, but
    not without its row here (name, type, meaning, an example off its default)."""
    from shim.app.decides import DECIDING

    assert list(settings_rows()) == [o.name for o in DECIDING], \
        "docs/trace-format.md's shim.settings table must list every decides=True option of OPTIONS, in order"


@pytest.mark.parametrize("name", sorted(settings_rows()))
def test_a_setting_in_the_header_is_what_replay_applies(name):
    """Each row's example, alone in shim.settings of a kubelet-like header, is replayed with:
    its value parsed as the config file's would be, its origin the trace header, and every other
    deciding setting named in the note of defaults taken."""
    from shim.app.decides import DECIDING, attr

    option = next(o for o in DECIDING if o.name == name)
    example = json.loads(settings_rows()[name]["example"].strip("`"))
    want = option.parse(example)
    assert want != option.default, f"{name}: the example must be off the default"
    header = written_header()
    del header["shim"]
    header["shim"] = {"settings": {name: example}}
    settings = replay_settings(trace.parse_header(header))
    assert getattr(settings.config, attr(option)) == want
    assert settings.origin[name] == "trace header"
    assert name not in settings.defaults
    assert set(settings.defaults) <= {o.name for o in DECIDING} - {name}
    assert "policy" in settings.defaults or name == "policy"


def test_a_header_value_the_setting_refuses_refuses_the_trace_unless_given():
    from shim.app.config import ConfigError  # noqa: F401 - the error replay turns into ReplayError
    from shim.tools.replay import ReplayError

    header = written_header()
    header["shim"]["settings"]["protection-headroom-ratio"] = 1.5
    with pytest.raises(ReplayError, match="shim.settings.protection-headroom-ratio"):
        replay_settings(trace.parse_header(header))
    given = {"protection-headroom-ratio": (0.2, "flag")}
    assert replay_settings(trace.parse_header(header), given=given).config.protection_headroom_ratio == 0.2
