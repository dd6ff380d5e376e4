# cmake -DBUILD_DIR=<consumer build> -P check_deprecation.cmake
# The deprecated names must keep old code compiling (megatorch_api_check builds
# deprecated_api.cpp) with a warning that names the replacement: built as an error here,
# the build must fail, and only on those warnings.
set(names ModelParameters gpt_model_parameters pipeline_stage_parameters optimizer_sums_tied_embedding attach_unit_hooks)
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target megatorch_deprecated_as_error
                OUTPUT_VARIABLE out ERROR_VARIABLE out RESULT_VARIABLE rc)
if(rc EQUAL 0)
  message(FATAL_ERROR "deprecated_api.cpp built with -Werror=deprecated-declarations: the optim:: aliases are "
                      "no longer deprecated\n${out}")
endif()
foreach(name IN LISTS names)
  if(NOT out MATCHES "is deprecated: use megatorch::train::${name} ")
    message(FATAL_ERROR "expected a deprecation of optim::${name} naming megatorch::train::${name}:\n${out}")
  endif()
endforeach()
# 0.3's: the schedule checks that no longer refuse anything.
set(schedule_messages "is deprecated: no schedule is refused on NCCL any more"
                      "is deprecated: use schedule_error\\(kind, pp, vpp\\)")
foreach(m IN LISTS schedule_messages)
  if(NOT out MATCHES "${m}")
    message(FATAL_ERROR "expected a deprecation matching '${m}':\n${out}")
  endif()
endforeach()
# Nothing else may fail: every error is one of those deprecations.
string(REGEX MATCHALL "error: [^\n]*" errors "${out}")
foreach(e IN LISTS errors)
  if(NOT e MATCHES "is deprecated: use megatorch::train::" AND NOT e MATCHES "is deprecated: no schedule is refused"
     AND NOT e MATCHES "is deprecated: use schedule_error" AND NOT e MATCHES "some warnings being treated as errors")
    message(FATAL_ERROR "deprecated_api.cpp failed for another reason: ${e}\n${out}")
  endif()
endforeach()
message(STATUS "the deprecated optim:: names and schedule checks warn, naming their replacements")
