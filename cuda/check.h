#pragma once
// Internal to cuda/: how its sources (kernels' host code, streams, events) check CUDA calls; the
// GPU tests use it too (tests/support/cuda_stream.h).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace troupe::cuda::detail {

[[noreturn]] inline void throw_cuda_error(const char* call, cudaError_t status) {
  throw std::runtime_error(std::string("troupe::cuda: ") + call + " failed: " +
                           cudaGetErrorString(status) + " (" + cudaGetErrorName(status) + ")");
}

}  // namespace troupe::cuda::detail

// Throws std::runtime_error naming the call, e.g. "troupe::cuda: cudaGetDevice(&device) failed:
// no CUDA-capable device is detected (cudaErrorNoDevice)".
#define TROUPE_CUDA_CHECK(call)                                        \
  do {                                                                 \
    cudaError_t troupe_status_ = (call);                               \
    if (troupe_status_ != cudaSuccess)                                 \
      ::troupe::cuda::detail::throw_cuda_error(#call, troupe_status_); \
  } while (0)
