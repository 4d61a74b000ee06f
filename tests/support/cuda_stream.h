#pragma once
// Test support for the GPU tests: CHECK_CUDA (cuda/check.h's check), a stream that is
// destroyed on scope exit, and the message of a rejected argument.
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>

#include "cuda/check.h"

#define CHECK_CUDA(call) TROUPE_CUDA_CHECK(call)

namespace troupe::test {

/// A non-blocking CUDA stream; kernels under test run on it, not on the default stream.
class Stream {
 public:
  Stream() { CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* handle() const { return stream_; }
  void synchronize() const { CHECK_CUDA(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

/// Host -> device, landed on return. cudaMemcpy from pageable memory may return once the bytes are
/// staged, before the DMA into device memory completes (CUDA runtime API, "API synchronization
/// behavior"), and the copy runs on the legacy default stream, which the non-blocking streams the
/// kernels under test run on do not wait for: without the device synchronisation a kernel may read
/// the buffer before the upload lands (eight GPU tests failed that way on an H100, and passed under
/// CUDA_LAUNCH_BLOCKING=1).
inline void upload(void* device, const void* host, size_t bytes) {
  CHECK_CUDA(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaDeviceSynchronize());
}

/// Device -> host after every stream's work on the device is done (the legacy stream's copy does
/// not wait for non-blocking streams either).
inline void download(void* host, const void* device, size_t bytes) {
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost));
}

/// cudaMemset, landed on return: on device memory it is asynchronous to the host, on the legacy
/// stream, so the same reasoning as upload() holds.
inline void fill(void* device, int byte, size_t bytes) {
  CHECK_CUDA(cudaMemset(device, byte, bytes));
  CHECK_CUDA(cudaDeviceSynchronize());
}

/// What `call()` threw as std::invalid_argument, or "no exception".
template <typename Call>
std::string invalid_argument_message(Call&& call) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no exception";
}

}  // namespace troupe::test
