"""python -m kdexp.report: a sweep (or run) dir, or a W&B group, -> report.md + index.html + PNG plots."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

USAGE_EXAMPLES = """examples:
  python -m kdexp.report multirun/2026-12-02/17-34-40-ab12cd          -> <sweep>/report/
  python -m kdexp.report outputs/2026-12-02/17-40-01-cd34ef --out /tmp/r   (a single run)
  python -m kdexp.report multirun/2026-12-02/17-34-40-ab12cd --watch  (live dashboard until the sweep ends)
  python -m kdexp.report multirun/2026-12-02/17-34-40-ab12cd --pairs alpha=0.5:alpha=1.0   (paired, Holm)
  python -m kdexp.report --wandb-group 2026-12-02_17-34-40-ab12cd --wandb-project kdexp --out report/
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kdexp.report", epilog=USAGE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Turn a kdexp sweep (or one run) into an ablation report in SWEEP_DIR/report/: report.md,\n"
                    "index.html and PNG plots. A table of every point (swept values, final metrics, status, errors),\n"
                    "the best point per metric, the arms side by side, loss curves, each metric against each swept\n"
                    "parameter.")
    p.add_argument("sweep_dir", nargs="?", metavar="SWEEP_DIR",
                   help="a Hydra sweep dir (points are found recursively) or a run dir")
    p.add_argument("--out", metavar="DIR", help="output dir (default: SWEEP_DIR/report)")
    p.add_argument("--wandb-group", metavar="GROUP",
                   help="read the points from this W&B group instead of run dirs (needs W&B online access)")
    p.add_argument("--wandb-project", metavar="P", default="kdexp", help="W&B project (default: kdexp)")
    p.add_argument("--wandb-entity", metavar="E", default=None, help="W&B entity (default: your default entity)")
    p.add_argument("--watch", action="store_true",
                   help="keep SWEEP_DIR's report current while the sweep runs (index.html reloads itself in the "
                        "browser) and stop when no point is pending or running; the final page has no refresh")
    p.add_argument("--quality", metavar="METRIC", default="val/kl_to_teacher",
                   help="the quality metric the cost table and the quality-vs-cost plot show (default: "
                        "val/kl_to_teacher)")
    p.add_argument("--pairs", metavar="A:B", nargs="+", default=None,
                   help="print the paired-by-seed table of these comparisons (Markdown, Holm-corrected over the rows "
                        "shown, with the seeds a difference needs) and exit; A and B name configurations by their "
                        "swept values, e.g. arm=k8_ghost:arm=k8_renorm or alpha=0.5:alpha=1.0")
    p.add_argument("--metric", metavar="METRIC", action="append", default=None,
                   help="with --pairs: a metric to compare (repeat for several; default: val/kl_to_teacher, "
                        "val/onpolicy_reverse_kl where the points logged it, val/lm_loss, val/top1_agreement)")
    p.add_argument("--effect", metavar="DELTA", type=float, default=None,
                   help="with --pairs: the difference (in the metric's units) the seeds-needed column is for "
                        "(default: the observed difference)")
    p.add_argument("--interval", metavar="S", type=float, default=None,
                   help="with --watch: seconds between looks at the sweep's files (default: 10)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.wandb_group is None and args.sweep_dir is None:
        ap.error("give SWEEP_DIR or --wandb-group GROUP")
    if args.out is None and args.sweep_dir is None:
        ap.error("--wandb-group needs --out DIR or SWEEP_DIR (the report goes to SWEEP_DIR/report)")
    if args.watch and args.wandb_group is not None:
        ap.error("--watch reads a sweep dir (SWEEP_DIR), not a W&B group")
    if args.interval is not None and (not args.watch or not args.interval > 0):
        ap.error(f"--interval={args.interval} needs --watch and must be > 0 seconds")
    if args.pairs is None and (args.metric is not None or args.effect is not None):
        ap.error("--metric and --effect go with --pairs")
    if args.pairs is not None and (args.watch or args.wandb_group is not None and args.sweep_dir is not None):
        ap.error("--pairs reads one sweep (SWEEP_DIR or --wandb-group) and prints a table; not with --watch")
    if args.effect is not None and not (math.isfinite(args.effect) and args.effect > 0):
        ap.error(f"--effect={args.effect}: give a difference > 0 in the metric's units")
    from kdexp.report.document import REFRESH_S, write_report
    from kdexp.report.tables import best_lines, best_points, summary_line

    if args.watch:
        from kdexp.report.live import watch

        if not Path(args.sweep_dir).is_dir():
            print(f"kdexp.report: sweep_dir={args.sweep_dir!r} is not a directory", file=sys.stderr)
            return 2
        try:
            files = watch(args.sweep_dir, args.out, interval=args.interval or REFRESH_S,
                          echo=lambda line: print(line, flush=True))
        except KeyboardInterrupt:
            print("kdexp.report: stopped watching (the page keeps its last state)", file=sys.stderr)
            return 130
        print(f"final report: {files.markdown}\nhtml:   {files.html}")
        return 0

    try:
        if args.wandb_group is not None:
            from kdexp.report.wandb_source import load_wandb_group

            sweep = load_wandb_group(args.wandb_group, project=args.wandb_project, entity=args.wandb_entity)
        else:
            from kdexp.report.rundirs import load_sweep

            sweep = load_sweep(args.sweep_dir)
    except ValueError as exc:
        print(f"kdexp.report: {exc}", file=sys.stderr)
        return 2
    if not sweep.points:
        print(f"kdexp.report: no runs found in {sweep.source} (no .hydra/, metrics.jsonl, summary.json or "
              "point.json below it)", file=sys.stderr)
        return 1
    if args.pairs is not None:
        return _print_pairs(sweep, args)
    out = Path(args.out) if args.out else Path(args.sweep_dir) / "report"
    # a W&B report is a snapshot nobody regenerates: no refresh tag; a sweep dir's page refreshes while points run
    files = write_report(sweep, out, live=False if args.wandb_group is not None else None, quality=args.quality)
    print(summary_line(sweep))
    for line in best_lines(best_points(sweep)):
        print("best " + line)
    for p in sweep.points:
        if p.status in ("failed", "diverged"):
            print(f"{p.status} {p.name}: {p.error}")
    print(f"report: {files.markdown}\nhtml:   {files.html}\nplots:  {len(files.plots)} PNG in {files.out_dir}")
    return 0


def _print_pairs(sweep, args) -> int:
    from kdexp.report.pairs import PAIR_METRICS, pairs_table, parse_pairs
    from kdexp.report.tables import shown, to_markdown

    try:
        table = pairs_table(sweep, parse_pairs(sweep, args.pairs), tuple(args.metric or shown(sweep, PAIR_METRICS)),
                            effect=args.effect)
    except ValueError as exc:
        print(f"kdexp.report: {exc}", file=sys.stderr)
        return 2
    print(to_markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
