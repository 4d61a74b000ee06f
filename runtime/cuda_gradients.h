#pragma once
/// CudaGradients: the CUDA side of a DistributedModule whose parameters live on a GPU.
///
/// Each parameter has a CUDA event that the gradient hook records on torch's current stream (the
/// legacy default stream unless LibTorch provides c10::cuda) the moment the gradient has been
/// accumulated (and, where backward allocated a fresh gradient because it had been set to none,
/// copied into its bucket on that stream), and step() records one more after it has touched the buckets itself; a bucket's
/// device work waits on its parameters' events and the step's, never on the whole device.
///
/// A bucket is then reduced one of two ways, the same on every rank:
/// - **NCCL** — when the Runtime has an NCCL unique id from rank 0 (Runtime::nccl_available()),
///   the algorithm is GradientAllReduce and DdpOptions::stage_through_host is off. The module
///   takes its own communicator, split from the Runtime's (so that two modules' buckets never
///   interleave differently on different ranks), and issues its buckets in bucket order.
/// - **host staging** — otherwise (UCX or inproc jobs, compressed algorithms): each bucket has a
///   pinned host mirror (actors/staging.h) that the usual CPU reduction works on.
///
/// Without CUDA in troupe (TROUPE_HAVE_CUDA undefined) the constructor throws: CUDA parameters
/// need a troupe built with CUDA.
#include <torch/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/bucket.h"
#include "runtime/runtime.h"

namespace troupe {

namespace actors {
class StagingContext;
}  // namespace actors

class CudaGradients {
 public:
  /// Checks that every parameter is on one CUDA device (naming a parameter elsewhere) and picks
  /// the path; communicates nothing. `allreduce`: the algorithm is GradientAllReduce.
  /// `timeout`: of creating the communicator and of each copy to or from a host mirror.
  CudaGradients(Runtime& runtime, const std::vector<torch::Tensor>& params,
                const std::vector<std::string>& names, bool allreduce, bool stage_through_host,
                std::chrono::milliseconds timeout);
  ~CudaGradients();
  CudaGradients(const CudaGradients&) = delete;
  CudaGradients& operator=(const CudaGradients&) = delete;

  int device() const { return device_; }
  bool uses_nccl() const { return nccl_path_; }
  /// The path as the model check compares it on every rank: "gradients on cuda via nccl" or
  /// "gradients on cuda via host staging".
  std::string path() const;

  /// Collective on the NCCL path (every rank calls it at the same point, after the model check):
  /// creates the module's communicator. Nothing on the staging path.
  void connect();

  /// In the gradient hook (backward's thread): parameter `index`'s gradient is ready on torch's
  /// current stream.
  void record_gradient(int index);
  /// In step(): what step() enqueued on torch's stream for the buckets (zeroing, copies) is
  /// captured for the reductions to wait on.
  void record_step();

  /// A fresh issue order for a new set of `buckets` buckets (NCCL path; null otherwise).
  std::shared_ptr<actors::NcclOrder> make_order(int buckets) const;
  /// Completes a bucket's plan: the events to wait on (those of `params` and the step's), and
  /// the module's communicator with `order`, or a host mirror of the `bytes` at `device_data`
  /// (plan.data then becomes the mirror's host memory).
  void prepare(actors::BucketPlan& plan, const std::vector<int>& params, void* device_data,
               size_t bytes, const std::shared_ptr<actors::NcclOrder>& order);

 private:
  Runtime& runtime_;
  int device_ = -1;
  bool nccl_path_ = false;
  std::chrono::milliseconds timeout_;
  std::vector<void*> events_;  // one per parameter
  void* step_event_ = nullptr;
  std::shared_ptr<comm::NcclCommunicator> nccl_;
  std::shared_ptr<actors::StagingContext> staging_;
};

}  // namespace troupe
