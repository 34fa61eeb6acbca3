"""The launcher scripts of an installed kdexp, without knowing where site-packages is.

    python -m kdexp.launchers start-slurm     # = bash launchers/start_slurm.sh (one-node SLURM cluster)
    python -m kdexp.launchers stop-slurm
    python -m kdexp.launchers site            # which site dir is in use and where site/local.yaml goes
    python -m kdexp.launchers torchrun --nproc-per-node 2 -m kdexp.run ...
                                              # torchrun passing the workers' status on (launchers/torchrun.py)
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kdexp.launchers.site import SITE_ENV, site_dir, user_site_dir

HERE = Path(__file__).resolve().parent
SCRIPTS = {"start-slurm": "start_slurm.sh", "stop-slurm": "stop_slurm.sh"}


def main(argv: list[str]) -> int:
    if argv[:1] == ["torchrun"]:
        from kdexp.launchers.torchrun import main as torchrun
        return torchrun(argv[1:])
    if len(argv) == 1 and argv[0] in SCRIPTS:
        return subprocess.call(["bash", str(HERE / SCRIPTS[argv[0]])])
    if argv == ["site"]:
        d = site_dir()
        print(f"site dir: {d if d is not None else 'none'} (${SITE_ENV}, else {user_site_dir()} when it exists)")
        target = (d or user_site_dir()) / "site" / "local.yaml"
        print(f"site file: {target} ({'present' if target.is_file() else 'absent'}); "
              f"template: {HERE / 'site.yaml.example'}")
        return 0
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
