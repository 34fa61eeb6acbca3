"""kdexp's submitit launchers (``hydra/launcher=local_cpu``, ``slurm_cpu``, ``slurm_gpu``): Hydra's, except for a job
that ends without a result (killed, out of memory, out of requeues).

Hydra's submitit launcher collects every job's result with ``job.results()``, which raises submitit's
``UncompletedJobError`` for such a job: the driver then ends with that traceback, the other points' results unread,
and without the sweep's end lines (``on_multirun_end`` never runs). Here that job's result is one line on stderr
naming the point and the job, and a completed ``JobReturn`` (as SweepCallback's ``keep_going`` makes of a failed
point), so the sweep reaches its end lines; the point itself, whose worker is gone, is "interrupted" there
(kdexp.track.records.liveness) and resumes when the sweep is rerun. The only change is around ``Job.results``,
swapped for the duration of ``launch``. It lives in the ``hydra_plugins`` namespace because Hydra instantiates
launchers from there only.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher


def _ended_without_result(job: Any, num: int, exc: BaseException) -> JobReturn:
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    line = f"point #{num}: its job {job.job_id} ended without a result ({first}); rerun the sweep to resume it"
    print(f"kdexp: error: {line}", file=sys.stderr, flush=True)
    ret = JobReturn()
    ret.status = JobStatus.COMPLETED
    ret.return_value = {"status": "interrupted", "error": line}
    return ret


class _KeepResults:
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from submitit.core import core, utils

        original = core.Job.results
        asked = [initial_job_idx]  # the launcher reads the jobs' results in job-number order

        def results(job):
            num = asked[0]
            asked[0] += 1
            try:
                return original(job)
            except utils.UncompletedJobError as exc:
                return [_ended_without_result(job, num, exc)]

        core.Job.results = results
        try:
            return super().launch(job_overrides, initial_job_idx)
        finally:
            core.Job.results = original


class LocalLauncher(_KeepResults, submitit_launcher.LocalLauncher):
    pass


class SlurmLauncher(_KeepResults, submitit_launcher.SlurmLauncher):
    pass
