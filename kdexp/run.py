"""Hydra entry point of kdexp: compose -> validate -> train. Nothing else lives here.

    python -m kdexp.run [group=option ...] [key=value ...]          one run (embedded default without arguments)
    python -m kdexp.run -m balancer.alpha=0.5,0.9,1.0               a sweep (any hydra/launcher)
    torchrun --nproc-per-node 2 -m kdexp.run parallel.tensor=2      tensor parallel
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

import kdexp.conf  # noqa: F401  (registers the typed schema and the resolvers the YAML uses)
import kdexp.config
from kdexp.track import rundir


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    kdexp.config.validate(cfg)  # before any model, data or process group is built
    from kdexp.train import run_point

    return run_point(cfg)


def cli() -> None:
    rundir.agree_on_stamp()
    main()


if __name__ == "__main__":
    cli()
