"""notebooks/ablation_report.ipynb, executed with nbclient on a real tiny sweep (python -m kdexp.run -m ...)."""
from __future__ import annotations

import base64
import sys

import pytest

from sweeps import REPO, checked_real_points, real_tiny_sweep

NOTEBOOK = REPO / "notebooks" / "ablation_report.ipynb"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory, seeded_cache):
    sweep_dir, proc = real_tiny_sweep(tmp_path_factory, seeded_cache)
    points = checked_real_points(sweep_dir, proc)
    return sweep_dir, points


def _outputs(nb, kind: str) -> list:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == kind]


def test_notebook_on_real_sweep(real_sweep, tmp_path, monkeypatch):
    import nbclient
    import nbformat

    sweep_dir, points = real_sweep
    report_dir = tmp_path / "nb_report"
    monkeypatch.setenv("KDEXP_SWEEP_DIR", str(sweep_dir))
    monkeypatch.setenv("KDEXP_REPORT_DIR", str(report_dir))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # kernel "python3": its spec runs "python", which jupyter_client replaces by sys.executable (this venv's python)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on any failing cell

    streams = "".join(o.text for o in _outputs(nb, "stream") if o.name == "stdout")
    assert f"kernel python: {sys.executable}" in streams
    assert "2 points: 2 finished" in streams  # alpha=1.5, refused before it claimed a run dir, is never counted
    html = "".join(o.data.get("text/html", "") for o in _outputs(nb, "display_data"))
    for alpha in (0.0, 1.0):
        final = points[alpha]["final"]
        assert points[alpha]["status"] == "finished"
        for metric in ("val/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "train/kept_mass"):
            assert f"{final[metric]:.4f}" in html, (alpha, metric)
    refused = points[1.5]
    assert refused["status"] == "refused" and "balancer.alpha" in refused["error"]
    assert refused["error"] not in streams
    pngs = [base64.b64decode(o.data["image/png"]) for o in _outputs(nb, "display_data") if "image/png" in o.data]
    written = sorted(report_dir.glob("*.png"))
    assert len(pngs) == len(written) >= 2  # curves + metrics against balancer.alpha
    assert all(p[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert {p.read_bytes() for p in written} == set(pngs)
    assert (report_dir / "report.md").is_file() and (report_dir / "index.html").is_file()
