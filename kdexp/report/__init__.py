"""Runs on disk (a run dir, a Hydra sweep dir, nested sweeps) or a W&B group -> ablation tables and plots.

    python -m kdexp.report SWEEP_DIR                  -> SWEEP_DIR/report/{report.md, index.html, *.png}

The notebook (notebooks/ablation_report.ipynb) calls the same functions. Nothing here imports the training code.
"""
from kdexp.report.comparisons import configurations_table, differences_table
from kdexp.report.cost import add_cost_metrics, cost_table
from kdexp.report.document import ReportFiles, render_html, render_markdown, write_report
from kdexp.report.model import Aggregate, Point, Sweep, aggregate
from kdexp.report.pairs import pairs_table, parse_pairs
from kdexp.report.params import build_sweep
from kdexp.report.rundirs import find_run_dirs, latest_sweep, load_point, load_sweep
from kdexp.report.replicates import Configuration, configurations, is_timing
from kdexp.report.stats import Difference, Summary, compare, holm, paired_difference, seeds_needed, summarize
from kdexp.report.plots import plot_arms, plot_curves, plot_metric_vs_param, plot_quality_vs_cost, write_plots
from kdexp.report.ranges import METRIC_RANGES, MIN_INTERVAL_N
from kdexp.report.tables import (BEST_METRICS, TABLE_METRICS, Best, Table, arms_table, best_lines, best_points,
                                 points_table, summary_line, to_html, to_markdown)
from kdexp.report.trainings import count_once, merge_sweeps
from kdexp.report.wandb_source import load_wandb_group

__all__ = ["Point", "Sweep", "Aggregate", "aggregate", "load_sweep", "load_point", "find_run_dirs", "build_sweep", "latest_sweep",
           "Table", "Best", "TABLE_METRICS", "BEST_METRICS", "points_table", "arms_table", "best_points", "best_lines",
           "summary_line", "to_markdown", "to_html", "plot_curves", "plot_metric_vs_param", "plot_arms", "write_plots",
           "ReportFiles", "write_report", "render_markdown", "render_html", "load_wandb_group",
           "configurations_table", "differences_table", "Configuration", "configurations", "is_timing", "Summary",
           "Difference", "summarize", "paired_difference", "compare", "cost_table", "add_cost_metrics",
           "plot_quality_vs_cost", "METRIC_RANGES", "MIN_INTERVAL_N", "pairs_table", "parse_pairs", "holm",
           "seeds_needed", "count_once", "merge_sweeps"]
