"""An offline install for GPU nodes without a package index: every wheel kdexp needs, for one Python version and Linux
platform, in one folder (``make wheelhouse``).

A node installs from it with ``pip install --no-index --find-links <folder> kdexp``. What the node already has is not
downloaded: torch always (its build is the node's: CUDA, ROCm, a vendor's), and whatever ``--have`` names (with the
packages those need, read from this environment's metadata) or ``--have-file`` lists (``pip freeze`` output taken on
the node, the exact set). Versions are the ones this checkout is tested with (this environment's) wherever they
satisfy the requirement; binary wheels are fetched for the target interpreter and platform with ``pip download``,
and a dependency published only as a source archive is built here and kept only if the wheel is pure Python.

    python -m kdexp.launchers.wheelhouse --python 3.12 --have torch transformers --out wheelhouse
"""
from __future__ import annotations

import argparse
import email.parser
import importlib.metadata as md
import platform
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
ALWAYS_HAVE = ("torch",)  # the node's own build; never shipped (nor the CUDA wheels it pulls)


def _target_env(python: str, machine: str) -> dict[str, str]:
    full = python if python.count(".") >= 2 else f"{python}.0"
    return {"python_version": ".".join(python.split(".")[:2]), "python_full_version": full, "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": machine,
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "platform_release": "", "platform_version": "", "implementation_version": full}


def manylinux_tags(machine: str, glibc_minor: int = 28) -> list[str]:
    """Every manylinux tag a glibc 2.<glibc_minor> node runs: pip takes the tags as given and adds no older ones."""
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for minor in range(glibc_minor, 4, -1):
        tags.append(f"manylinux_2_{minor}_{machine}")
        if minor in legacy:
            tags.append(f"{legacy[minor]}_{machine}")
    return tags


def _applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in ({""} | extras))


def _wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(zf.read(meta).decode())
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def _wheel_name(wheel: Path) -> str:
    return canonicalize_name(wheel.name.split("-")[0])


def _local_closure(names: list[str]) -> set[str]:
    """`names` and everything they need, as installed here (the node has a package's dependencies too)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [Requirement(r).name for r in requires if "extra ==" not in r]
    return seen


def freeze_names(path: Path) -> set[str]:
    """The canonical package names a `pip freeze` file lists (--have-file), comments and options skipped."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            names.add(canonicalize_name(re.split(r"[\s=<>!~;@\[]", line, maxsplit=1)[0]))
    return names


def _pin(req: Requirement) -> str:
    """The tested version (this environment's) when it satisfies `req`; else `req`'s own specifier."""
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        have = None
    if have is not None and req.specifier.contains(have, prereleases=True):
        return f"{req.name}=={have}"
    return f"{req.name}{req.specifier}"


class Wheelhouse:
    def __init__(self, out: Path, python: str, platforms: list[str], quiet: bool = True):
        self.out, self.python, self.platforms, self.quiet = out, python, platforms, quiet
        self.abi = "cp" + "".join(python.split(".")[:2])

    def _pip(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pip", *args, *(["-q"] if self.quiet else [])],
                              capture_output=True, text=True)

    def download(self, pins: list[str]) -> None:
        """Binary wheels for the target; one pip call for the whole batch, then one by one to find a source-only
        package, which is built here and kept if pure Python."""
        base = ["download", "--no-deps", "--only-binary=:all:", "--python-version", self.python, "--implementation",
                "cp", "--abi", self.abi, "--abi", "abi3", "--abi", "none", "-d", str(self.out)]
        for p in self.platforms:
            base += ["--platform", p]
        if self._pip(*base, *pins).returncode == 0:
            return
        for pin in pins:
            if self._pip(*base, pin).returncode == 0:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                built = self._pip("wheel", "--no-deps", "-w", tmp, pin)
                wheels = list(Path(tmp).glob("*.whl"))
                if built.returncode != 0 or not wheels:
                    raise SystemExit(f"wheelhouse: no wheel for {pin} (python {self.python}, {self.platforms}): "
                                     f"{(built.stderr or '').strip().splitlines()[-1:]}")
                (wheel,) = wheels
                if not wheel.name.endswith("-none-any.whl"):
                    raise SystemExit(f"wheelhouse: {pin} is published as source only and builds a binary wheel "
                                     f"({wheel.name}) for this machine, not for python {self.python}")
                wheel.rename(self.out / wheel.name)

    def build_kdexp(self) -> Path:
        if not (ROOT / "pyproject.toml").is_file():
            raise SystemExit(f"wheelhouse: run it from a kdexp source checkout (no pyproject.toml at {ROOT})")
        for old in self.out.glob("kdexp-*.whl"):
            old.unlink()
        proc = self._pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(self.out), str(ROOT))
        if proc.returncode != 0:
            raise SystemExit(f"wheelhouse: building kdexp's wheel failed:\n{proc.stderr[-2000:]}")
        (wheel,) = self.out.glob("kdexp-*.whl")
        return wheel

    def fill(self, skip: set[str], extras: list[str], machine: str) -> list[Path]:
        env = _target_env(self.python, machine)
        kdexp = self.build_kdexp()
        wanted: dict[str, set[str]] = {"kdexp": set(extras)}
        done: set[str] = set()
        todo = [(kdexp, set(extras))]
        while todo:
            nxt: dict[str, Requirement] = {}
            for wheel, extras_of in todo:
                for req in _wheel_requirements(wheel):
                    name = canonicalize_name(req.name)
                    if name in skip or not _applies(req, env, extras_of):
                        continue
                    known = wanted.setdefault(name, set())
                    if name in done and set(req.extras) <= known:
                        continue
                    known |= set(req.extras)
                    nxt.setdefault(name, req)
            fresh = [req for name, req in nxt.items() if name not in done]
            if fresh:
                self.download([_pin(req) for req in fresh])
            done |= set(nxt)
            by_name = {_wheel_name(w): w for w in self.out.glob("*.whl")}
            todo = [(by_name[name], wanted[name]) for name in nxt if name in by_name]
            missing = [name for name in nxt if name not in by_name]
            if missing:
                raise SystemExit(f"wheelhouse: pip reported success but left no wheel for {missing}")
        keep = {"kdexp"} | done
        for wheel in self.out.glob("*.whl"):  # an older fill's leftovers
            if _wheel_name(wheel) not in keep:
                wheel.unlink()
        return sorted(self.out.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdexp.launchers.wheelhouse", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=platform.python_version(), help="target Python version (default: this one)")
    ap.add_argument("--machine", default=platform.machine(), help="target CPU (default: this one's)")
    ap.add_argument("--platform", nargs="+", default=None,
                    help="pip platform tags (default: manylinux 2.5 to 2.28 for --machine: glibc 2.28 or newer)")
    ap.add_argument("--have", nargs="*", default=[], help="packages the node has already (with their dependencies)")
    ap.add_argument("--have-file", type=Path, help="`pip freeze` taken on the node: exactly what it has")
    ap.add_argument("--extras", nargs="*", default=[], help="kdexp extras to include (e.g. dev)")
    ap.add_argument("--out", type=Path, default=Path("wheelhouse"))
    ap.add_argument("--max-mib", type=float, default=None, help="fail when the folder is larger than this")
    args = ap.parse_args(argv)
    skip = _local_closure([*ALWAYS_HAVE, *args.have])
    if args.have_file:
        skip |= freeze_names(args.have_file)
    skip.discard("kdexp")
    args.out.mkdir(parents=True, exist_ok=True)
    platforms = args.platform or manylinux_tags(args.machine)
    wheels = Wheelhouse(args.out, args.python, platforms).fill(skip, args.extras, args.machine)
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"wheelhouse: {len(wheels)} wheels, {mib:.1f} MiB in {args.out} for python {args.python} "
          f"({', '.join(platforms)}); not included (the node has them): {', '.join(sorted(skip)) or '-'}")
    print(f"install on the node: python -m pip install --no-index --find-links {args.out} kdexp")
    if args.max_mib is not None and mib > args.max_mib:
        print(f"wheelhouse: {mib:.1f} MiB is over --max-mib {args.max_mib}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
