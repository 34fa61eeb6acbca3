"""The report files: report.md and index.html (same sections, same tables) next to the PNG plots.

Sections: counts and what is swept, the best point per metric, the arms side by side (when the config names arms),
every point, the failed and diverged points with their errors, then the plots.
"""
from __future__ import annotations

import html
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kdexp.report.model import Sweep
from kdexp.report.plots import write_plots
from kdexp.track.records import ENDED_BADLY
from kdexp.report.tables import (Table, arms_table, best_lines, best_points, points_table, summary_line, to_html,
                                 to_markdown)

TRACEBACK_LINES = 40  # the tail of error.log shown per failed point


@dataclass
class ReportFiles:
    out_dir: Path
    markdown: Path
    html: Path
    plots: dict[str, Path]


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; a report is meant to be read by others
    os.replace(tmp, path)


def _tail(text: str, n: int = TRACEBACK_LINES) -> str:
    lines = text.rstrip().splitlines()
    return "\n".join((["..."] if len(lines) > n else []) + lines[-n:])


def _sections(sweep: Sweep) -> tuple[list[str], Optional[Table], Table]:
    intro = [summary_line(sweep)]
    if sweep.swept:
        intro.append("Swept: " + ", ".join(sweep.swept))
        for key, others in sweep.aliases.items():
            intro.append(f"{key} also sets: " + ", ".join(others))
    if sweep.fixed:
        intro.append("Common overrides: " + " ".join(f"{k}={v}" for k, v in sweep.fixed.items()))
    return intro, arms_table(sweep), points_table(sweep)


def _failed_title(points) -> str:
    kinds = [k for k in ("failed", "diverged") if any(p.status == k for p in points)]
    return " and ".join(kinds).capitalize() + " points"


def _rel(path: Path, out_dir: Path) -> str:
    return Path(os.path.relpath(path, out_dir)).as_posix()


def render_markdown(sweep: Sweep, plots: dict[str, Path], out_dir: Path) -> str:
    intro, arms, table = _sections(sweep)
    best = best_lines(best_points(sweep))
    md = [f"# kdexp report: {sweep.source}", ""] + [f"{line}  " for line in intro] + [""]
    md += ["## Best points", ""] + ([f"- {b}" for b in best] or ["No finished point has these metrics yet."]) + [""]
    if arms is not None:
        md += [f"## {arms.title}", "", to_markdown(arms), ""]
    md += ["## Points", "", to_markdown(table), ""]
    failed = [p for p in sweep.points if p.status in ENDED_BADLY]
    if failed:
        md += [f"## {_failed_title(failed)}", ""]
        for p in failed:
            md += [f"### {p.name}", "", f"{p.label}: `{p.error}`", ""]
            if p.traceback:
                md += ["```", _tail(p.traceback), "```", ""]
    if plots:
        md += ["## Plots", ""]
        for name, path in plots.items():
            md += [f"### {name}", "", f"![{name}]({_rel(path, out_dir)})", ""]
    return "\n".join(md)


_CSS = """body{font-family:sans-serif;margin:2em;max-width:1400px}
table.kdexp{border-collapse:collapse;margin:1em 0;font-size:0.9em}
table.kdexp th,table.kdexp td{border:1px solid #bbb;padding:3px 8px;text-align:right}
table.kdexp th{background:#eee}table.kdexp td:first-child{text-align:left}
tr.failed td,tr.diverged td{background:#fde2e2}tr.running td{background:#fff6d5}tr.pending td{color:#888}
pre{background:#f6f6f6;padding:0.6em;overflow-x:auto;font-size:0.85em}img{max-width:100%}"""


def render_html(sweep: Sweep, plots: dict[str, Path], out_dir: Path) -> str:
    e = html.escape
    intro, arms, table = _sections(sweep)
    best = best_lines(best_points(sweep))
    body = [f"<h1>kdexp report: {e(sweep.source)}</h1>", "<p>" + "<br>".join(e(x) for x in intro) + "</p>",
            "<h2>Best points</h2>",
            "<ul>" + "".join(f"<li>{e(b)}</li>" for b in best) + "</ul>" if best
            else "<p>No finished point has these metrics yet.</p>"]
    if arms is not None:
        body += [f"<h2>{e(arms.title)}</h2>", to_html(arms)]
    body += ["<h2>Points</h2>", to_html(table)]
    failed = [p for p in sweep.points if p.status in ENDED_BADLY]
    if failed:
        body.append(f"<h2>{_failed_title(failed)}</h2>")
        for p in failed:
            body += [f"<h3>{e(p.name)}</h3>", f"<p>{e(p.label)}: <code>{e(p.error or '')}</code></p>"]
            if p.traceback:
                body.append(f"<pre>{e(_tail(p.traceback))}</pre>")
    if plots:
        body.append("<h2>Plots</h2>")
        for name, path in plots.items():
            body += [f"<h3>{e(name)}</h3>", f'<img src="{e(_rel(path, out_dir))}" alt="{e(name)}">']
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kdexp report</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(sweep: Sweep, out_dir: str | Path, plots: Optional[dict[str, Path]] = None) -> ReportFiles:
    """Plots, report.md and index.html into ``out_dir`` (created); the text files are written atomically.
    ``plots`` = what write_plots(sweep, out_dir) already returned (the notebook draws them first), else drawn here."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if plots is None:
        plots = write_plots(sweep, out_dir)
    md, page = out_dir / "report.md", out_dir / "index.html"
    _atomic_write(md, render_markdown(sweep, plots, out_dir))
    _atomic_write(page, render_html(sweep, plots, out_dir))
    return ReportFiles(out_dir, md, page, plots)
