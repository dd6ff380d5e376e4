# The library-backed tokenizers (csrc/data/python_tokenizer.cpp) run
# torch_ext/megatorch/tokenizers.py with a Python interpreter. Baked in here: the
# interpreter the build was configured with, the source tree's script, and where an
# install puts the script relative to the installed library. The definitions go on that
# one source file so the library's precompiled header stays shared with the executables.
set(MEGATORCH_TOKENIZER_SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/torch_ext/megatorch/tokenizers.py)
file(RELATIVE_PATH MEGATORCH_TOKENIZER_SCRIPT_FROM_LIB ${CMAKE_INSTALL_FULL_LIBDIR}
     ${CMAKE_INSTALL_FULL_DATADIR}/megatorch/tokenizers.py)
set_property(SOURCE ${CMAKE_CURRENT_SOURCE_DIR}/csrc/data/python_tokenizer.cpp APPEND PROPERTY COMPILE_DEFINITIONS
  "MEGATORCH_BUILD_PYTHON=\"${MEGATORCH_PYTHON}\""
  "MEGATORCH_SOURCE_TOKENIZER_SCRIPT=\"${MEGATORCH_TOKENIZER_SCRIPT}\""
  "MEGATORCH_TOKENIZER_SCRIPT_FROM_LIB=\"${MEGATORCH_TOKENIZER_SCRIPT_FROM_LIB}\"")
install(FILES ${MEGATORCH_TOKENIZER_SCRIPT} DESTINATION ${CMAKE_INSTALL_DATADIR}/megatorch)
