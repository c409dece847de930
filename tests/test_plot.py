"""`memqos-shim explain --plot FILE.png`: the PNG is written, its numbers are the reference's,
and without matplotlib the command says which extra to install."""
from __future__ import annotations

import math
import struct
import sys

import pytest

from shim.cli.main import main
from shim.tools.plot import KEP_LIMIT, MI, curves

pytest.importorskip("matplotlib")  # in the test extra; the core install does not need it


def png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(32)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_explain_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "kep.png"
    assert main(["explain", "--plot", str(out), "--page-size", "4096"]) == 0
    w, h = png_size(out)
    assert w >= 800 and h >= 600
    assert out.stat().st_size > 20_000  # lines, labels, legend: not an empty canvas
    assert "wrote" in capsys.readouterr().out


def test_extra_factor_and_limit(tmp_path):
    out = tmp_path / "x.png"
    assert main(["explain", "--plot", str(out), "--limit", "2Gi", "--factor", "0.7"]) == 0
    png_size(out)


def test_curve_numbers_are_the_reference_table():
    # reference section 1, limit 1000Mi, page 1Mi
    c = curves(KEP_LIMIT, (0.9, 0.8, 0.6, 0.4), MI, points=11)
    assert c["request"] == [float(r) for r in range(0, 1001, 100)]
    at = {r: i for i, r in enumerate(range(0, 1001, 100))}
    assert c["v1.27"][0.9][at[0]] == 900 and c["v1.27"][0.9][at[100]] == 910
    assert c["v1.27"][0.9][at[500]] == 950 and c["v1.27"][0.9][at[800]] == 980 and c["v1.27"][0.9][at[900]] == 990
    assert c["v1.27"][0.6][at[500]] == 800 and c["v1.27"][0.6][at[800]] == 920
    assert c["v1.27"][0.8][at[500]] == 900
    assert c["v1.27"][0.4][at[500]] == 700
    assert math.isnan(c["v1.27"][0.9][at[1000]])  # request == limit: not set
    assert c["v1.22"][0.9][at[0]] == 900 and c["v1.22"][0.9][at[900]] == 900  # flat: limit x factor


def test_without_matplotlib_says_which_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    assert main(["explain", "--plot", str(tmp_path / "no.png")]) == 2
    assert "memqos-shim[plot]" in capsys.readouterr().err
    assert not (tmp_path / "no.png").exists()


def test_the_container_asked_about_is_marked(tmp_path, capsys):
    from shim.tools.plot import write_plot

    data = write_plot(str(tmp_path / "m.png"), mark=(500 * MI, 0.9), page=MI)
    assert data["mark"] == {"request": 500.0, "factor": 0.9, "high": 950.0}
    assert "mark" not in write_plot(str(tmp_path / "n.png"), page=MI)
    assert main(["explain", "--plot", str(tmp_path / "e.png"), "--request", "800Mi", "--limit", "1000Mi",
                 "--page-size", "4096"]) == 0
    assert "marked: request 800Mi at factor 0.9: memory.high 980Mi" in capsys.readouterr().out
