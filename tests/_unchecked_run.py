"""kdexp.run's Hydra entry point without the submitting process's whole-sweep check (kdexp.run.cli runs it before
hydra.main): the job as a sweep runs it when its points are not known before they start (a sweeper such as Optuna or
Ax chooses them as results arrive). Tests use it for a real sweep with a point that the job's own validation refuses,
which the whole-sweep check would otherwise refuse before anything ran.

    python tests/_unchecked_run.py -m [overrides ...]     (flags first, as Hydra's parser takes them)
"""
from kdexp.run import main

if __name__ == "__main__":
    main()
