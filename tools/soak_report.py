"""The chaos soak's report (tools/soak.py): request outcomes per second, per-object convergence, and a
timeline plot (faults as spans, outcomes per second, each DynamoModel's convergence).

Pure functions over plain data (times in seconds since the soak started), so that a report can be
rebuilt or re-plotted from its JSON: ``python tools/soak_report.py soak-report.json soak-report.png``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

OUTCOME_SERIES = ("plain:ok", "plain:failed", "stream:ok", "stream:failed")


def outcome_series(outcomes: Sequence[Mapping[str, Any]], seconds: int) -> dict[str, list[int]]:
    """Requests ended in each second (by when they ended), split by streamed / not and ok / not."""
    series = {name: [0] * seconds for name in OUTCOME_SERIES}
    for o in outcomes:
        second = min(seconds - 1, max(0, int(o["ended"])))
        kind = "stream" if o["stream"] else "plain"
        series[f"{kind}:{'ok' if o['result'] == 'ok' else 'failed'}"][second] += 1
    return series


def convergence_times(samples: Sequence[Mapping[str, Any]], since: float) -> dict[str, float | None]:
    """For each object in the last sample: seconds after `since` from which every later sample saw it
    converged (0.0 if it already was at `since`), or None if the last sample did not.

    A sample is ``{"t": seconds, "ok": {name: bool | None}}``: ``ok`` None when the cluster could not be
    read, an object's None when it could not be judged (no evidence either way)."""
    readable = [s for s in samples if s.get("ok") is not None]
    if not readable:
        return {}
    out: dict[str, float | None] = {}
    for name in readable[-1]["ok"]:
        since_ok: float | None = None
        for s in readable:
            ok = s["ok"].get(name, False)
            if ok and since_ok is None:
                since_ok = s["t"]
            elif ok is False:  # None: no evidence either way
                since_ok = None
        out[name] = None if since_ok is None else round(max(0.0, since_ok - since), 1)
    return out


KILLS = ("worker-kill", "pod-delete", "router-kill")  # the faults that end a pod's streams


def unexplained_breaks(
    outcomes: Sequence[Mapping[str, Any]], faults: Sequence[Mapping[str, Any]], slack: float = 2.0
) -> list[Mapping[str, Any]]:
    """Streams that failed while no worker or router was killed: a kill fault (``KILLS``), from its start to its
    end, must overlap the stream, from its start to its end plus ``slack`` s (the client learns of a death a
    little later). A pod deletion takes a moment to kill the process, so a stream the router sent to that pod
    just after the deletion began is still its victim."""
    kills = [(f["at"], f.get("ended", f["at"])) for f in faults if f["kind"] in KILLS]
    return [
        o
        for o in outcomes
        if o["stream"]
        and o["result"] != "ok"
        and not any(at <= o["ended"] + slack and o["started"] <= ended for at, ended in kills)
    ]


def flaps(samples: Sequence[Mapping[str, Any]], since: float) -> list[dict[str, Any]]:
    """Samples taken from ``since`` (when everything had converged) in which some object was not:
    ``{"t", "not_converged": [names]}`` each. Unreadable samples (``ok`` None) are no evidence."""
    out = []
    for s in samples:
        if s["t"] >= since and s.get("ok") is not None:
            bad = sorted(name for name, ok in s["ok"].items() if ok is False)
            if bad:
                out.append({"t": s["t"], "not_converged": bad})
    return out


def plot_timeline(report: Mapping[str, Any], png: Path) -> None:
    """Three panels over the soak's time: the faults (spans, labelled), requests ended per second
    (stacked: ok and failed, streamed and not), and each object's convergence (a row per object:
    green converged, red not, grey unreadable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    faults, samples = report["faults"], report["convergence"]["samples"]
    series = report["outcomes_per_second"]
    seconds = len(series["plain:ok"])
    names = sorted({n for s in samples if s.get("ok") for n in s["ok"]})
    fig, (ax_f, ax_r, ax_c) = plt.subplots(
        3, 1, sharex=True, figsize=(12, 8 + 0.12 * len(names)), height_ratios=[1.2, 2, 1 + 0.08 * len(names)]
    )
    kinds = sorted({f["kind"] for f in faults})
    colours = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(kinds)}
    for i, f in enumerate(faults):
        end = max(f["ended"], f["at"] + 1.0)
        ax_f.axvspan(f["at"], end, ymin=0.1, ymax=0.9, color=colours[f["kind"]], alpha=0.6)
        ax_f.text(f["at"], 0.5 + 0.3 * (i % 2 - 0.5), f["kind"], fontsize=7, rotation=0, va="center")
    ax_f.set_yticks([])
    ax_f.set_title(f"chaos soak, seed {report['seed']}: faults")
    x = list(range(seconds))
    bottom = [0] * seconds
    styles = {"plain:ok": "tab:green", "stream:ok": "tab:olive", "plain:failed": "tab:red",
              "stream:failed": "tab:orange"}  # fmt: skip
    for name in OUTCOME_SERIES:
        values = series[name]
        ax_r.bar(x, values, bottom=bottom, width=1.0, color=styles[name], label=name, align="edge")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax_r.set_ylabel("requests ended / s")
    ax_r.legend(loc="upper right", fontsize=7, ncol=4)
    if names and samples:
        edges = [s["t"] for s in samples] + [samples[-1]["t"] + 1.0]
        grid = [[_cell(s, n) for s in samples] for n in names]
        cmap = ListedColormap(["tab:red", "lightgrey", "tab:green"])
        ax_c.pcolormesh(edges, range(len(names) + 1), grid, cmap=cmap, vmin=0, vmax=2, shading="flat")
        ax_c.set_yticks([i + 0.5 for i in range(len(names))], names, fontsize=6)
    last = report["convergence"].get("last_fault_ended")
    for ax in (ax_f, ax_r, ax_c):
        if last is not None:
            ax.axvline(last, color="black", linestyle="--", linewidth=0.8)
    ax_c.set_title("convergence per DynamoModel (green: Ready, held exactly by its placement; dashed: last fault)")
    ax_c.set_xlabel("seconds since the soak started")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _cell(sample: Mapping[str, Any], name: str) -> float:
    ok = sample.get("ok")
    if ok is None or ok.get(name) is None:
        return 1.0
    return 2.0 if ok[name] else 0.0


def seconds_of(report: Mapping[str, Any]) -> int:
    """How many one-second buckets cover the soak (up to the last outcome, fault or sample)."""
    ends = [o["ended"] for o in report.get("timeline", [])]
    ends += [f["ended"] for f in report.get("faults", [])]
    ends += [s["t"] for s in report.get("convergence", {}).get("samples", [])]
    return int(max(ends, default=0.0)) + 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: soak_report.py REPORT.json OUT.png", file=sys.stderr)
        return 2
    plot_timeline(json.loads(Path(args[0]).read_text()), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
