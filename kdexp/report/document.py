"""The report files: report.md and index.html (same sections, same tables) next to the PNG plots.

Sections: counts and what is swept, the best configuration per metric (and whether it beats the runner-up
significantly), the configurations over seeds and their paired differences (when trainer.seed is swept), the arms
side by side (when the config names arms), every point, the failed and diverged points with their errors, the plots.

While a point is pending or running the page is a live dashboard: it carries ``<meta http-equiv="refresh">`` and a
banner with the progress (kdexp.report.live regenerates it as points finish); the final page has no refresh.
"""
from __future__ import annotations

import html
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kdexp.report.comparisons import configurations_table, differences_table
from kdexp.report.cost import DEFAULT_QUALITY, cost_table
from kdexp.report.model import Sweep
from kdexp.report.plots import write_plots
from kdexp.report.ranges import MIN_INTERVAL_N
from kdexp.report.replicates import TIMING_PREFIXES
from kdexp.track.records import ENDED_BADLY
from kdexp.report.tables import (Table, arms_table, best_lines, best_points, points_table, summary_line, to_html,
                                 to_markdown)

TRACEBACK_LINES = 40  # the tail of error.log shown per failed point
REFRESH_S = 10  # how often a live page reloads itself
DUPLICATES_SHOWN = 12  # folded run dirs named in the intro; the points table names every one
HOW_TO_READ = ("Over replicates (points that differ only in trainer.seed) a cell is mean ± std [95% Student-t interval "
               f"of the mean], the interval shown from {MIN_INTERVAL_N} replicates on and clipped to the metric's "
               "valid range (the notes under a table say when). Exact ties are reported as ties. "
               "Differences are paired by seed; significant = their 95% interval excludes 0 (p < 0.05), "
               "for that one comparison in the differences table (no correction for the many in it); the best lines are judged "
               "on Holm's correction over the best lines (both p values shown), and `--pairs A:B ...` tests chosen "
               "comparisons as a Holm-corrected family. "
               f"Timing metrics ({', '.join(p + '*' for p in TIMING_PREFIXES)}) are machine-dependent: they measure "
               "the load the machine had while a point ran and are never ranked.")


@dataclass
class ReportFiles:
    out_dir: Path
    markdown: Path
    html: Path
    plots: dict[str, Path]
    live: bool = False  # the page carries the refresh tag
    summary: str = ""  # the counts line ("3 points: 2 finished, 1 running")


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; a report is meant to be read by others
    os.replace(tmp, path)


def _tail(text: str, n: int = TRACEBACK_LINES) -> str:
    lines = text.rstrip().splitlines()
    return "\n".join((["..."] if len(lines) > n else []) + lines[-n:])


def _sections(sweep: Sweep, quality: str = DEFAULT_QUALITY) -> tuple[list[str], list[Table], Table]:
    """The intro lines, the summary tables (configurations, differences, arms: those that apply), every point."""
    intro = [summary_line(sweep)]
    if sweep.merged:
        intro.append(f"Merged {len(sweep.merged)} sweeps (their common settings agree): " + ", ".join(sweep.merged))
    if sweep.duplicates:
        shown = [f"{copy} = {kept} ({why})" for copy, kept, why in sweep.duplicates[:DUPLICATES_SHOWN]]
        more = len(sweep.duplicates) - len(shown)
        intro.append("Counted once (each training is one point, never another replicate): " + "; ".join(shown)
                     + (f"; and {more} more (the points table names them)" if more > 0 else ""))
    if sweep.swept:
        intro.append("Swept: " + ", ".join(sweep.swept))
        for key, others in sweep.aliases.items():
            intro.append(f"{key} also sets: " + ", ".join(others))
    if sweep.fixed:
        intro.append("Common overrides: " + " ".join(f"{k}={v}" for k, v in sweep.fixed.items()))
    intro.append(HOW_TO_READ)
    tables = [t for t in (configurations_table(sweep), differences_table(sweep), arms_table(sweep),
                          cost_table(sweep, quality)) if t is not None]
    return intro, tables, points_table(sweep)


def _failed_title(points) -> str:
    kinds = [k for k in ("failed", "diverged") if any(p.status == k for p in points)]
    return " and ".join(kinds).capitalize() + " points"


def _rel(path: Path, out_dir: Path) -> str:
    return Path(os.path.relpath(path, out_dir)).as_posix()


def render_markdown(sweep: Sweep, plots: dict[str, Path], out_dir: Path, quality: str = DEFAULT_QUALITY) -> str:
    intro, tables, table = _sections(sweep, quality)
    best = best_lines(best_points(sweep))
    md = [f"# kdexp report: {sweep.source}", ""] + [f"{line}  " for line in intro] + [""]
    md += ["## Best points", ""] + ([f"- {b}" for b in best] or ["No finished point has these metrics yet."]) + [""]
    for t in tables:
        md += [f"## {t.title}", "", to_markdown(t), ""]
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
p.note{font-size:0.85em;color:#444;max-width:1100px}
tr.failed td,tr.diverged td{background:#fde2e2}tr.running td{background:#fff6d5}tr.pending td{color:#888}tr.interrupted td{background:#eee}
pre{background:#f6f6f6;padding:0.6em;overflow-x:auto;font-size:0.85em}img{max-width:100%}
p.live{background:#fff6d5;border:1px solid #e0c060;padding:0.5em}"""


def render_html(sweep: Sweep, plots: dict[str, Path], out_dir: Path, live: Optional[bool] = None,
                refresh_s: int = REFRESH_S, quality: str = DEFAULT_QUALITY) -> str:
    """The page; ``live`` (default: a point is still pending or running) adds the refresh tag and the banner."""
    e = html.escape
    live = sweep.live if live is None else live
    intro, tables, table = _sections(sweep, quality)
    best = best_lines(best_points(sweep))
    body = [f"<h1>kdexp report: {e(sweep.source)}</h1>"]
    if live:
        body.append(f'<p id="live" class="live">Live: {e(summary_line(sweep))}; this page reloads every {refresh_s} s '
                    f"and is regenerated as points finish (updated {time.strftime('%Y-%m-%d %H:%M:%S')}).</p>")
    body += ["<p>" + "<br>".join(e(x) for x in intro) + "</p>",
            "<h2>Best points</h2>",
            "<ul>" + "".join(f"<li>{e(b)}</li>" for b in best) + "</ul>" if best
            else "<p>No finished point has these metrics yet.</p>"]
    for t in tables:
        body += [f"<h2>{e(t.title)}</h2>", to_html(t)]
    body += ["<h2>Points</h2>", to_html(table, css_class="kdexp points")]
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
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if live else ""
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">" + refresh
            + f"<title>kdexp report{' (live)' if live else ''}</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(sweep: Sweep, out_dir: str | Path, plots: Optional[dict[str, Path]] = None,
                 live: Optional[bool] = None, quality: str = DEFAULT_QUALITY) -> ReportFiles:
    """Plots, report.md and index.html into ``out_dir`` (created); every file is written atomically.
    ``plots`` = what write_plots(sweep, out_dir) already returned (the notebook draws them first), else drawn here.
    ``live``: the page refreshes itself (default: while a point is pending or running). ``quality``: the metric the
    cost table and the quality-vs-cost plot show against cost."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if plots is None:
        plots = write_plots(sweep, out_dir, quality)
    md, page = out_dir / "report.md", out_dir / "index.html"
    _atomic_write(md, render_markdown(sweep, plots, out_dir, quality))
    live = sweep.live if live is None else live
    _atomic_write(page, render_html(sweep, plots, out_dir, live=live, quality=quality))
    return ReportFiles(out_dir, md, page, plots, live, summary_line(sweep))
