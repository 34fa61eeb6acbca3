"""W&B for one run: offline by default, online when WANDB_MODE / logger.wandb.mode says so; rank 0 only.

The run writes into ``<run_dir>/wandb``; its id is kept in ``<run_dir>/wandb_id`` so a resumed run (after a kill or a
SLURM requeue) continues the same W&B run. In a sweep the group is the sweep's directory name and the run is named by
its overrides. With W&B offline nothing is lost: ``wandb sync <run_dir>/wandb/offline-run-*`` uploads later.

Training never waits on W&B: before an online ``wandb.init`` the server (WANDB_BASE_URL, else wandb's own setting) is
probed with one HTTP HEAD bounded at PROBE_TIMEOUT_S, and init itself is bounded by wandb's ``init_timeout`` setting
(INIT_TIMEOUT_S unless WANDB_INIT_TIMEOUT says otherwise; wandb's own default is 90 s). An unreachable server or a
failed online init gives one warning and the run continues in offline mode, ready for ``wandb sync``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf

log = logging.getLogger("kdexp")

PROBE_TIMEOUT_S = 3.0
INIT_TIMEOUT_S = 20.0
DEFAULT_BASE_URL = "https://api.wandb.ai"


def base_url() -> str:
    """The W&B server this process would talk to: $WANDB_BASE_URL, else wandb's settings (``wandb login --host``)."""
    if os.environ.get("WANDB_BASE_URL"):
        return os.environ["WANDB_BASE_URL"]
    try:  # loads the settings files and environment only; starts no wandb service
        from wandb.sdk import wandb_setup

        return str(wandb_setup.singleton().settings.base_url)
    except Exception:
        return DEFAULT_BASE_URL


def unreachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """None when `url` answers an HTTP HEAD within `timeout` seconds (any status: the server is there), else why not.

    The request runs in a daemon thread joined with the timeout, so a slow DNS lookup or a server that accepts the
    connection but never answers is bounded too (socket timeouts alone do not cover name resolution)."""
    outcome: list[Optional[str]] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)  # 401/404/...: an HTTP answer, the server is up
        except Exception as err:  # URLError, timeouts, refused connections, TLS errors, bad URLs
            outcome.append(f"{type(err).__name__}: {getattr(err, 'reason', err)}")

    thread = threading.Thread(target=probe, name="kdexp-wandb-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


class WandbLogger:
    def __init__(self, cfg, run_dir: Path, *, enabled: bool, name: str, group: Optional[str], job_type: str,
                 overrides: Optional[list] = None, tags: Sequence[str] = (), extra_config: Optional[dict] = None):
        """``tags``: added after logger.wandb.tags (kdexp.track.loggers.run_tags: loss, teacher, experiment, arm,
        swept keys); ``extra_config``: top-level keys added to the logged config (a reused point's reused_from)."""
        self.run = None
        self.mode: Optional[str] = None  # the mode the run really got ("offline" after a fallback)
        if not (enabled and cfg.logger.wandb.enabled):
            return
        import wandb

        w = cfg.logger.wandb
        mode = w.mode or os.environ.get("WANDB_MODE") or "offline"
        id_file = Path(run_dir) / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        settings = {"console": "off", "quiet": True}
        if "WANDB_SILENT" not in os.environ:
            # wandb's banner (offline mode, where the data is, `wandb leet`) on every run says nothing the run's own
            # last lines do not: kdexp prints the run's W&B dir and the `wandb sync` command. WANDB_SILENT=false shows it.
            settings["silent"] = True
        if mode == "online":
            url = base_url()
            started = time.perf_counter()
            problem = unreachable(url)
            if problem is not None:
                log.warning("W&B server %s unreachable (%s, %.1f s): logging offline instead; upload later with "
                            "`wandb sync %s/wandb/offline-run-*`", url, problem, time.perf_counter() - started,
                            run_dir)
                mode = "offline"
            elif "WANDB_INIT_TIMEOUT" not in os.environ:
                settings["init_timeout"] = INIT_TIMEOUT_S
        config = OmegaConf.to_container(cfg, resolve=True)
        group = w.group or group
        config["logger"]["wandb"]["group"] = group  # the group the run is in, not the null that means "the sweep's"
        kwargs = dict(
            project=w.project, entity=w.entity, group=group, name=name, job_type=job_type,
            tags=list(dict.fromkeys([*w.tags, *tags])), dir=str(run_dir), id=run_id, resume="allow",
            # the overrides too, so a report from the W&B group sees the same swept keys as one from run dirs
            config={**config, "overrides": list(overrides or []), **(extra_config or {})})
        try:
            self.run = wandb.init(mode=mode, settings=wandb.Settings(**settings), **kwargs)
        except Exception as err:
            if mode != "online":
                raise
            # reachable but init failed or timed out (auth, server error): the run must not die for its logger
            reason = " ".join(str(err).split())
            log.warning("W&B online init failed (%s: %s): logging offline instead; upload later with "
                        "`wandb sync %s/wandb/offline-run-*`", type(err).__name__,
                        reason if len(reason) <= 200 else reason[:200] + "...", run_dir)
            mode = "offline"
            settings.pop("init_timeout", None)
            wandb.teardown()  # the failed online init keeps its run id registered in wandb's service: free it
            self.run = wandb.init(mode=mode, settings=wandb.Settings(**settings), **kwargs)
        self.mode = mode

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if k not in ("step", "kind")}, step=step)

    def summary(self, final: dict) -> None:
        if self.run is not None:
            self.run.summary.update(final)

    def finish(self, exit_code: int = 0) -> None:
        """End the run; its .wandb file is complete on disk when this returns (kdexp.track.wandb_read reads it).

        wandb 0.31's ``run.finish`` returns before its wandb-core service has written the records (right after
        finish the file can hold a few bytes, the whole run only seconds later); ``wandb.teardown`` waits for the
        service, as the process exit would. A sweep running its points in one process starts a fresh service per point."""
        if self.run is not None:
            import wandb

            self.run.finish(exit_code=exit_code)
            self.run = None
            wandb.teardown()
