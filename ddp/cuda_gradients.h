#pragma once
/// CudaGradients: the CUDA side of a DistributedModule whose parameters live on a GPU.
///
/// Each parameter has a CUDA event that the gradient hook records on torch's current stream (the
/// legacy default stream unless LibTorch provides c10::cuda) the moment the gradient has been
/// accumulated (and, where backward allocated a fresh gradient because it had been set to none,
/// copied into its bucket on that stream), and step() records one more after it has touched the
/// buckets itself; a bucket's device work waits on its parameters' events and the step's, never
/// on the whole device.
///
/// How the CUDA buckets are then reduced is their gradient path's business
/// (ddp/gradient_path/nccl.cpp, ddp/gradient_path/host_staging.cpp).
///
/// Without CUDA in troupe (TROUPE_HAVE_CUDA undefined) the constructor throws: CUDA parameters
/// need a troupe built with CUDA.
#include <torch/types.h>

#include <string>
#include <vector>

namespace troupe {

class CudaGradients {
 public:
  /// Checks that every parameter is on one CUDA device (naming a parameter elsewhere) and makes
  /// the events; communicates nothing.
  CudaGradients(const std::vector<torch::Tensor>& params, const std::vector<std::string>& names);
  ~CudaGradients();
  CudaGradients(const CudaGradients&) = delete;
  CudaGradients& operator=(const CudaGradients&) = delete;

  int device() const { return device_; }

  /// In the gradient hook (backward's thread): parameter `index`'s gradient is ready on torch's
  /// current stream.
  void record_gradient(int index);
  /// In step(): what step() enqueued on torch's stream for the buckets (zeroing, copies) is
  /// captured for the reductions to wait on.
  void record_step();
  /// The events a bucket of the parameters `params` waits on: theirs and the step's.
  std::vector<void*> ready_events(const std::vector<int>& params) const;

 private:
  int device_ = -1;
  std::vector<void*> events_;  // one per parameter
  void* step_event_ = nullptr;
};

}  // namespace troupe
