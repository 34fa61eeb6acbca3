"""What a live report saves at each refresh, checked against the work it skips. A PNG is redrawn when its figure
changed and only then: the figure's key (a digest of its artists' state, rcParams, font, dpi and matplotlib's version)
rides in the PNG, and an equal key leaves the file untouched; checked against the pixels (a skipped write would have
drawn the same image, a changed figure draws another). The points' .hydra files are parsed by libyaml: checked
against yaml.safe_load."""
from __future__ import annotations

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
    # ... which is what drawing it now gives: the same sweep drawn into an empty directory has these very pixels
    fresh = write_plots(_sweep(tmp_path / "c", {0.5: 0.9, 1.0: 0.7}), tmp_path / "fresh")
    for k, p in first.items():
        assert np.array_equal(_pixels(fresh[k]), pixels[k]), k
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


def test_a_points_config_is_read_as_yaml_safe_load_reads_it(tmp_path):
    """The report reads .hydra/*.yaml with libyaml's parser where PyYAML has it: the values are yaml.safe_load's,
    YAML 1.1's corner cases included (on/off and yes/no are booleans, 1e-3 without a dot is a string, .nan, .inf,
    ~, a date, an anchor)."""
    import math

    import yaml

    run = write_run_dir(tmp_path / "s" / "0", overrides=["balancer.alpha=0.5"], config=tiny_config(0.5, "topk"),
                        num=0, steps=4, final={"val/kl_to_teacher": 0.5})
    text = (run / ".hydra" / "config.yaml").read_text() + (
        "corner:\n  a: on\n  b: off\n  c: yes\n  d: 1e-3\n  e: 1.0e-3\n  f: .nan\n  g: -.inf\n  h: ~\n"
        "  i: 2026-12-08\n  j: &x [1, '2', 3.0]\n  k: *x\n  l: 0o17\n  m: 0x1f\n  n: '007'\n  o: 1_000\n")
    (run / ".hydra" / "config.yaml").write_text(text)
    (point,) = load_sweep(tmp_path / "s").points
    expected = yaml.safe_load(text)
    got = point.config
    assert math.isnan(got["corner"].pop("f")) and math.isnan(expected["corner"].pop("f"))
    assert got == expected
    assert got["corner"]["a"] is True and got["corner"]["d"] == "1e-3" and got["corner"]["e"] == 0.001
