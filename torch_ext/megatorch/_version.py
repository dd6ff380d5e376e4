# The Python package's version; pyproject.toml reads it from here. It must equal the CMake
# project's version (CMakeLists.txt, the C++ headers' MEGATORCH_VERSION_STRING) and the
# loaded library's torch.ops.megatorch.version(): tests/python/unit/test_import.py.
__version__ = "0.3.0"
