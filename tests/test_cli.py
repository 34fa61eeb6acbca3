"""The command line as users type it: Hydra flags anywhere among the overrides (kdexp.run.hydra_argv), exit status 2
with one line and no traceback for a user error, 1 for a diverged or failed run, and README's sweep line verbatim."""
from __future__ import annotations

import os
import re
import shlex
import textwrap
from pathlib import Path

import pytest
import yaml
from hydra._internal.utils import get_args_parser

from kdexp.run import hydra_argv
from kdexp.track import records
from kdexp.track.faults import is_diverged as _is_diverged
from _launch import kdexp_run

REPO = Path(__file__).resolve().parents[1]
README_SWEEP = "python -m kdexp.run loss=top_p loss.top_p=0.9 -m balancer.alpha=0.5,0.9,1.0"


def parse(argv):
    """What Hydra's own parser makes of an argv (as hydra.main calls it)."""
    return vars(get_args_parser().parse_args(argv))


# ---------------------------------------------------------------------------------------------------------------------
# the argv rewrite

# Every flag of Hydra 1.3's parser: (option strings, a value it takes or None, the Namespace field and its value).
FLAGS = [
    (["-m", "--multirun"], None, "multirun", True),
    (["-c", "--cfg"], "job", "cfg", "job"),
    (["-c", "--cfg"], "hydra", "cfg", "hydra"),
    (["-c", "--cfg"], "all", "cfg", "all"),
    (["--resolve"], None, "resolve", True),
    (["-p", "--package"], "loss", "package", "loss"),
    (["-r", "--run"], None, "run", True),
    (["-sc", "--shell-completion"], None, "shell_completion", True),
    (["-cp", "--config-path"], "/some/conf", "config_path", "/some/conf"),
    (["-cn", "--config-name"], "other", "config_name", "other"),
    (["-cd", "--config-dir"], "/extra/conf", "config_dir", "/extra/conf"),
    (["--experimental-rerun"], "/run/.hydra/config.pickle", "experimental_rerun", "/run/.hydra/config.pickle"),
    (["-i", "--info"], "defaults", "info", "defaults"),
    (["-i", "--info"], "searchpath", "info", "searchpath"),
    (["-h", "--help"], None, "help", True),
    (["--hydra-help"], None, "hydra_help", True),
]


def test_the_table_covers_every_flag_of_hydras_parser():
    known = {s for a in get_args_parser()._actions for s in a.option_strings}
    covered = {s for options, *_ in FLAGS for s in options} | {"--version"}
    assert known == covered


@pytest.mark.parametrize("where", ["front", "middle", "end"])
@pytest.mark.parametrize("option, value, field, expected",
                         [(o, v, f, e) for options, v, f, e in FLAGS for o in options])
def test_every_flag_anywhere_keeps_its_value(where, option, value, field, expected):
    flag = [option] if value is None else [option, value]
    overrides = ["loss=top_p", "loss.top_p=0.9", "balancer.alpha=0.5,0.9,1.0"]
    at = {"front": 0, "middle": 2, "end": 3}[where]
    argv = overrides[:at] + flag + overrides[at:]
    out = hydra_argv(argv)
    got = parse(out)
    assert got[field] == expected
    assert got["overrides"] == overrides  # every override, in its order
    canonical = parse(flag + overrides)  # what Hydra accepts today: flags first
    assert got == canonical


def test_attached_values_and_abbreviations_as_argparse_takes_them():
    assert hydra_argv(["a=1", "--cfg=job", "b=2"]) == ["--cfg=job", "a=1", "b=2"]
    assert hydra_argv(["a=1", "-cjob"]) == ["-c=job", "a=1"]
    assert parse(hydra_argv(["a=1", "-cjob"]))["cfg"] == "job"
    assert parse(hydra_argv(["a=1", "--multi", "b=2"])) == parse(["--multirun", "a=1", "b=2"])
    assert parse(hydra_argv(["a=1", "--info=plugins", "b=2"]))["info"] == "plugins"


def test_info_takes_only_one_of_its_choices():
    # argparse alone would take the override as --info's value ("invalid choice: 'a=1'")
    assert hydra_argv(["--info", "a=1"]) == ["--info=all", "a=1"]
    assert parse(hydra_argv(["--info", "a=1"])) == {**parse(["--info", "all"]), "overrides": ["a=1"]}
    assert hydra_argv(["a=1", "-i", "config", "b=2"]) == ["-i=config", "a=1", "b=2"]
    assert hydra_argv(["a=1", "--info"]) == ["--info=all", "a=1"]


def test_several_flags_keep_their_order_and_values():
    argv = ["loss=top_p", "-m", "balancer.alpha=0.5,1.0", "--cfg", "job", "-p", "loss", "--resolve", "x=1"]
    assert hydra_argv(argv) == ["-m", "--cfg=job", "-p=loss", "--resolve", "loss=top_p", "balancer.alpha=0.5,1.0",
                                "x=1"]


@pytest.mark.parametrize("override", ["hydra.job.name=-m", "+tags=[--cfg,job]", "data.split='-1,2,3'", "a=-1",
                                      "hydra.run.dir=--multirun", "~trainer.lr", "+x=-p", "a=--info", "k=-"])
def test_an_override_whose_value_looks_like_a_flag_stays_an_override(override):
    argv = ["loss=top_p", override, "-m", "b=1"]
    assert hydra_argv(argv) == ["-m", "loss=top_p", override, "b=1"]
    assert parse(hydra_argv(argv))["overrides"] == ["loss=top_p", override, "b=1"]


def test_a_value_that_starts_with_a_dash_is_joined_to_its_flag():
    assert hydra_argv(["a=1", "-cn", "-odd-name"]) == ["-cn=-odd-name", "a=1"]
    assert parse(hydra_argv(["a=1", "-cn", "-odd-name"]))["config_name"] == "-odd-name"


def test_errors_stay_hydras_own(capsys):
    # a flag missing its value goes last, so it cannot swallow an override, and argparse says what is wrong
    assert hydra_argv(["a=1", "-p", "b=2"]) == ["-p=b=2", "a=1"]  # a value is a value (as argparse takes it)
    assert hydra_argv(["a=1", "--package"]) == ["a=1", "--package"]
    assert hydra_argv(["a=1", "--cfg", "-m"]) == ["-m", "a=1", "--cfg"]
    with pytest.raises(SystemExit) as stop:
        parse(hydra_argv(["a=1", "--cfg", "-m"]))
    assert stop.value.code == 2 and "expected one argument" in capsys.readouterr().err
    # unknown flags are passed on for argparse to name (without dragging the overrides into its message)
    assert hydra_argv(["a=1", "--bogus", "b=2"]) == ["--bogus", "a=1", "b=2"]
    with pytest.raises(SystemExit) as stop:
        parse(hydra_argv(["a=1", "--bogus", "b=2"]))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.rstrip().endswith("unrecognized arguments: --bogus")


def test_double_dash_ends_the_flags():
    assert hydra_argv(["a=1", "-m", "--", "b=2"]) == ["-m", "a=1", "--", "b=2"]
    assert hydra_argv([]) == []
    assert hydra_argv(["a=1"]) == ["a=1"]


def test_diverged_is_matched_by_class_name():
    class Diverged(RuntimeError):
        pass

    class Later(Diverged):
        pass

    assert _is_diverged(Diverged("x")) and _is_diverged(Later("x"))
    assert not _is_diverged(RuntimeError("x")) and not _is_diverged(ValueError("Diverged"))


# ---------------------------------------------------------------------------------------------------------------------
# through the real command line


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    e["KDEXP_CACHE"] = str(tmp_path / "kdexp_cache")  # never ~/.cache/kdexp
    e["WANDB_MODE"] = "disabled"
    e["PYTHONUNBUFFERED"] = "1"
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    for key in ("KDEXP_RUN_STAMP", "HYDRA_FULL_ERROR", "WORLD_SIZE", "RANK"):
        e.pop(key, None)
    return e


def test_cfg_job_with_the_flag_before_or_after_the_overrides(env, tmp_path):
    before = kdexp_run(["--cfg", "job", "loss=top_p"], env, tmp_path, check=False)
    assert before.returncode == 0, before.stderr
    cfg = yaml.safe_load(before.stdout)
    assert cfg["loss"]["name"] == "top_p" and cfg["loss"]["top_p"] == 0.95 and cfg["balancer"]["alpha"] == 0.9
    after = kdexp_run(["loss=top_p", "balancer.alpha=0.5", "--cfg", "job", "trainer.lr=0.01"], env, tmp_path,
                      check=False)
    assert after.returncode == 0, after.stderr
    cfg = yaml.safe_load(after.stdout)
    assert (cfg["loss"]["name"], cfg["balancer"]["alpha"], cfg["trainer"]["lr"]) == ("top_p", 0.5, 0.01)
    short = kdexp_run(["loss=top_p", "-c", "job", "-p", "loss"], env, tmp_path, check=False)
    assert short.returncode == 0, short.stderr
    package = yaml.safe_load(short.stdout)  # only the loss node
    assert package["name"] == "top_p" and package["min_k"] == 4 and "trainer" not in package
    assert not (tmp_path / "outputs").exists() and not Path(env["KDEXP_CACHE"]).exists()


def _nothing_built(env, cwd: Path) -> None:
    cache = Path(env["KDEXP_CACHE"])
    assert not cache.exists() or not any(cache.iterdir()), list(cache.rglob("*"))
    assert not list(cwd.rglob("wandb")) and not list(cwd.rglob("checkpoints")) and not list(cwd.rglob("metrics.jsonl"))


@pytest.mark.parametrize("overrides, line", [
    (["trainer.lr=-1"], "kdexp: error: trainer.lr=-1.0 is invalid: must be a finite number > 0"),
    (["trainer.seed=-1"], "kdexp: error: trainer.seed=-1 is invalid: must be an integer in [0, 4294967295]"),
    (["data.max_chars=100"], "kdexp: error: data.max_chars=100 is invalid: must be an integer >= 1000"),
    (["data=indexed", "data.prefixes=[/nonexistent]"],
     "kdexp: error: data.prefixes=['/nonexistent'] is invalid: no indexed dataset at '/nonexistent' "
     "(missing /nonexistent.bin and /nonexistent.idx)"),
    (["model.teacher_path={d}/teacher"],
     "kdexp: error: model.teacher_path='{d}/teacher' is invalid: its config.json has no 'vocab_size'"),
])
def test_a_bad_value_is_one_line_exit_2_and_nothing_is_built(env, tmp_path, overrides, line):
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "config.json").write_text("{}")
    run_dir = tmp_path / "run"
    args = [o.format(d=tmp_path) for o in overrides]
    r = kdexp_run([*args, f"hydra.run.dir={run_dir}"], env, tmp_path, check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [line.format(d=tmp_path)]
    assert "Traceback" not in r.stdout + r.stderr
    _nothing_built(env, tmp_path)
    assert not run_dir.exists()  # a refused run leaves nothing on disk: no run dir, no error.log for a report to count


def test_an_unknown_loss_name_is_one_line_exit_2_before_data_or_teacher(env, tmp_path):
    """`loss.name` is checked against the one table of loss names by validate(), before data, teacher or model are
    built: like any refused value (trainer.lr=-1 beside it) it leaves nothing on disk, no run dir and no cache. A new
    interpreter each (fresh), as a user's: its one line of stderr also shows that no import prints a warning."""
    for name, override in (("nope", "loss.name=nope"), ("lr", "trainer.lr=-1")):
        run_dir = tmp_path / name
        r = kdexp_run(["experiment=smoke", override, f"hydra.run.dir={run_dir}"], env, tmp_path, check=False,
                      fresh=True)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stdout + r.stderr, r.stderr
        assert not run_dir.exists(), sorted(run_dir.rglob("*"))
        if name == "nope":
            assert r.stderr.startswith("kdexp: error: loss.name='nope' is invalid: must be one of sampled, top_p, "
                                       "renorm_topk, topk, dense"), r.stderr
    _nothing_built(env, tmp_path)


@pytest.mark.parametrize("args, says", [
    (["trainer.bogus=1"], "the config has no key 'trainer.bogus'"),
    (["trainer.lr=abc"], "Value 'abc' of type 'str' could not be converted to Float"),
    (["model=nonexistent"], "model has no option 'nonexistent'"),
    (["trainer.lr=-1", "--cfg", "job", "loss.bogus=1"], "the config has no key 'loss.bogus'"),
    (["a=1", "--bogus"], "unrecognized arguments: --bogus"),
    (["--experimental-rerun", "run/.hydra/config.pickle"],
     "kdexp: error: --experimental-rerun run/.hydra/config.pickle is refused: it unpickles the file"),
    (["a=1", "--cfg"], "expected one argument"),
    (["loss=topk,top_p", "-m", "--cfg", "job"], "kdexp: error: --multirun and --cfg cannot be combined"),
])
def test_a_config_hydra_cannot_compose_exits_2_without_traceback(env, tmp_path, args, says):
    r = kdexp_run(args, env, tmp_path, check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert says in r.stderr and "Traceback" not in r.stdout + r.stderr
    _nothing_built(env, tmp_path)


# A typo never runs a different job (issue 26): each is one line and exit 2, before anything is composed or built.
TYPOS = [
    (["experiment=smokee"], "kdexp: error: experiment=smokee: experiment has no option 'smokee' (did you mean "
                            "experiment=smoke?); the options are: ghost_vs_renorm, on_policy_warm_start, "
                            "on_vs_off_policy, qwen3_before_after, smoke"),
    (["arm=befor"], "kdexp: error: arm=befor: arm has no option 'befor' (did you mean arm=before?); the options are: "
                    "after, before, k128_ghost, k128_renorm, k32_ghost, k32_renorm, k8_ghost, k8_renorm, op_ghost, op_mix, "
                    "op_off, op_renorm, op_sampled_token, sampled, top_p, topp_k128, topp_k32, topp_k8"),
    (["-m", "loss=topk,top_pp"], "kdexp: error: loss=topk,top_pp: loss has no option 'top_pp' (did you mean "
                                 "loss=top_p?); the options are: dense, renorm_topk, sampled, top_p, topk"),
    (["experiment=[smoke,qwen3]"], "kdexp: error: experiment=[smoke,qwen3]: experiment has no option 'qwen3'; the "
                                   "options are: ghost_vs_renorm, on_policy_warm_start, on_vs_off_policy, "
                                   "qwen3_before_after, smoke"),
    (["hydra/launcher=slurm"], "kdexp: error: hydra/launcher=slurm: hydra/launcher has no option 'slurm' (did you "
                               "mean hydra/launcher=slurm_gpu?); the options are: basic, local_cpu, slurm_cpu, "
                               "slurm_gpu, submitit_local, submitit_slurm"),
    (["+loss.topk=5"], "kdexp: error: +loss.topk=5: the config has no key 'loss.topk' (did you mean 'loss.top_k'?)"),
    (["loss.topk=5"], "kdexp: error: loss.topk=5: the config has no key 'loss.topk' (did you mean 'loss.top_k'?)"),
    (["++trainer.max_step=5"], "kdexp: error: ++trainer.max_step=5: the config has no key 'trainer.max_step' (did you "
                               "mean 'trainer.max_steps'?)"),
    (["loss=dense", "loss.top_p=0.9"], "kdexp: error: loss.top_p=0.9 is invalid: contradicts loss=dense (its name "
                                       "would no longer say what it trains): these options make a loss=top_p loss; "
                                       "choose loss=top_p (with its options), or leave loss.top_p at loss=dense's value"),
    (["parallel.tensor=2"], "kdexp: error: parallel.tensor=2 is invalid: needs 2 processes (one per tensor-parallel "
                            "rank) and this is one process: launch with `torchrun --nproc-per-node 2 -m kdexp.run "
                            "...`, as 2 SLURM tasks (`srun --ntasks 2 python -m kdexp.run ...`), or with "
                            "hydra/launcher=slurm_gpu hydra.launcher.tasks_per_node=2"),
]


@pytest.mark.parametrize("args, line", TYPOS, ids=[" ".join(a) for a, _ in TYPOS])
def test_a_typo_never_runs_another_job(env, tmp_path, args, line):
    r = kdexp_run([*args, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"], env, tmp_path,
                  check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [line]
    assert not (tmp_path / "sweep").exists()
    _nothing_built(env, tmp_path)


# A stand-in for kdexp.train.run_point, to see what run.py makes of a diverged or crashed run without training.
_FAKE_TRAIN = textwrap.dedent("""
    import sys, kdexp.train, kdexp.run
    class Diverged(RuntimeError):
        pass
    def run_point(cfg, **kwargs):
        if cfg.trainer.seed == 1:
            raise Diverged("non-finite loss at step 4; the last finite checkpoint is step 3 in RUNDIR")
        raise KeyError("something broke")
    kdexp.train.run_point = run_point
    kdexp.run.cli()
""")


def test_a_diverged_single_run_is_one_line_and_exit_1(env, tmp_path):
    r = kdexp_run(["trainer.seed=1", f"hydra.run.dir={tmp_path / 'run'}"], env, tmp_path, code=_FAKE_TRAIN, check=False)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.splitlines()[-1] == "kdexp: non-finite loss at step 4; the last finite checkpoint is step 3 in RUNDIR"
    assert "Traceback" not in r.stdout + r.stderr


# The real kdexp.train.run_point (it writes a single run's error), with training itself replaced by a crash.
_CRASH_IN_TRAINING = textwrap.dedent("""
    import kdexp.run, kdexp.train.loop
    def distill(*args, **kwargs):
        raise KeyError("something broke")
    kdexp.train.loop.distill = distill
    kdexp.run.cli()
""")


def test_a_crashed_single_run_exits_1_and_writes_its_error_log(env, tmp_path):
    run_dir = tmp_path / "run"
    r = kdexp_run(["experiment=smoke", "logger=none", f"hydra.run.dir={run_dir}"], env, tmp_path,
                  code=_CRASH_IN_TRAINING, check=False)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "something broke" in r.stderr
    assert "KeyError: 'something broke'" in (run_dir / records.ERROR_LOG).read_text()
    assert "KeyError: 'something broke'" in (run_dir / records.RUN_LOG).read_text()


@pytest.mark.slow
def test_readme_sweep_line_verbatim(env, tmp_path, seeded_cache):
    seeded_cache(env["KDEXP_CACHE"])  # the smoke experiment's data and teacher, built once for the test run
    readme = (REPO / "README.md").read_text()
    assert re.search(rf"^{re.escape(README_SWEEP)}(\s|$)", readme, re.M), "README lost its sweep line"
    sweep_dir = tmp_path / "sweep"
    argv = shlex.split(README_SWEEP)
    assert argv[:3] == ["python", "-m", "kdexp.run"]
    r = kdexp_run([*argv[3:], "experiment=smoke", "logger=none", f"hydra.sweep.dir={sweep_dir}"], env, tmp_path,
                  check=False)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    sweep = records.read_json(sweep_dir / records.SWEEP)
    points = sorted(sweep["points"], key=lambda p: p["num"])
    assert [p["status"] for p in points] == ["finished"] * 3
    alphas = []
    for p in points:
        summary = records.read_json(Path(p["run_dir"]) / records.SUMMARY)
        assert summary["status"] == "finished" and summary["steps"] == 6
        cfg = yaml.safe_load((Path(p["run_dir"]) / ".hydra" / "config.yaml").read_text())
        assert (cfg["loss"]["name"], cfg["loss"]["top_p"]) == ("top_p", 0.9)
        alphas.append(cfg["balancer"]["alpha"])
        assert f"balancer.alpha={cfg['balancer']['alpha']}" in summary["overrides"]
    assert alphas == [0.5, 0.9, 1.0]


def test_data_too_small_for_seq_length_is_one_line_exit_2_before_any_model(env, tmp_path):
    """Known only once the corpus is tokenized (kdexp.data.dataset._check_enough): checked right after the data step,
    before the teacher or the student exists. 1000 characters hold ~108 validation tokens: fewer than one sample."""
    run_dir = tmp_path / "run"
    r = kdexp_run(["experiment=smoke", "logger=none", "data.max_chars=1000", "trainer.seq_length=512",
                   f"hydra.run.dir={run_dir}"], env, tmp_path, check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr
    line = r.stderr.splitlines()[-1]
    assert re.fullmatch(r"kdexp: error: data too small for trainer\.seq_length=512: the (training|validation) split "
                        r"holds \d+ tokens, fewer than one sample \(513 tokens\), so every sample would repeat the "
                        r"same text; raise data\.\w+=\S+ .*or lower trainer\.seq_length to at most \d+", line), line
    assert "data.max_chars=1000" in line
    assert [x for x in r.stderr.splitlines() if x.startswith("kdexp: error")] == [line]
    cache = Path(env["KDEXP_CACHE"])
    assert not (cache / "teacher").exists() and not (cache / "teacher_cache").exists()  # no model was built
    assert not run_dir.exists()  # refused before the student: the dir it made is gone, no error.log to count

