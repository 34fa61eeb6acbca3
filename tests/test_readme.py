"""README.md and docs/*.md are tested by their code blocks: each fenced block says, in an HTML comment on the line
right before it, how it is tested, and this module does that. A block without such a comment fails
test_every_block_says_how_it_is_tested, so a new command cannot land untested. The comments (docs/install.md,
"Writing docs", is the reader's copy of this list):

  <!-- run -->                 each line of the block runs as printed (bash), in order
  <!-- run: ARGS -->           the same, ARGS appended to each `python -m kdexp.run` / `kdexp.bench.*` line (smoke
                               sizes: the line as printed trains for minutes)
  <!-- run exit=0,1 ... -->    the exit statuses it may end with (default 0); text after them is the reader's note
  <!-- compose -->             a run that needs checkpoints, corpora or GPUs: `--cfg job` appended (torchrun becomes
                               python); every dotted override must land in the composed config
  <!-- dry-run -->             `make ...` as `make -n` in a copy of Makefile + pyproject.toml
  <!-- covered: tests/x.py::name ... -->   another test runs it; every named test must exist
  <!-- not-run: why -->        it cannot run in a test (network, a service other sessions use); the reason is required
  <!-- output -->              before a `text` block: the previous run block's stdout, compared exactly

A page is a session: its run blocks run in order in one fresh directory (as a reader following the page would), so
`multirun/<date>/<time-id>` / `outputs/<date>/<time-id>` in a line are the newest sweep / run the page made so far
(else one an earlier page made, else a smoke sweep / run made once for the module). What each line must leave behind is checked by what it runs
(`expect`): a run finished with its overrides in its config, every point of a sweep finished with its swept values,
a report wrote its files, a benchmark printed its numbers. `text` blocks without `<!-- output -->` are not commands.
Each line runs in bash as printed; its `python -m kdexp...` hands itself over to the test process's fork server
(shell_env below), so that the pages do not import torch and megatron-core once per command.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import yaml

from _zygote import Zygote

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("", "bash", "sh", "console", "shell")
KINDS = ("run", "compose", "dry-run", "covered", "not-run", "output")
DIRECTIVE = re.compile(r"^<!--\s*(?P<kind>[a-z-]+)(?P<exit>\s+exit=[\d,]+)?(?P<rest>.*?)\s*-->\s*$")
SWEEP_PLACEHOLDER, RUN_PLACEHOLDER = "multirun/<date>/<time-id>", "outputs/<date>/<time-id>"
TRAINING = re.compile(r"^(\w+=\S+ )*python -m kdexp\.(run|bench\.\w+)\b")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    kind: Optional[str]  # None: no directive
    arg: str = ""  # run: the appended arguments; covered: node ids; not-run: the reason
    exits: tuple = (0,)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def commands(self) -> list[str]:
        return commands(self.body)


def commands(body: str) -> list[str]:
    """The command lines of a shell block: continuation lines joined, comments and blank lines dropped."""
    out = []
    for line in re.sub(r"\s*\\\n\s*", " ", body).splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def parse(text: str, page: Path = README) -> list[Block]:
    """Every fenced block of a page, with the directive on the line right before its opening fence."""
    lines, blocks, i = text.split("\n"), [], 0
    while i < len(lines):
        fence = re.match(r"^```([\w-]*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        m = DIRECTIVE.match(lines[i - 1]) if i > 0 else None
        block = Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n", m and m.group("kind"))
        if m:
            rest = m.group("rest").strip()
            # run: only what follows ":" is appended; `<!-- run exit=0,1 (why) -->`'s text is the reader's note
            block.arg = rest[1:].strip() if rest.startswith(":") else "" if block.kind == "run" else rest
            if m.group("exit"):
                block.exits = tuple(int(x) for x in m.group("exit").split("=")[1].split(","))
        blocks.append(block)
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in parse(page.read_text(), page)]


def _of(*kinds):
    return [pytest.param(b, id=b.where) for b in BLOCKS if b.kind in kinds]


# --- every block says how it is tested ---------------------------------------------------------------------------
def test_every_block_says_how_it_is_tested():
    problems = []
    for prev, b in zip([None, *BLOCKS], BLOCKS):
        if b.lang == "text" and b.kind is None:
            continue  # a picture of a layout or an output, not a command
        if b.kind not in KINDS:
            problems.append(f"{b.where}: a ```{b.lang} block needs <!-- run | compose | dry-run | covered: ... | "
                            f"not-run: why --> on the line before it (got {b.kind!r})")
        elif b.kind == "covered":
            for node in b.arg.split() or ["(none named)"]:
                path, _, name = node.partition("::")
                ok = (ROOT / path).is_file() and re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M)
                if not ok:
                    problems.append(f"{b.where}: covered by {node}, which does not exist")
        elif b.kind == "not-run" and len(b.arg) < 10:
            problems.append(f"{b.where}: not-run needs its reason")
        elif b.kind == "output" and not (b.lang == "text" and prev is not None and prev.page == b.page
                                         and prev.kind == "run"):
            problems.append(f"{b.where}: <!-- output --> goes before a text block right after a run block")
        elif b.kind in ("run", "compose", "dry-run") and b.lang not in SHELL:
            problems.append(f"{b.where}: {b.kind} is for shell blocks")
        if b.lang in SHELL and b.kind in KINDS and not b.commands:
            problems.append(f"{b.where}: a shell block without a command")
    assert not problems, "\n".join(problems)


def test_parser_reads_directives_commands_and_exits():
    text = ("<!-- run: a=1 -->\n```bash\nmake run   # c\npython -m a \\\n  b=1\n```\n\n```python\nx\n```\n"
            "<!-- run exit=0,1 (1 without a GPU) -->\n```bash\nx\n```\n<!-- covered: t.py::f -->\n```\ny\n```\n")
    a, b, c, d = parse(text)
    assert (a.kind, a.arg, a.commands, a.exits, a.line) == ("run", "a=1", ["make run", "python -m a b=1"], (0,), 2)
    assert (b.kind, b.lang) == (None, "python")
    assert (c.kind, c.exits, c.arg) == ("run", (0, 1), "")
    assert (d.kind, d.arg, d.lang) == ("covered", "t.py::f", "")


# --- running them ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shell_env(tmp_path_factory):
    """`python` on PATH is this interpreter (a wrapper: a symlink would lose the venv), then the venv's scripts
    (jupyter); kdexp imports from this tree; the session's KDEXP_CACHE (conftest) is shared. A line's ``python -m
    kdexp...`` starts as an interpreter that hands itself over to this process's fork server (tests/_zygote.py,
    KDEXP_TEST_HAND_OVER in tests/_site/sitecustomize.py), as do the sweep workers it starts: the shell, the line,
    its directory, environment, streams, signals and exit status are the reader's; torch, megatron-core, Hydra and
    W&B are imported once per pytest worker instead of once per command."""
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {**os.environ, "PATH": path,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "XDG_CONFIG_HOME": str(tmp_path_factory.mktemp("xdg"))}
    env = {**Zygote.child_env(env), "KDEXP_TEST_HAND_OVER": "kdexp"}
    for name in ("KDEXP_RUN_STAMP", "KDEXP_SITE_DIR", "WANDB_MODE"):
        env.pop(name, None)
    return env


def shell(command: str, env, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


class Fallback:
    """A smoke sweep and a smoke run, made once and only when a page names one before making its own."""

    def __init__(self, env, base: Path):
        self.env, self.base, self.made = env, base, {}
        self.pages: list[Path] = []  # the directories of the pages run so far

    def get(self, what: str) -> Path:
        if what not in self.made:
            cwd = self.base / what
            cwd.mkdir()
            line = {"sweep": "python -m kdexp.run -m experiment=smoke trainer.max_steps=2 trainer.eval_interval=2 "
                             "logger=none balancer.alpha=0.5,1.0",
                    "run": "python -m kdexp.run experiment=smoke logger=none"}[what]
            proc = shell(line, self.env, cwd)
            assert proc.returncode == 0, proc.stderr[-3000:]
            self.made[what] = newest(cwd, what)
        return self.made[what]


@pytest.fixture(scope="module")
def fallback(shell_env, tmp_path_factory):
    return Fallback(shell_env, tmp_path_factory.mktemp("fallback"))


def newest(cwd: Path, what: str) -> Optional[Path]:
    pattern = {"sweep": "multirun/*/*/sweep.json", "run": "outputs/*/*/summary.json"}[what]
    found = sorted(cwd.glob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def fill(line: str, cwd: Path, fallback: Fallback) -> str:
    """The placeholders: the newest sweep / run of this page, else of the pages run before it, else the fallback's."""
    for placeholder, what in ((SWEEP_PLACEHOLDER, "sweep"), (RUN_PLACEHOLDER, "run")):
        if placeholder in line:
            found = [p for p in (newest(d, what) for d in [cwd, *reversed(fallback.pages)]) if p is not None]
            line = line.replace(placeholder, str(found[0] if found else fallback.get(what)))
    return line


def overrides(line: str) -> list[tuple[str, str]]:
    """(key, value) of the dotted `key=value` overrides of a kdexp command line (not hydra.*, not flags)."""
    out = []
    for token in shlex.split(line):
        key, eq, value = token.partition("=")
        if eq and "." in key and "/" not in key and not key.startswith(("hydra", "-")) and re.match(r"^[\w.]+$", key):
            out.append((key, value))
    return out


def lookup(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def _assert_config_has(cfg: dict, pairs, where: str) -> None:
    for key, value in pairs:
        assert lookup(cfg, key) == yaml.safe_load(value), (where, key, lookup(cfg, key), value)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_run(line: str, cwd: Path, before: set, proc) -> None:
    """A single run: one new run dir, finished, its metrics and checkpoint there, its overrides in its config."""
    new = [p.parent for p in cwd.glob("outputs/*/*/summary.json") if p.parent not in before]
    assert len(new) == 1, (line, new, proc.stdout[-2000:])
    run_dir = new[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert summary["status"] == "finished" and summary["steps"] == cfg["trainer"]["max_steps"], summary
    metrics = _metrics(run_dir)
    assert any("train/kd_loss" in m for m in metrics) and any("val/kl_to_teacher" in m for m in metrics)
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert (run_dir / "wandb").is_dir() == cfg["logger"]["wandb"]["enabled"]
    _assert_config_has(cfg, overrides(line), line)
    if cfg["loss"]["intermediate"]:
        assert all(0 <= m["train/intermediate_loss"] <= 2 for m in metrics if m["kind"] == "train")


def check_sweep(line: str, cwd: Path, before: set, proc) -> None:
    """A sweep: one new sweep dir, every point finished (or reused), the swept values exactly the product asked."""
    new = [p.parent for p in cwd.glob("multirun/*/*/sweep.json") if p.parent not in before]
    assert len(new) == 1, (line, new)
    sweep = json.loads((new[0] / "sweep.json").read_text())
    assert [p["status"] in ("finished", "reused") for p in sweep["points"]] == [True] * len(sweep["points"]), sweep
    pairs = overrides(line)
    swept = {k: [yaml.safe_load(v) for v in value.split(",")] for k, value in pairs if "," in value}
    seen = set()
    for p in sweep["points"]:
        cfg = yaml.safe_load((Path(p["run_dir"]) / ".hydra" / "config.yaml").read_text())
        _assert_config_has(cfg, [(k, v) for k, v in pairs if k not in swept], line)
        seen.add(tuple(lookup(cfg, k) for k in swept))
    assert seen == set(itertools.product(*swept.values())), (seen, swept)
    assert (new[0] / "report" / "index.html").is_file()  # the live dashboard, final
    tail = proc.stdout.strip().splitlines()[-3:]
    assert any(x.endswith(str(new[0] / "report" / "index.html")) for x in tail), tail


def check_report(line: str, cwd: Path, before: set, proc) -> None:
    args = shlex.split(line)[3:]
    out = Path(args[args.index("--out") + 1]) if "--out" in args else Path(args[0]) / "report"
    out = out if out.is_absolute() else cwd / out
    for name in ("report.md", "index.html"):
        assert (out / name).is_file(), (line, name)
    assert "finished" in (out / "report.md").read_text()


def check_notebook(line: str, cwd: Path, before: set, proc) -> None:
    import nbformat

    out = cwd / "notebooks" / (line.split("--output", 1)[1].strip().lstrip("=").split()[0] + ".ipynb")
    nb = nbformat.read(out, as_version=4)
    streams = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "points:" in streams and "finished" in streams, streams[-2000:]


def check_loss_bench(line, cwd, before, proc) -> None:
    configs = ("dense", "topk", "topk_topp", "topp", "topk_renorm")
    rows = [x.split() for x in proc.stdout.splitlines() if x.split()[:1] and x.split()[0] in configs]
    kdexp_rows = [r for r in rows if r[2] == "kdexp"]
    assert {(r[0], r[1]) for r in kdexp_rows} == {(c, d) for c in configs for d in ("fp32", "bf16")}, proc.stdout
    for r in kdexp_rows:  # |loss - plain PyTorch| per token, the last column
        assert float(r[-1]) < (1e-4 if r[1] == "fp32" else 5e-2), r


def check_step_bench(line, cwd, before, proc) -> None:
    assert re.search(r"KD overhead: [+-]\d+\.\d%", proc.stdout), proc.stdout
    assert "device=cpu" in proc.stdout
    if "--versus" in line:  # the second setup's KD step, timed in the same rotation
        versus = line.split("--versus", 1)[1].split()[0]
        assert re.search(rf"KD step vs {re.escape(versus)}: ratio \d+\.\d{{3}}", proc.stdout), proc.stdout


def check_teacher_bench(line, cwd, before, proc) -> None:
    """The shipped teacher, measured as a user would (nothing trained, neither a BPE nor a teacher), meets the bar
    of kdexp.bench.teacher on held-out code."""
    out = proc.stdout
    if "--curve" in line:  # experiment=smoke pretrains 30 steps: fewer than 50, one measurement, the last step's
        (row,) = [x for x in out.splitlines() if x.startswith("step ")]
        assert row.split()[1] == "30" and "nucleus median" in row and "K1024" in row, row
        return
    from kdexp.bench.teacher import MAX_LM_LOSS, MAX_NUCLEUS, MIN_TOP1

    for label in ("val LM loss", "mean top-1 prob", "0.95-nucleus       median", "K=16:", "K=1024:"):
        assert label in out, out
    assert "vocab=2048" in out and "val tokens=16384" in out, out
    log = out + proc.stderr
    assert "training a" not in log and "stage teacher: pretraining" not in log, log[-3000:]
    lm = float(re.search(r"val LM loss\s+([\d.]+)", out).group(1))
    top1 = float(re.search(r"mean top-1 prob\s+([\d.]+)", out).group(1))
    nucleus = float(re.search(r"0\.95-nucleus\s+median ([\d.]+)", out).group(1))
    kept = [float(x) for x in re.findall(r"K=\d+: ([\d.]+)", out)]
    assert lm <= MAX_LM_LOSS and top1 >= MIN_TOP1 and nucleus <= MAX_NUCLEUS and ": met" in out, out
    assert kept == sorted(kept) and kept[-1] > 0.98, out


def check_gpu_bench(line, cwd, before, proc) -> None:
    import torch

    if torch.cuda.is_available():
        assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is True
    else:
        assert proc.returncode == 1 and "no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def check_site(line, cwd, before, proc) -> None:
    assert "site dir: none" in proc.stdout and "(absent)" in proc.stdout
    template = proc.stdout.rsplit("template: ", 1)[1].strip()
    assert Path(template).is_file() and template.endswith("site.yaml.example")


def check_plan(line, cwd, before, proc) -> None:
    assert "kdexp plan:" in proc.stdout and "per GPU" in proc.stdout, proc.stdout
    if "gpu_memory_gb=" in line:
        assert f"fits trainer.gpu_memory_gb={line.split('gpu_memory_gb=')[1].split()[0]}" in proc.stdout


def check_dry_run(line, cwd, before, proc) -> None:
    """--dry-run: one line per point of the product asked, each saying what it would do, and nothing written."""
    lines = proc.stdout.strip().splitlines()
    pairs = [w.split("=", 1) for w in shlex.split(line) if "=" in w and not w.startswith("-")]
    swept = [value.split(",") for _, value in pairs if "," in value]  # group=a,b as well as key=a,b
    n = len(list(itertools.product(*swept)))
    assert lines[0].startswith(f"[dry-run] {n} points, ") and len(lines) == n + 1, proc.stdout
    assert all(re.match(rf"#{i} .+: would (train|reuse|resume)", x) for i, x in enumerate(lines[1:])), proc.stdout
    made = set(cwd.glob("outputs/*/*")) | set(p.parent for p in cwd.glob("multirun/*/*/sweep.json"))
    assert made <= before, made - before


def check_cfg(line, cwd, before, proc) -> None:
    _assert_config_has(yaml.safe_load(proc.stdout), overrides(line), line)
    assert not (cwd / "outputs").exists() or set(cwd.glob("outputs/*/*")) <= before  # printing runs nothing


def expect(line: str):
    """What a line of a run block must leave behind, chosen by what it runs."""
    words = shlex.split(line.split("=", 1)[1] if re.match(r"^[A-Z_]+=", line) else line)
    if "jupyter" in line:
        return check_notebook
    module = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m" and words[i + 1].startswith("kdexp")),
                  None)
    if module == "kdexp.run":
        return check_cfg if "--cfg" in words else check_dry_run if "--dry-run" in words else \
            check_sweep if "-m" in words[3:] else check_run
    return {"kdexp.report": check_report, "kdexp.bench.losses": check_loss_bench, "kdexp.bench.step": check_step_bench,
            "kdexp.bench.teacher": check_teacher_bench, "kdexp.bench.gpu": check_gpu_bench,
            "kdexp.launchers": check_site, "kdexp.plan": check_plan}.get(module)


def _run_block(block: Block, cwd: Path, env, fallback: Fallback) -> subprocess.CompletedProcess:
    proc = None
    for printed in block.commands:
        line = fill(printed, cwd, fallback)
        if block.arg and TRAINING.match(line):
            line = f"{line} {block.arg}"
        before = set(p.parent for p in cwd.glob("outputs/*/*/summary.json")) | \
            set(p.parent for p in cwd.glob("multirun/*/*/sweep.json")) | set(cwd.glob("outputs/*/*"))
        proc = shell(line, env, cwd)
        assert proc.returncode in block.exits, (block.where, line, proc.returncode, proc.stdout[-3000:],
                                                proc.stderr[-6000:])
        assert "Traceback" not in proc.stderr or proc.returncode != 0, (block.where, line, proc.stderr[-3000:])
        check = expect(line)
        if check is not None:
            check(line, cwd, before, proc)
    return proc


def _pages_with_runs():
    return [pytest.param(p, id=str(p.relative_to(ROOT))) for p in PAGES
            if any(b.kind == "run" for b in BLOCKS if b.page == p)]


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with_runs())
def test_page_runs(page, shell_env, fallback, tmp_path):
    """The page's run blocks in order in one directory, as its reader would run them; an output block after one is
    its stdout, exactly."""
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks")
    fallback.pages.append(tmp_path)
    blocks = [b for b in BLOCKS if b.page == page]
    for i, block in enumerate(blocks):
        if block.kind != "run":
            continue
        proc = _run_block(block, tmp_path, shell_env, fallback)
        if i + 1 < len(blocks) and blocks[i + 1].kind == "output":
            assert proc.stdout.strip() == blocks[i + 1].body.strip(), (block.where, proc.stdout)


@pytest.mark.parametrize("block", _of("compose"))
def test_compose_block(block, shell_env, tmp_path):
    for printed in block.commands:
        line = re.sub(r"^torchrun (--\S+ \S+ )*-m kdexp\.run", "python -m kdexp.run", printed)
        assert line.startswith("python -m kdexp.run"), line
        proc = shell(f"{line} --cfg job", shell_env, tmp_path, timeout=300)
        assert proc.returncode == 0, (block.where, proc.stderr[-3000:])
        check_cfg(line, tmp_path, set(), proc)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed (.ci/run installs it)")
@pytest.mark.parametrize("block", _of("dry-run"))
def test_dry_run_block(block, shell_env, tmp_path):
    """`make -n` shows the whole recipe (a copy without .venv): the target's command, with what the line passes."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    for line in block.commands:
        # a clean make: under `make test ARGS=...` the parent's command-line variables reach a child make through
        # MAKEFLAGS, and the Makefile's ?= variables read the environment (`ARGS=... make test`): either would change
        # the recipe the line prints
        env = {k: v for k, v in shell_env.items()
               if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS", "TEST_WORKERS", "TORCH_INDEX")}
        proc = shell(re.sub(r"\bmake\b", "make -n", line, count=1), env, tmp_path, timeout=60)
        assert proc.returncode == 0, (block.where, proc.stderr)
        recipe = proc.stdout.splitlines()
        variables = {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line)}
        args = variables.pop("ARGS", "")
        target = line.split("make", 1)[1].split()[0]
        wanted = {"run": [f".venv/bin/python -m kdexp.run {args}"],
                  "test": [".venv/bin/ruff check kdexp conf launchers tests",
                           f".venv/bin/python -m pytest -q -ra -n 2 --dist loadgroup --no-loadscope-reorder {args}"]}
        for cmd in wanted[target]:
            assert cmd in recipe, (line, cmd, recipe)
        for value in variables.values():  # PYTHON=..., TORCH_INDEX=... reach the recipe
            assert any(value in r for r in recipe), (line, value, recipe)


# --- the python and yaml blocks -------------------------------------------------------------------------------------
def _block(lang: str, needle: str) -> str:
    (body,) = [b.body for b in BLOCKS if b.lang == lang and needle in b.body]
    return body


def test_loss_api_block_matches_the_signature_and_runs():
    import ast
    import inspect

    import torch

    from kdexp.losses import logits_kd_loss, make_balancer

    block = _block("python", "logits_kd_loss(")
    call = re.search(r"logits_kd_loss\((.*?)\)\n", block, re.S).group(1)
    args = ast.parse(f"def f({call}): pass").body[0].args  # the page writes the call as the signature reads
    documented = [(a.arg, inspect.Parameter.empty) for a in args.args] + [
        (a.arg, ast.literal_eval(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    actual = [(name, p.default) for name, p in inspect.signature(logits_kd_loss).parameters.items()]
    assert documented == actual
    g = torch.Generator().manual_seed(0)
    namespace = {"student_logits": torch.randn(2, 3, 16, generator=g, requires_grad=True),
                 "teacher_logits": torch.randn(2, 3, 16, generator=g), "lm_loss": torch.tensor(2.0)}
    namespace["kd_loss"] = torch.tensor(0.5)
    exec(block.replace("*, ", ""), namespace)
    per_token = namespace["per_token"]
    assert per_token.shape == (2, 3) and per_token.dtype == torch.float32 and bool((per_token >= 0).all())
    assert float(namespace["total"]) == pytest.approx(0.1 * 2.0 + 0.9 * 0.5)
    assert make_balancer is namespace["make_balancer"]


def test_launcher_yaml_block_composes_from_the_site_dir(shell_env, tmp_path):
    site = tmp_path / "site"
    (site / "hydra" / "launcher").mkdir(parents=True)
    (site / "hydra" / "launcher" / "mine.yaml").write_text(_block("yaml", "slurm_gpu"))
    proc = shell("python -m kdexp.run --cfg hydra hydra/launcher=mine", {**shell_env, "KDEXP_SITE_DIR": str(site)},
                 tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launcher = yaml.safe_load(proc.stdout)["hydra"]["launcher"]
    assert (launcher["nodes"], launcher["timeout_min"], launcher["gpus_per_node"]) == (2, 1440, 8)


# --- README's groups table is the config's ---------------------------------------------------------------------------
def test_readme_groups_table_is_the_config_groups():
    from kdexp.config.help import config_groups

    rows = {}
    for line in README.read_text().split("## Config groups at a glance", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = re.findall(r"`([^`]+)`", cells[1])
    groups = config_groups()
    assert {g: sorted(o) for g, o in rows.items()} == {g: sorted(o.options) for g, o in groups.items()}
    for name, group in groups.items():  # default first
        if group.default is not None:
            assert rows[name][0] == group.default, (name, rows[name])


def test_readme_documentation_table_lists_every_docs_page():
    """Every docs/*.md page is a row of README's documentation index (and every row is a page)."""
    section = README.read_text().split("## Documentation", 1)[1].split("\n## ", 1)[0]
    linked = re.findall(r"^\| \[docs/([\w.-]+\.md)\]\(docs/\1\) \|", section, re.M)
    assert sorted(linked) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))
