# Third-party dependencies: Debian 12 packages (see scripts/setup), LibTorch (the torch wheel that
# scripts/setup installs in .venv, or the user's own through Torch_DIR / CMAKE_PREFIX_PATH), CUDA
# under /usr/local/cuda.
find_package(Threads REQUIRED)
find_package(ucx REQUIRED)

# CAF 0.17 ships no CMake package.
find_path(CAF_INCLUDE_DIR caf/all.hpp REQUIRED)
find_library(CAF_CORE_LIBRARY caf_core REQUIRED)
find_library(CAF_IO_LIBRARY caf_io REQUIRED)
add_library(troupe_caf INTERFACE)
target_include_directories(troupe_caf SYSTEM INTERFACE ${CAF_INCLUDE_DIR})
target_link_libraries(troupe_caf INTERFACE ${CAF_IO_LIBRARY} ${CAF_CORE_LIBRARY} Threads::Threads)
# CAF 0.17.6's headers use uint64_t and friends without including <cstdint> (caf/detail/atom_val.hpp
# and others), which libstdc++ 13 no longer brings in through other headers: every C++ TU that
# sees CAF, troupe's and an installed troupe's consumers', gets <cstdint> first from this target.
target_compile_options(troupe_caf INTERFACE "$<$<COMPILE_LANGUAGE:CXX>:SHELL:-include cstdint>")

find_package(CLI11 REQUIRED)
find_package(tomlplusplus REQUIRED)  # job files (tools/job_config.cpp)
find_package(ZLIB REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(doctest REQUIRED)

# LibTorch 2.x: the torch wheel's (scripts/setup), the pytorch.org zip, or a build of one's own.
# A CUDA LibTorch's config adds -gencode flags for TORCH_CUDA_ARCH_LIST (default: eleven
# architectures) to every .cu file; troupe's kernels are built for the GPUs it is tested on.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
endif()
find_package(Torch REQUIRED)
if(Torch_VERSION VERSION_LESS 2.2)
  message(FATAL_ERROR "troupe needs LibTorch 2.2 or newer; found ${Torch_VERSION} in ${Torch_DIR} "
    "(point Torch_DIR or CMAKE_PREFIX_PATH at a LibTorch 2.x, e.g. the torch wheel's "
    "torch.utils.cmake_prefix_path)")
endif()
# C++20, or the newer standard the torch target asks of its consumers (compile feature cxx_std_NN).
set(TROUPE_CXX_STANDARD 20)
get_target_property(_troupe_torch_features torch INTERFACE_COMPILE_FEATURES)
foreach(_feature IN LISTS _troupe_torch_features)
  if(_feature MATCHES "^cxx_std_([0-9]+)$" AND CMAKE_MATCH_1 GREATER TROUPE_CXX_STANDARD)
    set(TROUPE_CXX_STANDARD ${CMAKE_MATCH_1})
  endif()
endforeach()
unset(_troupe_torch_features)
set(CMAKE_CXX_STANDARD ${TROUPE_CXX_STANDARD})
set(CMAKE_CUDA_STANDARD ${TROUPE_CXX_STANDARD})
message(STATUS "troupe: LibTorch ${Torch_VERSION} (${Torch_DIR}), C++${TROUPE_CXX_STANDARD}")
# libstdc++ ahead of LibTorch, and a torch wheel's CUDA libraries (the nvidia-* wheels) ahead of a
# toolkit's, in every executable: see cmake/torch_link.cmake.
include(${CMAKE_CURRENT_LIST_DIR}/torch_link.cmake)
troupe_torch_link_options("${TORCH_INSTALL_PREFIX}")
add_link_options(${TROUPE_TORCH_LINK_OPTIONS})

set(TROUPE_HAVE_CUDA OFF)
# troupe's CUDA parts serve CUDA tensors, which only a CUDA LibTorch makes: with a CPU LibTorch
# (no libc10_cuda) they would only tie every program to the CUDA runtime, so they are not built.
set(_troupe_torch_has_cuda FALSE)
if(EXISTS "${TORCH_INSTALL_PREFIX}/lib/libc10_cuda.so")
  set(_troupe_torch_has_cuda TRUE)
endif()
if(TROUPE_WITH_CUDA AND NOT _troupe_torch_has_cuda)
  message(STATUS "troupe: CUDA OFF: the LibTorch in ${TORCH_INSTALL_PREFIX} is a CPU build (no "
    "lib/libc10_cuda.so); point Torch_DIR at a CUDA LibTorch for troupe's CUDA and NCCL parts")
elseif(TROUPE_WITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    # CMake before 3.26 knows no C++20 flag for nvcc (12.0 and newer take -std=c++20).
    if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION
       AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    find_package(CUDAToolkit REQUIRED)
    set(TROUPE_HAVE_CUDA ON)
  endif()
endif()
message(STATUS "troupe: CUDA ${TROUPE_HAVE_CUDA}")

# NCCL (CUDA buffers' collectives, comm/transport/nccl/): with CUDA only, its nccl.h from the
# toolkit's tree or NCCL_ROOT. TROUPE_HAVE_NCCL becomes a public compile definition of troupe_comm.
set(TROUPE_HAVE_NCCL OFF)
if(TROUPE_HAVE_CUDA)
  get_filename_component(_troupe_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  # A torch wheel loads the nvidia-nccl wheel's libnccl.so.2 (site-packages/nvidia/nccl), and the
  # dynamic loader keeps one libnccl.so.2 per process: troupe compiles against that one's nccl.h
  # when it is there, so that the header and the library that runs agree. NCCL_ROOT comes first.
  get_filename_component(_troupe_wheel_nccl "${TORCH_INSTALL_PREFIX}/../nvidia/nccl" ABSOLUTE)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${_troupe_wheel_nccl}
    ${_troupe_cuda_root} /usr/local/cuda PATH_SUFFIXES include)
  # troupe loads NCCL on first use (comm/transport/nccl/library.h) and links none; the library
  # found here is only the last place it looks. The wheel names its library libnccl.so.2 only.
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT}
    ${_troupe_wheel_nccl} ${_troupe_cuda_root} /usr/local/cuda PATH_SUFFIXES lib64 lib)
  unset(_troupe_wheel_nccl)
  if(NCCL_INCLUDE_DIR)
    set(TROUPE_HAVE_NCCL ON)
    # Before every other folder: the CUDA toolkit's include folder, which every CUDA target has,
    # may hold an nccl.h of another version.
    include_directories(BEFORE SYSTEM ${NCCL_INCLUDE_DIR})
  endif()
  unset(_troupe_cuda_root)
endif()
message(STATUS "troupe: NCCL ${TROUPE_HAVE_NCCL} ${NCCL_LIBRARY}")

# LibTorch's c10_cuda (every CUDA LibTorch has it: troupe builds its CUDA parts only then): with
# it, DistributedModule records gradient events on torch's current CUDA stream instead of the
# legacy default stream.
set(TROUPE_HAVE_C10_CUDA OFF)
if(TROUPE_HAVE_CUDA)
  find_library(TROUPE_C10_CUDA_LIBRARY c10_cuda HINTS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
  if(TROUPE_C10_CUDA_LIBRARY)
    set(TROUPE_HAVE_C10_CUDA ON)
  endif()
endif()
message(STATUS "troupe: c10_cuda ${TROUPE_HAVE_C10_CUDA}")
