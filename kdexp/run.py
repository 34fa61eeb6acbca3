"""Hydra entry point of kdexp: argv as users type it -> compose -> validate -> train. Nothing else lives here.

    python -m kdexp.run [group=option ...] [key=value ...]          one run (embedded default without arguments)
    python -m kdexp.run loss=top_p -m balancer.alpha=0.5,0.9,1.0    a sweep (any hydra/launcher)
    torchrun --nproc-per-node 2 -m kdexp.run parallel.tensor=2      tensor parallel

Hydra's argparse parser takes its flags only before or after all the overrides (``a=1 -m b=2`` fails with
"unrecognized arguments"). ``hydra_argv`` moves every Hydra flag, with its value, in front of the overrides; the flags
and whether each takes a value are read from Hydra's own parser (``hydra._internal.utils.get_args_parser``, the one
private Hydra name used here), so a new Hydra flag is handled without a change here.

Exit status: 0 done; 1 a run that failed or diverged (a sweep with a failed point), or a full disk / read-only
directory (one line naming the path and the cause: kdexp.track.faults); 128 + N a run that signal N stopped after
saving a checkpoint (143 for SIGTERM; kdexp.train.signals; the line says how to resume); 2 a user error: a bad command
line, a config Hydra cannot compose (unknown key, wrong type, missing option) or a value ``kdexp.config.validate``
rejects, or one that only the prepared data or the teacher cache shows wrong (``kdexp.rules.ConfigError``: data too
small for trainer.seq_length, a nucleus that overflows the cached top-K_max). A config error or a divergence in a
single run prints one line, without a Python traceback. A sweep (``-m``, or a config with hydra.mode=MULTIRUN) is
checked whole first: every point composed as Hydra will compose it and validated (kdexp.config.multirun) before
hydra.main starts, on every launcher; a refused point is one line naming the key, the value and the point, exit 2,
nothing written. ``--dry-run`` lists the points (their overrides, which would be reused) and runs nothing. In a
sweep's job an exception goes on to ``kdexp.track.sweep.SweepCallback``, which records the point as failed (a refused
value: with the single run's one line, no traceback) and lets the others run.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import hydra
from hydra.errors import ConfigCompositionException, OverrideParseException, SearchPathException
from omegaconf import DictConfig

import kdexp.conf  # noqa: F401  (registers the typed schema and the resolvers the YAML uses)
import kdexp.config
from kdexp.rules import ConfigError
from kdexp.track import claim, faults, records, rundir

# ----------------------------------------------------------------------------------------------------------------------
# argv as users type it


def _hydra_options() -> dict:
    """Option string -> argparse action of every flag Hydra's parser knows (``--cfg``, ``-c``, ``--multirun``...)."""
    from hydra._internal.utils import get_args_parser

    return {s: a for a in get_args_parser()._actions for s in a.option_strings}


def _match(token: str, options: dict):
    """(action, option string, value attached to the token or None) for a flag token, None when Hydra has no such
    flag. Accepts what argparse accepts: ``--cfg=job``, ``-cjob``, and unique abbreviations ``--multi``."""
    if token in options:
        return options[token], token, None
    name, eq, value = token.partition("=")
    if eq and name in options:
        return options[name], name, value
    if token.startswith("--"):
        hits = {o for o in options if o.startswith("--") and o.startswith(name)}
        if len(hits) == 1:
            option = hits.pop()
            return options[option], option, value if eq else None
        return None
    short = token[:2]
    if short in options and options[short].nargs != 0 and len(token) > 2:
        return options[short], short, token[2:]
    return None


def hydra_argv(argv: Sequence[str]) -> list[str]:
    """Rewrite a command line so that Hydra's parser accepts it: every flag (with its value) first, then the
    overrides in their order. Values stay as typed; a flag's value is joined to it (``--cfg=job``) so that it can
    never be mistaken for an override, nor an override for it.

    - A token that starts with ``-`` is a flag; any other token is an override, whatever its value looks like
      (``hydra.job.name=-m`` stays an override).
    - A flag with one value takes the next token (``-p loss``, ``--cfg job``); one with an optional value
      (``--info [X]``) takes it only when it is one of its choices, else gets its default (``--info=all``).
    - A flag that lacks its value, and unknown flags, are kept as typed so that Hydra's parser reports them (a
      flag missing its value goes last, where it cannot swallow an override).
    - ``--`` ends the flags: everything after it is passed on unchanged.
    """
    options = _hydra_options()
    flags: list[str] = []
    overrides: list[str] = []
    tail: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            tail = list(argv[i - 1:])
            break
        if not token.startswith("-") or token == "-":
            overrides.append(token)
            continue
        hit = _match(token, options)
        if hit is None:
            flags.append(token)  # unknown: argparse names it
            continue
        action, option, value = hit
        if action.nargs == 0 or value is not None:
            flags.append(token if action.nargs == 0 else f"{option}={value}")
        elif action.nargs == "?":
            nxt = argv[i] if i < len(argv) else None
            if nxt is not None and action.choices is not None and nxt in action.choices:
                flags.append(f"{option}={nxt}")
                i += 1
            else:
                flags.append(f"{option}={action.const}")
        elif i < len(argv) and not (argv[i].startswith("-") and _match(argv[i], options) is not None):
            flags.append(f"{option}={argv[i]}")
            i += 1
        else:
            tail.insert(0, token)  # no value: after the overrides, so that argparse says "expected one argument"
    return flags + overrides + tail


# ----------------------------------------------------------------------------------------------------------------------
# compose -> validate -> train

_EXIT = 0  # set by main() when a single run ends with a user error (2) or a divergence (1)

# Hydra's errors for a config it cannot compose (unknown key, wrong type, missing group option, bad override).
_COMPOSE_ERRORS = (OverrideParseException, ConfigCompositionException, SearchPathException)


def _single_run_failed(code: int, line: str) -> None:
    """Exit status ``code`` for cli(), and the one line on stderr on global rank 0 (every rank fails the same way;
    under torchrun also into its error file). Nothing is written into the run dir here: a refused run leaves nothing
    on disk; a run that failed after it started wrote its own error.log (kdexp.train)."""
    global _EXIT
    _EXIT = code
    _tell_torchrun(line)
    from kdexp.track.sweep import global_rank

    if global_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def _tell_torchrun(line: str) -> None:
    """Under torchrun, the line into this rank's elastic error file (TORCHELASTIC_ERROR_FILE, the JSON torch's own
    @record writes), so that torchrun's failure summary names kdexp's line as the root cause instead of "<N/A>", and
    `python -m kdexp.launchers torchrun` can say it when the rank that refused first is not global rank 0."""
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line + "\n",
                                                                   "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # the launcher's summary is a courtesy; the line is on stderr already


@hydra.main(version_base="1.3", config_path="pkg://kdexp.conf", config_name="config")
@claim.claims_its_run_dir
def main(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    run_dir = hc.runtime.output_dir
    try:
        # every check that writes nothing, before the claim: a refused run leaves nothing on disk (kdexp.track.claim)
        kdexp.config.validate(cfg)  # before W&B, data, teacher or any process group
        kdexp.config.check_launch(cfg)  # enough processes for parallel.tensor (torchrun / SLURM tasks)
        from kdexp.plan import flops_per_token, refuse_if_too_big

        refuse_if_too_big(cfg)  # trainer.gpu_memory_gb set: the plan must fit (kdexp.plan, no model built)
        # this run's dir from here on: another config's run there, or another live process on it, is refused
        # (trainer.overwrite=true starts over); then .hydra/, run.log and the point record are written
        claim.claim(run_dir, kdexp.config.config_hash(cfg), overwrite=cfg.trainer.overwrite, job=cfg)
    except ValueError as err:
        if multirun:
            raise  # SweepCallback names the refused point (nothing is written into its dir); the others go on
        claim.refused(run_dir)
        _single_run_failed(2, f"kdexp: error: {err}")
        return None
    from kdexp.train import run_point

    try:
        return run_point(cfg, flops_per_token=flops_per_token)  # the cost record's FLOPs: the plan's formulas
    except Exception as err:
        if multirun:
            raise
        end = faults.ending(err)  # which errors are one line: decided there, for run_point's records too
        if end.line is None:
            raise  # kdexp.train wrote run.log and error.log; Hydra prints the traceback; exit status 1
        if isinstance(err, ConfigError):  # the data or the teacher cache shows a value wrong, before the student
            claim.withdraw(run_dir)  # a refused run: a dir it made goes, another run's dir gets no error.log
        _single_run_failed(end.code, end.line)
        return None


def _one_mode(argv: Sequence[str]):
    """Hydra raises a bare ValueError (a traceback) for two modes at once, e.g. ``-m --cfg job``: a usage error.
    Returns the parsed command line."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)  # argparse errors exit 2 here, as they would in hydra.main
    modes = [flag for flag, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                                   ("--info", args.info), ("--shell-completion", args.shell_completion)) if on]
    if args.experimental_rerun:  # Hydra unpickles the file it names: a file in a run dir must never run code
        print(f"kdexp: error: --experimental-rerun {args.experimental_rerun} is refused: it unpickles the file, which "
              "can run code; rerun with the overrides the run dir's .hydra/overrides.yaml lists instead",
              file=sys.stderr)
        raise SystemExit(2)
    if len(modes) > 1:
        print(f"kdexp: error: {' and '.join(modes)} cannot be combined: give one of --run, --multirun, --cfg, --info"
              " and --shell-completion", file=sys.stderr)
        raise SystemExit(2)
    return args


def _known_overrides(args) -> None:
    """A group option or a key that does not exist is one line and exit 2 before Hydra composes anything
    (kdexp.config.overrides). Checked against kdexp's own config; another primary config (-cp/-cn/-cd) is Hydra's."""
    if args.config_path or args.config_name or args.config_dir or not args.overrides:
        return
    from kdexp.config import overrides

    try:
        overrides.check(args.overrides)
    except ValueError as err:
        print(f"kdexp: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


DRY_RUN = "--dry-run"  # kdexp's own flag (not Hydra's): list the points, check them, run nothing


def _would(cfg) -> str:
    """What a sweep point would do (kdexp.train.point's reuse rule, read without writing): reuse a finished run of
    the same config, resume an interrupted one from its checkpoints, or train."""
    if not cfg.trainer.reuse_finished:
        return "would train (trainer.reuse_finished=false)"
    key = kdexp.config.config_hash(cfg)
    previous = rundir.PointIndex(cfg.paths.index).lookup(key)
    if previous is None:
        return "would train"
    summary, _ = rundir.verified_summary(previous, key)
    status = (summary or {}).get("status")
    where = os.path.relpath(previous) if previous.is_relative_to(Path.cwd()) else str(previous)
    if status in records.ENDED_WELL:
        return f"would reuse {where} ({status})"
    if status == "diverged":
        return f"would stop: this config diverged before in {where}"
    if any((previous / "checkpoints").glob("step_*")):
        return f"would resume from {where}/checkpoints"
    return "would train"


def _check_sweep(args, dry_run: bool) -> None:
    """Every point of a sweep composed and checked before hydra.main starts anything (kdexp.config.multirun): a
    refused point is one line naming the key, the value and the point, exit 2, and nothing is written or launched,
    whatever the launcher. ``dry_run``: list the points (their overrides, and which would be reused) and exit,
    0 when every point passed."""
    other = [f for f, on in (("-cp/-cn/-cd", args.config_path or args.config_name or args.config_dir),
                             ("--help", args.help or args.hydra_help), ("--cfg", args.cfg), ("--info", args.info),
                             ("--shell-completion", args.shell_completion)) if on]
    if other:
        if dry_run:
            print(f"kdexp: error: {DRY_RUN} cannot be combined with {other[0]}", file=sys.stderr)
            raise SystemExit(2)
        return
    from kdexp.config import multirun
    from kdexp.plan import refuse_if_too_big
    from kdexp.track.sweep import global_rank

    try:
        sweep, points = multirun.check(args.overrides, args.multirun, describe=_would if dry_run else None,
                                       in_process_checks=(refuse_if_too_big,), single=dry_run)
    except Exception as err:  # noqa: BLE001 - Hydra's own errors: hydra.main reports them as it always does
        if not dry_run:
            return
        print(f"kdexp: error: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}",
              file=sys.stderr)
        raise SystemExit(2) from None
    refused = [p for p in points if p.refused is not None]
    speak = global_rank() == 0
    if dry_run:
        if speak:
            _print_points(sweep, points)
        raise SystemExit(2 if refused else 0)
    if not refused:
        return
    if speak:
        by_line: dict = {}
        for p in refused:
            by_line.setdefault(p.refused, []).append(p)
        for line, ps in by_line.items():
            more = f"; also {', '.join(f'#{p.num}' for p in ps[1:])}" if len(ps) > 1 else ""
            print(f"kdexp: error: {line} (sweep point #{ps[0].num} of {len(points)}: {' '.join(ps[0].overrides)}"
                  f"{more}; nothing was started)", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _print_points(sweep, points) -> None:
    what = (f"{len(points)} points, hydra/launcher={sweep.launcher_choice}" if sweep.multirun else "1 run (no -m)")
    if sweep.multirun and sweep.points is None:
        print("[dry-run] this sweep's hydra/sweeper chooses its points as results arrive: there is no list to show")
        return
    print(f"[dry-run] {what}; nothing was built, written or launched")
    for p in points:
        print(f"#{p.num} {' '.join(p.overrides) or '(defaults)'}: "
              f"{p.note if p.refused is None else 'refused: ' + p.refused}")
    bad = sum(p.refused is not None for p in points)
    if bad:
        print(f"[dry-run] {bad} of {len(points)} refused: the {'sweep' if sweep.multirun else 'run'} would not "
              "start (exit 2)")


def cli(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    dry_run = DRY_RUN in argv[:argv.index("--")] if "--" in argv else DRY_RUN in argv
    if dry_run:
        argv.remove(DRY_RUN)
    sys.argv[1:] = hydra_argv(argv)
    args = _one_mode(sys.argv[1:])
    _known_overrides(args)
    _check_sweep(args, dry_run)
    rundir.agree_on_stamp()
    try:
        main()
    except SystemExit as stop:
        # Hydra reports a composition error (its short message, no traceback) and exits 1; that is a user error.
        if stop.code == 1 and isinstance(stop.__context__, _COMPOSE_ERRORS):
            raise SystemExit(2) from None
        raise
    if _EXIT:
        raise SystemExit(_EXIT)


if __name__ == "__main__":
    cli()
