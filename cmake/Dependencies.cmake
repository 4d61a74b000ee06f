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
