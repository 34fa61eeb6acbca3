"""`make wheelhouse`: an offline node installs kdexp from the folder alone (pip --no-index) and runs it.

The node is simulated by a fresh venv that has what the documented GPU-node recipe says it has (torch and
transformers with what they need, installed there from this venv's own files); everything else must come from the
wheelhouse, with no index."""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kdexp.launchers import wheelhouse

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_manylinux_tags_cover_older_glibc():
    tags = wheelhouse.manylinux_tags("x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux2014_x86_64" in tags and "manylinux1_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags  # a glibc 2.28 node cannot load those


def test_have_file_names_are_normalised(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("Torch==2.11.0+cu128\n# comment\ntyping_extensions==4.12\n-e git+https://x/y#egg=z\n"
                      "huggingface-hub @ file:///w/hub.whl\n")
    assert wheelhouse.freeze_names(freeze) == {"torch", "typing-extensions", "huggingface-hub"}


def _preinstall(node: Path, names: list[str]) -> dict[str, Path]:
    """Install `names` and every distribution they need (markers evaluated here, extras not) into the venv `node` as
    this interpreter has them installed: their files hard-linked (copied where a link cannot be made), their
    dist-info included, so the node's pip sees them installed as a pip install would leave them. Faster than pip
    installing torch again; pip never writes into an installed file (it replaces or removes), so the links stay
    this venv's. Returns each distribution's METADATA in the node."""
    site = next((node / "lib").glob("python3*/site-packages"))
    done: dict[str, Path] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in done:
            continue
        dist = md.distribution(name)
        for rel in dist.files or []:
            src = Path(dist.locate_file(rel))
            if ".." in rel.parts or not src.is_file():  # console scripts outside site-packages; unrecorded caches
                continue
            dst = site / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:  # another file system
                shutil.copy2(src, dst)
        done[name] = next(site / rel for rel in dist.files if rel.name == "METADATA" and len(rel.parts) == 2)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return done


@pytest.mark.slow
def test_offline_node_installs_and_runs_from_the_wheelhouse(tmp_path, seeded_cache):
    house = tmp_path / "wheelhouse"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = _run([sys.executable, "-m", "kdexp.launchers.wheelhouse", "--python", py, "--have", "transformers",
                "--out", str(house), "--max-mib", "60"], cwd=ROOT).stdout
    assert "--no-index --find-links" in out
    names = {p.name.split("-")[0].lower() for p in house.glob("*.whl")}
    assert {"kdexp", "megatron_core", "hydra_core", "omegaconf", "submitit", "wandb"} <= names, names
    assert not names & {"torch", "transformers", "triton"} and not any(n.startswith("nvidia") for n in names), names
    for wheel in house.glob("*.whl"):  # every binary wheel is for this interpreter (or the stable ABI)
        tag = wheel.name[:-4].split("-")[-3:]
        assert tag[0].startswith(("py3", "py2", f"cp{py.replace('.', '')}")) or tag[1] == "abi3", wheel.name
        assert zipfile.is_zipfile(wheel)

    node = tmp_path / "node"
    _run([sys.executable, "-m", "venv", str(node)])
    # what the node already has: torch and transformers with their dependencies, as this checkout installed them
    have = _preinstall(node, ["torch", "transformers"])
    assert {"torch", "transformers", "numpy", "tokenizers"} <= have.keys(), sorted(have)
    have_inodes = {name: meta.stat().st_ino for name, meta in have.items()}
    _run([str(node / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(house),
          "kdexp"])
    # pip kept the node's own torch and transformers and what they need: not one of them reinstalled
    assert {name: meta.stat().st_ino for name, meta in have.items()} == have_inodes

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the session's smoke data and pretrained teacher (built from the same source): what is tested here is the
    # install, and a cold cache's builds are tested elsewhere
    env = {**os.environ, "KDEXP_CACHE": str(seeded_cache(tmp_path / "cache")), "WANDB_MODE": "offline"}
    for key in ("PYTHONPATH", "KDEXP_RUN_STAMP", "VIRTUAL_ENV"):
        env.pop(key, None)
    proc = subprocess.run([str(node / "bin" / "python"), "-m", "kdexp.run", "experiment=smoke", "trainer.max_steps=2",
                           "trainer.eval_interval=2", "logger.wandb.enabled=false", "hydra.run.dir=run"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((elsewhere / "run" / "summary.json").read_text())["status"] == "finished"
    # TensorBoard events are written on the node (tensorboardX; the viewer package is not in the wheelhouse)
    run_files = sorted(p.name for p in (elsewhere / "run").iterdir())
    assert any(n.startswith("events.out.tfevents.") for n in run_files), run_files
    assert "tensorboard" not in names and "grpcio" not in names, names
    # the GPU check's entry point is installed too (it needs CUDA to run: on this machine it must say so, not crash)
    gpu = subprocess.run([str(node / "bin" / "python"), "-m", "kdexp.bench.gpu", "--help"], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    assert gpu.returncode == 0 and "usage" in gpu.stdout, gpu.stderr[-2000:]
