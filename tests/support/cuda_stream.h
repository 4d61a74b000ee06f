#pragma once
// Test support for the GPU tests: CHECK_CUDA (cuda/check.h's check), a stream that is
// destroyed on scope exit, and the message of a rejected argument.
#include <cuda_runtime.h>

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
