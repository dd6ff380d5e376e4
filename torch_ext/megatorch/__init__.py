"""megatorch: Megatron-style parallelism for LibTorch, usable from Python.

Importing this package loads ``libmegatorch.so`` so that ``torch.ops.megatorch.*``
exist. The library is found, in order, at ``$MEGATORCH_LIBRARY``, next to this package
(an installed wheel), or in the repository's ``build/lib`` (an editable install).
"""
import warnings

from ._library import library_path, library_version, load_library
from ._version import __version__
from .comm import comm_stats, reset_comm_stats

load_library()
if library_version() != __version__:
    # A library from another build or install than this package: operators may differ.
    warnings.warn(f"megatorch: the Python package is {__version__} but {library_path()} reports "
                  f"{library_version() or 'no version (older than 0.3.0)'}; rebuild with scripts/build.sh or "
                  "point MEGATORCH_LIBRARY at the matching libmegatorch.so")

from . import nn  # noqa: E402  (needs the operators loaded)
from . import optim  # noqa: E402

__all__ = ["__version__", "comm_stats", "reset_comm_stats", "library_path", "library_version", "load_library", "nn",
           "optim"]
