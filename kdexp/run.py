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
single run prints one line, without a Python traceback. In a sweep the exception goes on to
``kdexp.track.sweep.SweepCallback``, which records the point as failed and lets the others run.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

import hydra
from hydra.errors import ConfigCompositionException, OverrideParseException, SearchPathException
from omegaconf import DictConfig

import kdexp.conf  # noqa: F401  (registers the typed schema and the resolvers the YAML uses)
import kdexp.config
from kdexp.rules import ConfigError
from kdexp.track import claim, faults, rundir

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


def _is_diverged(err: BaseException) -> bool:
    """kdexp.train's ``Diverged`` (a RuntimeError subclass), matched by class name so that this module needs no
    import of the training code before the config is known good (and works where that class does not exist)."""
    return isinstance(err, RuntimeError) and any(c.__name__ == "Diverged" for c in type(err).__mro__)


def _single_run_failed(code: int, line: str) -> None:
    """Exit status ``code`` for cli(), and the one line on stderr on global rank 0 (every rank fails the same way).
    Nothing is written here: a refused run leaves nothing on disk; a run that failed after it started wrote its own
    error.log (kdexp.train)."""
    global _EXIT
    _EXIT = code
    from kdexp.track.sweep import global_rank

    if global_rank() == 0:
        print(line, file=sys.stderr, flush=True)


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
        from kdexp.plan import refuse_if_too_big

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
        return run_point(cfg)
    except Exception as err:
        if multirun:
            raise
        if isinstance(err, ConfigError):  # the data or the teacher cache shows a value wrong: before the student
            claim.withdraw(run_dir)  # a refused run: a dir it made goes, another run's dir gets no error.log
            _single_run_failed(2, f"kdexp: error: {err}")
            return None
        if _is_diverged(err):  # kdexp.train wrote summary.json (status diverged), run.log and error.log
            _single_run_failed(1, f"kdexp: {err}")
            return None
        fault = faults.disk_fault(err)
        if fault is not None:  # a full disk, a read-only dir: the path and the cause, no traceback
            _single_run_failed(1, f"kdexp: error: {faults.describe(fault)}")
            return None
        raise  # kdexp.train wrote run.log and error.log; Hydra prints the traceback; exit status 1


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


def cli(argv: Optional[Sequence[str]] = None) -> None:
    sys.argv[1:] = hydra_argv(sys.argv[1:] if argv is None else argv)
    _known_overrides(_one_mode(sys.argv[1:]))
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
