"""kdexp: knowledge-distillation experiments for LLMs on megatron-core.

The Hydra config groups (``conf/``) and the launcher helpers (``launchers/``) sit at the repository root beside this
package, as the house plan lays it out. The wheel ships them inside the package as ``kdexp.conf`` and
``kdexp.launchers`` (pyproject's ``package-dir``). A source checkout on ``PYTHONPATH`` has no ``kdexp/conf``, so the
checkout's root joins this package's search path: ``kdexp.conf`` is then ``<root>/conf`` of the same checkout (never
the conf of another install), and editable, source and installed runs import the same two subpackages.
"""
import functools as _functools
import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.machinery as _machinery
import os as _os
import sys as _sys
import warnings as _warnings
from pathlib import Path as _Path

# megatron-core warns at import, once per module, that it falls back to torch for the fused kernels Transformer Engine
# and Apex would give (four lines before a benchmark's --help). kdexp's local layer spec needs neither. Here, because
# every kdexp module is imported through this file before anything of kdexp imports megatron; the filters name
# megatron's modules, so the same words from anyone else still show.
_warnings.filterwarnings("ignore", message=r".*Transformer Engine and Apex are not installed.*", module=r"megatron\.")
_warnings.filterwarnings("ignore", message=r".*(Apex|apex|TransformerEngine|transformer_engine).*", module=r"megatron\.")


# megatron-core decorates its fused kernels with ``megatron.core.jit.jit_fuser``, which is ``torch.compile``: applying
# it imports torch._dynamo and torch._inductor while ``import megatron.core`` runs, about as long again as importing
# torch, in every process that imports megatron, although kdexp's local layer spec calls none of those kernels. Here
# (before anything imports megatron, as for the filters above) jit_fuser becomes a decorator that hands the function to
# torch.compile on its first call: torch.compile compiles on the first call anyway, so a kernel that runs is compiled
# as before; one that never runs costs nothing.
def _compile_on_first_call(compile_fn):
    def jit_fuser(fn=None, **options):
        if fn is None:  # @jit_fuser(options...)
            return lambda f: jit_fuser(f, **options)
        compiled = []

        @_functools.wraps(fn)
        def call(*args, **kwargs):
            if not compiled:
                compiled.append(compile_fn(fn, **options))
            return compiled[0](*args, **kwargs)
        return call
    return jit_fuser


class _LazyJitFuser(_importlib_abc.MetaPathFinder):
    """Finds megatron.core.jit as the path finder does and swaps its torch.compile for _compile_on_first_call's."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core.jit":
            return None
        spec = _machinery.PathFinder.find_spec(name, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_lazily(module):
            exec_module(module)
            import torch

            if getattr(module, "jit_fuser", None) is torch.compile:
                module.jit_fuser = _compile_on_first_call(torch.compile)
        spec.loader.exec_module = exec_lazily
        return spec


if not any(isinstance(f, _LazyJitFuser) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _LazyJitFuser())

_root = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "conf").is_dir() and (_root / "conf" / "__init__.py").is_file() \
        and (_root / "launchers" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821  (the package's own __path__)
del _root


def cache_dir() -> _Path:
    """The cache root of every built artefact (datasets, tokenizers, teacher caches, the native loss kernel):
    ``$KDEXP_CACHE`` if set, else ``~/.cache/kdexp``."""
    root = _os.environ.get("KDEXP_CACHE") or _os.path.join("~", ".cache", "kdexp")
    return _Path(root).expanduser().resolve()


def lazy_exports(package: str, exports: dict):
    """(__getattr__, __dir__) for a package whose names load on first use (PEP 562): ``exports`` maps each name to the
    submodule that defines it. kdexp.losses uses it so that kdexp.config imports the torch-free options without torch,
    kdexp.report so that the sweep callback Hydra makes in every run imports no matplotlib."""
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(_importlib.import_module(f"{package}.{exports[name]}"), name)

    def __dir__():
        return sorted(set(vars(_importlib.import_module(package))) | set(exports))

    return __getattr__, __dir__
