"""`memqos-shim explain --plot FILE.png`: memory.high against the request for several throttling
factors (KEP-2570's comparison, v1.27 formula), with the old v1.22 formula (limit x factor)
for contrast. Needs matplotlib: ``pip install 'memqos-shim[plot]'``."""
from __future__ import annotations

import math

from shim.decision import memory_high

MI = 2**20
KEP_FACTORS = (0.9, 0.8, 0.6, 0.4)
KEP_LIMIT = 1000 * MI


class PlotUnavailable(RuntimeError):
    pass


def curves(limit: int, factors, page: int, points: int = 201) -> dict:
    """The plotted numbers (MiB), computed with the shim's own formula: {'request': [...],
    'v1.27': {factor: [...]}, 'v1.22': {factor: [...]}}; NaN where memory.high is not set."""
    reqs = sorted({round(limit * i / (points - 1)) for i in range(points)})
    out = {"request": [r / MI for r in reqs], "v1.27": {}, "v1.22": {}}
    for f in factors:
        ys = []
        for r in reqs:
            h = memory_high(r, limit, f, page) if r < limit else 0
            ys.append(h / MI if h > r else math.nan)
        out["v1.27"][f] = ys
        old = (math.floor(limit * f) // page) * page
        out["v1.22"][f] = [old / MI if r < limit else math.nan for r in reqs]
    return out


def write_plot(path: str, *, limit: int = KEP_LIMIT, factors=KEP_FACTORS, page: int = 4096,
               old_factor: float = 0.9, mark: tuple[int, float] | None = None) -> dict:
    """Render the comparison to path (PNG). Returns the curves (for tests); with ``mark``
    (request in bytes, factor) that container is marked and described under ``"mark"``."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # the optional extra
        raise PlotUnavailable("explain --plot needs matplotlib: pip install 'memqos-shim[plot]'") from e

    factors = tuple(sorted(set(factors), reverse=True))
    data = curves(limit, tuple(set(factors) | {old_factor}), page)
    x = data["request"]
    lim = limit / MI
    fig = Figure(figsize=(9, 6.2), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([0, lim], [lim, lim], color="black", linewidth=1.2, linestyle="--", label="memory.max (limit)")
    ax.plot([0, lim], [0, lim], color="grey", linewidth=1.0, linestyle=":", label="request (memory.min)")
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink")
    for i, f in enumerate(factors):
        ax.plot(x, data["v1.27"][f], color=colors[i % len(colors)], linewidth=2,
                label=f"v1.27: req + (limit - req) x {f:g}")
    old = data["v1.22"][old_factor]
    ax.plot(x, old, color="tab:red", linewidth=2, linestyle="-.", label=f"v1.22: limit x {old_factor:g}")
    # where the old formula throttles a container below its own request
    bad = [xi for xi, yi in zip(x, old) if not math.isnan(yi) and yi < xi]
    if bad:
        ax.axvspan(bad[0], lim, color="tab:red", alpha=0.08)
        ax.annotate(f"v1.22: memory.high below the request when\nrequest > {old[0]:.0f}Mi: throttled inside its request",
                    xy=(bad[0], old[0]), xytext=(0.40 * lim, 0.33 * lim), fontsize=8.5, color="tab:red",
                    bbox=dict(boxstyle="round", fc="white", ec="tab:red", alpha=0.9),
                    arrowprops=dict(arrowstyle="->", color="tab:red"))
    # the KEP's table rows (100Mi steps) on the 0.9 curve
    if 0.9 in factors and limit == KEP_LIMIT:
        rows = [(r, memory_high(r * MI, limit, 0.9, MI) / MI) for r in range(0, 1000, 100)]
        ax.scatter([r for r, _ in rows], [h for _, h in rows], s=14, color="tab:blue", zorder=3)
        ax.annotate("factor 0.9: 980 / 990 at request 800 / 900\n(the KEP's table prints 960 / 980)",
                    xy=(800, 980), xytext=(560, 470), fontsize=8.5,
                    bbox=dict(boxstyle="round", fc="white", ec="tab:blue", alpha=0.9),
                    arrowprops=dict(arrowstyle="->", color="tab:blue"))
    if mark is not None:
        request, f = mark
        high = memory_high(request, limit, f, page) if request < limit else 0
        shown = high / MI if high > request else None
        data["mark"] = {"request": request / MI, "factor": f, "high": shown}
        y = shown if shown is not None else lim
        ax.scatter([request / MI], [y], s=90, marker="*", color="black", zorder=5, label="this container")
        ax.annotate(f"request {request / MI:g}Mi: memory.high "
                    f"{f'{shown:g}Mi' if shown is not None else 'not set'} (factor {f:g})",
                    xy=(request / MI, y), xytext=(0.05 * lim, 0.70 * lim), fontsize=8.5,
                    bbox=dict(boxstyle="round", fc="white", ec="black", alpha=0.9),
                    arrowprops=dict(arrowstyle="->", color="black"))
    ax.set_xlim(0, lim)
    ax.set_ylim(0, lim * 1.05)
    ax.set_xlabel("memory request (MiB)")
    ax.set_ylabel("memory.high (MiB)")
    ax.set_title(f"memory.high against request, limit {lim:g}Mi (KEP-2570; not set when request = limit)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return data
