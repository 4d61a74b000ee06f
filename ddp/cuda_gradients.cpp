#include "ddp/cuda_gradients.h"

#include "comm/status.h"
#include "rank/torch_stream.h"

#ifdef TROUPE_HAVE_CUDA
#include "cuda/stream.h"
#endif

namespace troupe {

CudaGradients::CudaGradients(const std::vector<torch::Tensor>& params,
                             const std::vector<std::string>& names) {
  const auto first = params.at(0).device();
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].device() != first)
      throw comm::Error("DistributedModule: parameter '" + names[i] + "' is on " +
                        params[i].device().str() + ", parameter '" + names[0] + "' on " +
                        first.str() + " (expected every parameter on one device)");
#ifndef TROUPE_HAVE_CUDA
  throw comm::Error("DistributedModule: parameter '" + names[0] + "' is on " + first.str() +
                    ", but troupe was built without CUDA (expected CPU parameters, or a troupe "
                    "built where CMake finds CUDA)");
#else
  device_ = first.has_index() ? first.index() : cuda::current_device();
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
  for (void* e : events_) cuda::destroy_event(e);
  cuda::destroy_event(step_event_);
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

std::vector<void*> CudaGradients::ready_events(const std::vector<int>& params) const {
  std::vector<void*> events;
  for (int p : params) events.push_back(events_.at(static_cast<size_t>(p)));
  events.push_back(step_event_);
  return events;
}

}  // namespace troupe
