# CUDA: when the torch found was built with CUDA, compile csrc/kernels/cuda/*.cu into the
# library (sm_90 + PTX) and build the NCCL path of the process groups. The .cu files
# and ProcessGroupNCCL calls must compile and link on machines without a GPU too.
set(MEGATORCH_WITH_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR CAFFE2_USE_CUDA)
  set(MEGATORCH_WITH_CUDA ON)
endif()

function(megatorch_configure_cuda target)
  if(NOT MEGATORCH_WITH_CUDA)
    message(STATUS "megatorch: torch has no CUDA; building the CPU path only")
    return()
  endif()
  if(NOT CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES 90-real 90-virtual PARENT_SCOPE)
    set(CMAKE_CUDA_ARCHITECTURES 90-real 90-virtual)
  endif()
  enable_language(CUDA)
  file(GLOB_RECURSE cu_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/csrc/kernels/cuda/*.cu)
  target_sources(${target} PRIVATE ${cu_sources})
  set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES "90-real;90-virtual")
  # ProcessGroupNCCL.hpp needs nccl.h: the toolkit's, or the nvidia-nccl wheel's.
  find_path(MEGATORCH_NCCL_INCLUDE nccl.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS} ${MEGATORCH_NCCL_HINT} /usr/local/cuda/include)
  if(NOT MEGATORCH_NCCL_INCLUDE)
    message(FATAL_ERROR "megatorch: torch has CUDA but nccl.h was not found; set MEGATORCH_NCCL_HINT to the folder holding it")
  endif()
  target_include_directories(${target} PRIVATE ${MEGATORCH_NCCL_INCLUDE})
  target_compile_definitions(${target} PUBLIC MEGATORCH_WITH_CUDA PRIVATE USE_C10D_NCCL)
  message(STATUS "megatorch: CUDA build (nccl.h in ${MEGATORCH_NCCL_INCLUDE})")
endfunction()
