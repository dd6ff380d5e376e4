import os
from pathlib import Path

import torch

_LIB_NAME = "libmegatorch.so"
_loaded = None


def library_path() -> Path:
    """Where libmegatorch.so is taken from (see the package docstring for the order)."""
    override = os.environ.get("MEGATORCH_LIBRARY")
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(
                f"megatorch: MEGATORCH_LIBRARY={override} is not a file; point it at a built "
                f"{_LIB_NAME} or unset it")
        return path
    here = Path(__file__).resolve().parent
    candidates = [here / "lib" / _LIB_NAME, here.parent.parent / "build" / "lib" / _LIB_NAME]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        "megatorch: expected libmegatorch.so at one of "
        + ", ".join(str(c) for c in candidates)
        + "; build it with scripts/build.sh or set MEGATORCH_LIBRARY=/path/to/libmegatorch.so")


def load_library() -> Path:
    """Loads the library once per process; returns its path."""
    global _loaded
    if _loaded is None:
        path = library_path()
        torch.ops.load_library(str(path))
        _loaded = path
    return _loaded


def library_version():
    """The loaded libmegatorch.so's version, ``torch.ops.megatorch.version()``; None for a
    library built before 0.3.0, which does not report one."""
    load_library()
    try:
        return torch.ops.megatorch.version()
    except (AttributeError, RuntimeError):
        return None
