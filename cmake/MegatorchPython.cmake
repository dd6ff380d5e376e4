# The C++ modules from Python: a pybind11 extension `megatorch/_cpp<EXT_SUFFIX>` built
# from torch_ext/csrc/*.cpp (torch::python::bind_module), imported as `megatorch.cpp`.
# pybind11 ships inside torch (torch/include/pybind11); the Python headers come from
# the interpreter in MEGATORCH_PYTHON, whose torch the build uses.
if(NOT MEGATORCH_PYTHON)
  message(STATUS "megatorch: MEGATORCH_PYTHON not set; not building the Python extension megatorch.cpp")
  return()
endif()
set(Python_EXECUTABLE ${MEGATORCH_PYTHON})
find_package(Python COMPONENTS Interpreter Development.Module)
if(NOT Python_Development.Module_FOUND)
  # An interpreter without its headers (no python3-dev) still runs the library's operators
  # and executables; only this extension needs Python.h.
  message(WARNING "megatorch: no Python headers for ${MEGATORCH_PYTHON} (install its -dev package, e.g. "
                  "python3-dev); not building the Python extension megatorch.cpp")
  return()
endif()

set(MEGATORCH_TORCH_PYTHON_LIBRARY ${TORCH_INSTALL_PREFIX}/lib/libtorch_python.so)
if(NOT EXISTS ${MEGATORCH_TORCH_PYTHON_LIBRARY})
  message(FATAL_ERROR "megatorch: expected ${MEGATORCH_TORCH_PYTHON_LIBRARY} next to torch's other libraries "
                      "(torch::python::bind_module needs it); is ${MEGATORCH_PYTHON}'s torch the one CMake found?")
endif()

file(GLOB MEGATORCH_PYTHON_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/torch_ext/csrc/*.cpp)
# MODULE library, no "lib" prefix, the interpreter's suffix (.cpython-311-x86_64-linux-gnu.so).
Python_add_library(megatorch_cpp MODULE WITH_SOABI ${MEGATORCH_PYTHON_SOURCES})
target_link_libraries(megatorch_cpp PRIVATE megatorch ${TORCH_LIBRARIES} ${MEGATORCH_TORCH_PYTHON_LIBRARY})
target_compile_options(megatorch_cpp PRIVATE -fPIC -Wall -Wextra -Wno-unused-parameter)
# Same precompiled torch headers as the library (same code model, no export define).
target_precompile_headers(megatorch_cpp REUSE_FROM megatorch)
set_target_properties(megatorch_cpp PROPERTIES
  OUTPUT_NAME _cpp
  LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/lib
  DEFINE_SYMBOL ""
  INSTALL_RPATH "$ORIGIN;${TORCH_INSTALL_PREFIX}/lib")
install(TARGETS megatorch_cpp LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
