"""kdexp: knowledge-distillation experiments for LLMs on megatron-core.

The Hydra config groups (``conf/``) and the launcher helpers (``launchers/``) sit at the repository root beside this
package, as the house plan lays it out. The wheel ships them inside the package as ``kdexp.conf`` and
``kdexp.launchers`` (pyproject's ``package-dir``). A source checkout on ``PYTHONPATH`` has no ``kdexp/conf``, so the
checkout's root joins this package's search path: ``kdexp.conf`` is then ``<root>/conf`` of the same checkout (never
the conf of another install), and editable, source and installed runs import the same two subpackages.
"""
import os as _os
import warnings as _warnings
from pathlib import Path as _Path

# megatron-core warns at import, once per module, that it falls back to torch for the fused kernels Transformer Engine
# and Apex would give (four lines before a benchmark's --help). kdexp's local layer spec needs neither. Here, because
# every kdexp module is imported through this file before anything of kdexp imports megatron; the filters name
# megatron's modules, so the same words from anyone else still show.
_warnings.filterwarnings("ignore", message=r".*Transformer Engine and Apex are not installed.*", module=r"megatron\.")
_warnings.filterwarnings("ignore", message=r".*(Apex|apex|TransformerEngine|transformer_engine).*", module=r"megatron\.")

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
