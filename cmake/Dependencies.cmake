# Third-party dependencies: Debian 12 packages (see scripts/setup), CUDA under /usr/local/cuda.
find_package(Threads REQUIRED)
find_package(ucx REQUIRED)

# CAF 0.17 ships no CMake package.
find_path(CAF_INCLUDE_DIR caf/all.hpp REQUIRED)
find_library(CAF_CORE_LIBRARY caf_core REQUIRED)
find_library(CAF_IO_LIBRARY caf_io REQUIRED)
add_library(troupe_caf INTERFACE)
target_include_directories(troupe_caf SYSTEM INTERFACE ${CAF_INCLUDE_DIR})
target_link_libraries(troupe_caf INTERFACE ${CAF_IO_LIBRARY} ${CAF_CORE_LIBRARY} Threads::Threads)

find_package(CLI11 REQUIRED)
find_package(tomlplusplus REQUIRED)  # job files (runtime/job_config.cpp)
find_package(ZLIB REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(doctest REQUIRED)

# LibTorch (Debian libtorch-dev, CPU; the torch wheel's libtorch on GPU machines).
find_package(Torch REQUIRED)
find_path(TORCH_VERSION_INCLUDE_DIR torch/csrc/api/include/torch/version.h PATHS /usr/include)

set(TROUPE_HAVE_CUDA OFF)
if(TROUPE_WITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(TROUPE_HAVE_CUDA ON)
  endif()
endif()
message(STATUS "troupe: CUDA ${TROUPE_HAVE_CUDA}")

# NCCL (CUDA buffers' collectives, comm/transport/nccl/): with CUDA only, from the toolkit's tree
# or NCCL_ROOT. TROUPE_HAVE_NCCL becomes a public compile definition of troupe_comm.
set(TROUPE_HAVE_NCCL OFF)
if(TROUPE_HAVE_CUDA)
  get_filename_component(_troupe_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${_troupe_cuda_root}
    /usr/local/cuda PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY nccl HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${_troupe_cuda_root}
    /usr/local/cuda PATH_SUFFIXES lib64 lib)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(TROUPE_HAVE_NCCL ON)
    # An imported target, so that the exported troupe_comm names NCCL::nccl (which
    # troupeConfig.cmake finds again on the consumer's machine), not this machine's libnccl path.
    add_library(NCCL::nccl UNKNOWN IMPORTED)
    set_target_properties(NCCL::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
  unset(_troupe_cuda_root)
endif()
message(STATUS "troupe: NCCL ${TROUPE_HAVE_NCCL}")

# LibTorch's c10_cuda (the torch wheel on GPU machines; Debian's CPU libtorch has none): with it,
# DistributedModule records gradient events on torch's current CUDA stream instead of the legacy
# default stream.
set(TROUPE_HAVE_C10_CUDA OFF)
if(TROUPE_HAVE_CUDA)
  find_library(TROUPE_C10_CUDA_LIBRARY c10_cuda HINTS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
  if(TROUPE_C10_CUDA_LIBRARY)
    set(TROUPE_HAVE_C10_CUDA ON)
  endif()
endif()
message(STATUS "troupe: c10_cuda ${TROUPE_HAVE_C10_CUDA}")
