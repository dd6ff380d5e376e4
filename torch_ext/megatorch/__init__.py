"""megatorch: Megatron-style parallelism for LibTorch, usable from Python.

Importing this package loads ``libmegatorch.so`` so that ``torch.ops.megatorch.*``
exist. The library is found, in order, at ``$MEGATORCH_LIBRARY``, next to this package
(an installed wheel), or in the repository's ``build/lib`` (an editable install).
"""
from ._library import library_path, load_library
from .comm import comm_stats, reset_comm_stats

load_library()

from . import nn  # noqa: E402  (needs the operators loaded)
from . import optim  # noqa: E402

__all__ = ["comm_stats", "reset_comm_stats", "library_path", "load_library", "nn", "optim"]
