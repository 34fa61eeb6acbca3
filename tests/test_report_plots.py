"""A PNG of the report is redrawn when its figure changed and only then: the figure's key (a digest of its artists'
state, rcParams, dpi and matplotlib's version) rides in the PNG, and an equal key leaves the file untouched. Checked
against the pixels: a skipped write would have drawn the same image, a changed figure draws another."""
from __future__ import annotations

import io

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from PIL import Image

from kdexp.report import load_sweep
from kdexp.report.plots import figure_key, png_key, write_plots
from sweeps import tiny_config, write_run_dir


def _sweep(root, kl_of_alpha: dict):
    for num, (alpha, kl) in enumerate(kl_of_alpha.items()):
        write_run_dir(root / str(num), overrides=[f"balancer.alpha={alpha}"], config=tiny_config(alpha, "topk"),
                      num=num, steps=4, val=[{"step": 2, "val/kl_to_teacher": kl + 0.5}, {"step": 4, "val/kl_to_teacher": kl}],
                      final={"val/kl_to_teacher": kl})
    return load_sweep(root)


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGBA"))


def _drawn(fig: Figure) -> np.ndarray:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGBA"))


def _line_figure(ys) -> Figure:
    fig = Figure(figsize=(3, 2), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([1, 2, 3], ys, label="a")
    ax.legend()
    return fig


def test_equal_figures_have_equal_keys_and_any_change_another():
    a, b = _line_figure([1.0, 2.0, 3.0]), _line_figure([1.0, 2.0, 3.0])
    assert figure_key(a) == figure_key(b) is not None  # id()-keyed state (transforms' parents) does not count
    assert figure_key(_line_figure([1.0, 2.0, 3.0000001])) != figure_key(a)
    relabelled = _line_figure([1.0, 2.0, 3.0])
    relabelled.axes[0].set_title("t")
    assert figure_key(relabelled) != figure_key(a)
    with matplotlib.rc_context({"axes.formatter.useoffset": not matplotlib.rcParams["axes.formatter.useoffset"]}):
        assert figure_key(a) != figure_key(b)  # rcParams read at draw time are part of the key


def test_an_unchanged_report_keeps_its_pngs_and_a_changed_one_redraws_them(tmp_path):
    out = tmp_path / "out"
    first = write_plots(_sweep(tmp_path / "a", {0.5: 0.9, 1.0: 0.7}), out)
    stat = {k: (p.stat().st_ino, p.stat().st_mtime_ns) for k, p in first.items()}
    keys = {k: png_key(p) for k, p in first.items()}
    assert all(keys.values()) and len(set(keys.values())) == len(keys)
    pixels = {k: _pixels(p) for k, p in first.items()}
    # the same sweep read again (another directory: same numbers): every PNG is left as it was
    again = write_plots(_sweep(tmp_path / "b", {0.5: 0.9, 1.0: 0.7}), out)
    assert {k: (p.stat().st_ino, p.stat().st_mtime_ns) for k, p in again.items()} == stat
    # ... which is what drawing it would have given: the skipped write draws these very pixels
    from kdexp.report import plots

    drawn = {}
    real_save = plots._save

    def capture(fig, path):
        drawn[path.name] = _drawn(fig)
        return real_save(fig, path)

    plots._save = capture
    try:
        write_plots(_sweep(tmp_path / "c", {0.5: 0.9, 1.0: 0.7}), tmp_path / "fresh")
    finally:
        plots._save = real_save
    for k, p in first.items():
        assert np.array_equal(drawn[p.name], pixels[k]), k
    # one number changed: the PNGs that show it are drawn again, with another key and other pixels
    changed = write_plots(_sweep(tmp_path / "d", {0.5: 0.9, 1.0: 0.6}), out)
    redrawn = {k for k, p in changed.items() if png_key(p) != keys[k]}
    assert {"curves", "vs balancer.alpha"} <= redrawn
    for k in redrawn:
        assert not np.array_equal(_pixels(changed[k]), pixels[k]), k


def test_a_png_without_a_key_or_not_a_png_is_redrawn(tmp_path):
    out = tmp_path / "out"
    (out).mkdir()
    (out / "curves.png").write_bytes(b"not a png")
    assert png_key(out / "curves.png") is None and png_key(out / "missing.png") is None
    files = write_plots(_sweep(tmp_path / "a", {0.5: 0.9, 1.0: 0.7}), out)
    assert png_key(files["curves"]) is not None and _pixels(files["curves"]).shape[0] > 100
