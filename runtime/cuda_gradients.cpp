#include "runtime/cuda_gradients.h"

#include "comm/status.h"
#include "runtime/torch_stream.h"

#ifdef TROUPE_HAVE_CUDA
#include "actors/staging.h"
#include "cuda/stream.h"
#endif
#ifdef TROUPE_HAVE_NCCL
#include "comm/transport/nccl/communicator.h"
#endif

namespace troupe {

namespace {

std::string device_text(const torch::Tensor& t) { return t.device().str(); }

}  // namespace

CudaGradients::CudaGradients(Runtime& runtime, const std::vector<torch::Tensor>& params,
                             const std::vector<std::string>& names, bool allreduce,
                             bool stage_through_host, std::chrono::milliseconds timeout)
    : runtime_(runtime), timeout_(timeout) {
  const auto first = params.at(0).device();
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].device() != first)
      throw comm::Error("DistributedModule: parameter '" + names[i] + "' is on " +
                        device_text(params[i]) + ", parameter '" + names[0] + "' on " +
                        first.str() + " (expected every parameter on one device)");
#ifndef TROUPE_HAVE_CUDA
  (void)allreduce;
  (void)stage_through_host;
  throw comm::Error("DistributedModule: parameter '" + names[0] + "' is on " + first.str() +
                    ", but troupe was built without CUDA (expected CPU parameters, or a troupe "
                    "built where CMake finds CUDA)");
#else
  device_ = first.has_index() ? first.index() : cuda::current_device();
  nccl_path_ = allreduce && !stage_through_host && runtime.nccl_available();
  cuda::DeviceGuard guard(device_);
  try {
    for (size_t i = 0; i < params.size(); ++i) events_.push_back(cuda::create_event());
    step_event_ = cuda::create_event();
  } catch (...) {
    for (void* e : events_) cuda::destroy_event(e);
    throw;
  }
#endif
}

CudaGradients::~CudaGradients() {
#ifdef TROUPE_HAVE_CUDA
  // The communicator first: it waits for its operations, which wait on these events.
  nccl_.reset();
  for (void* e : events_) cuda::destroy_event(e);
  cuda::destroy_event(step_event_);
#endif
}

std::string CudaGradients::path() const {
  return std::string("gradients on cuda via ") + (nccl_path_ ? "nccl" : "host staging");
}

void CudaGradients::connect() {
  if (!nccl_path_ || nccl_) return;
#ifdef TROUPE_HAVE_NCCL
  nccl_ = runtime_.nccl(device_)->split(timeout_);
#endif
}

void CudaGradients::record_gradient(int index) {
#ifdef TROUPE_HAVE_CUDA
  cuda::DeviceGuard guard(device_);
  cuda::record_event(events_.at(static_cast<size_t>(index)), torch_current_stream(device_));
#else
  (void)index;
#endif
}

void CudaGradients::record_step() {
#ifdef TROUPE_HAVE_CUDA
  cuda::DeviceGuard guard(device_);
  cuda::record_event(step_event_, torch_current_stream(device_));
#endif
}

std::shared_ptr<actors::NcclOrder> CudaGradients::make_order(int buckets) const {
  return nccl_path_ ? std::make_shared<actors::NcclOrder>(buckets) : nullptr;
}

void CudaGradients::prepare(actors::BucketPlan& plan, const std::vector<int>& params,
                            void* device_data, size_t bytes,
                            const std::shared_ptr<actors::NcclOrder>& order) {
  plan.ready_events.clear();
  for (int p : params) plan.ready_events.push_back(events_.at(static_cast<size_t>(p)));
  plan.ready_events.push_back(step_event_);
  if (nccl_path_) {
    if (!nccl_)
      throw comm::Error("DistributedModule: bucket " + std::to_string(plan.index) +
                        " on the NCCL path before the module's communicator exists");
    plan.nccl = nccl_;
    plan.nccl_order = order;
    plan.data = device_data;
    return;
  }
#ifdef TROUPE_HAVE_CUDA
  if (!staging_) staging_ = std::make_shared<actors::StagingContext>(device_);
  plan.staging = std::make_shared<actors::HostStaging>(
      staging_, device_data, bytes, "bucket " + std::to_string(plan.index));
  plan.data = plan.staging->host();
#else
  (void)device_data;
  (void)bytes;
#endif
}

}  // namespace troupe
