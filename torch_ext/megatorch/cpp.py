"""megatorch's C++ modules from Python: the exact C++ model, as ``torch.nn.Module`` s.

::

    import megatorch.cpp as mt
    config = mt.TransformerConfig(hidden_size=64, num_attention_heads=4, num_layers=2,
                                  seq_length=32, vocab_size=256, position_embedding_type="rope")
    model = mt.GPTModel(config)                       # or GPTModel(config, group=tp_group)
    loss = model.loss(ids, labels)                    # ids, labels: [b, s] int64
    loss.backward()
    model.allreduce_sequence_parallel_grads()         # with sequence_parallel=True

``GPTModel``, ``TransformerLayer``, ``ParallelAttention`` and ``ParallelMLP`` are bound
with ``torch::python::bind_module``: each is a ``torch.nn.Module`` delegating to the C++
module (its parameters are the C++ tensors). A ``group`` is a c10d group's registered
name or a ``torch.distributed`` group; ``None`` means no tensor parallelism.

Context parallelism: ``TransformerConfig(context_parallel_group=cp_group, cp_comm_type="p2p")``
(or ``"a2a"``) makes every layer take its CP rank's share of each sequence, [s/c, b, h];
``context_parallel_positions`` and ``context_parallel_slice`` give that share
(include/megatorch/transformer/context_parallel.h).

Packed documents: ``position_ids, document_ids = pack_documents(ids, eod)`` and
``model(ids, position_ids=position_ids, document_ids=document_ids)``: positions restart and
attention stays inside each document (include/megatorch/transformer/packed_sequence.h).

The extension (``_cpp<EXT_SUFFIX>``) is built next to ``libmegatorch.so`` and taken from
the same place as the library: the folder of ``$MEGATORCH_LIBRARY``, this package's
``lib/``, or the repository's ``build/lib``.
"""
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

from ._library import load_library

_NAME = "megatorch._cpp"


def extension_path() -> Path:
    """Where the extension is taken from: next to the libmegatorch.so that was loaded
    (never from another build: the two must match)."""
    library = load_library()
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = library.parent / f"_cpp{suffix}"
        if path.is_file():
            return path
    raise ImportError(
        f"megatorch: the Python extension _cpp{importlib.machinery.EXTENSION_SUFFIXES[0]} was not found in "
        f"{library.parent}, next to {library.name}; build it with scripts/build.sh (target megatorch_cpp, built "
        f"when CMake is configured with MEGATORCH_PYTHON set to this interpreter, {sys.executable})")


def _load():
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    path = extension_path()  # loads libmegatorch.so first: the extension links it
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        del sys.modules[_NAME]
        raise ImportError(f"megatorch: could not import {path} ({e}); it must be built against this "
                          f"interpreter's torch ({sys.executable})") from e
    return module


_cpp = _load()

TransformerConfig = _cpp.TransformerConfig
GPTModel = _cpp.GPTModel
TransformerLayer = _cpp.TransformerLayer
ParallelAttention = _cpp.ParallelAttention
ParallelMLP = _cpp.ParallelMLP
rope_frequencies = _cpp.rope_frequencies
context_parallel_positions = _cpp.context_parallel_positions
context_parallel_slice = _cpp.context_parallel_slice
pack_documents = _cpp.pack_documents
document_causal_attention = _cpp.document_causal_attention
checkpoint_config = _cpp.checkpoint_config
read_checkpoint_tensors = _cpp.read_checkpoint_tensors


def _cpp_module(model):
    """The C++ module behind a bind_module wrapper (the functions below take it)."""
    return getattr(model, "cpp_module", model)


def save_checkpoint(model, dir, iteration, group=None, writer=True):
    """Saves a GPTModel's parameters as checkpoint ``iteration`` under ``dir`` (include/megatorch/ckpt):
    sharded by its TP layout, loadable at any other. ``group``: every rank taking part (usually the
    world), None for one process; ``writer=False`` on data-parallel replicas."""
    _cpp.save_checkpoint(_cpp_module(model), str(dir), iteration, group, writer)


def load_checkpoint(model, dir, iteration=-1, group=None):
    """Loads checkpoint ``iteration`` (-1: the latest) of ``dir`` into a GPTModel, whatever layout saved
    it; returns the iteration. Another model shape, a missing shard or a bad checksum raise before any
    weight changes."""
    return _cpp.load_checkpoint(_cpp_module(model), str(dir), iteration, group)

# bind_module's wrappers are made at run time: give them this module's name and the
# constructor's signature as their documentation.
for _cls in (GPTModel, TransformerLayer, ParallelAttention, ParallelMLP):
    _cls.__module__ = __name__
    _cls.__doc__ = getattr(_cpp.cpp, _cls.__name__).__init__.__doc__

__all__ = ["TransformerConfig", "GPTModel", "TransformerLayer", "ParallelAttention", "ParallelMLP",
           "rope_frequencies", "context_parallel_positions", "context_parallel_slice", "pack_documents",
           "document_causal_attention", "save_checkpoint",
           "load_checkpoint", "checkpoint_config", "read_checkpoint_tensors", "extension_path"]
