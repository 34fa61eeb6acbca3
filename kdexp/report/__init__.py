"""Runs on disk (a run dir, a Hydra sweep dir, nested sweeps) or a W&B group -> ablation tables and plots.

    python -m kdexp.report SWEEP_DIR                  -> SWEEP_DIR/report/{report.md, index.html, *.png}

The notebook (notebooks/ablation_report.ipynb) calls the same functions. Nothing here imports the training code.
The sweep's live dashboard is kept by kdexp.report.callback.LiveSweepCallback (the Hydra callback conf/config.yaml
names).
"""
from __future__ import annotations

from kdexp import lazy_exports

# name -> module. Loaded on first use (PEP 562): Hydra instantiates the sweep callback (kdexp.report.callback) in
# every run, and that must not import matplotlib and the tables before a report is drawn.
_EXPORTS = {
    "configurations_table": "comparisons", "differences_table": "comparisons",
    "add_cost_metrics": "cost", "cost_table": "cost",
    "ReportFiles": "document", "render_html": "document", "render_markdown": "document", "write_report": "document",
    "Aggregate": "model", "Point": "model", "Sweep": "model", "aggregate": "model",
    "build_sweep": "params",
    "find_run_dirs": "rundirs", "latest_sweep": "rundirs", "load_point": "rundirs", "load_sweep": "rundirs",
    "Configuration": "replicates", "configurations": "replicates", "is_timing": "replicates",
    "Difference": "stats", "Summary": "stats", "compare": "stats", "paired_difference": "stats", "summarize": "stats",
    "holm": "stats", "seeds_needed": "stats",
    "pairs_table": "pairs", "parse_pairs": "pairs",
    "count_once": "trainings", "merge_sweeps": "trainings",
    "plot_arms": "plots", "plot_curves": "plots", "plot_metric_vs_param": "plots", "plot_quality_vs_cost": "plots",
    "write_plots": "plots",
    "METRIC_RANGES": "ranges", "MIN_INTERVAL_N": "ranges",
    "BEST_METRICS": "tables", "TABLE_METRICS": "tables", "Best": "tables", "Table": "tables", "arms_table": "tables",
    "best_lines": "tables", "best_points": "tables", "points_table": "tables", "summary_line": "tables",
    "to_html": "tables", "to_markdown": "tables",
    "load_wandb_group": "wandb_source",
}
__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
