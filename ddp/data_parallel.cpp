#include "ddp/data_parallel.h"

#include <torch/torch.h>

#include <cmath>
#include <map>

#include "rank/model_check.h"

namespace troupe {

void DataParallel::save_state(comm::StateWriter&) const {
  throw comm::Error(algorithm_name() + ": this algorithm cannot save its state (no checkpoint)");
}

void DataParallel::load_state(comm::StateReader&) {
  throw comm::Error(algorithm_name() + ": this algorithm cannot load a state (no checkpoint)");
}

void average_module(Runtime& runtime, torch::nn::Module& module) {
  if (runtime.world_size() == 1) return;
  torch::NoGradGuard no_grad;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_type;
  for (auto& p : module.parameters())
    if (p.is_floating_point()) by_type[p.scalar_type()].push_back(p);
  for (auto& b : module.buffers())
    if (b.is_floating_point()) by_type[b.scalar_type()].push_back(b);
  for (auto& [type, tensors] : by_type) {
    std::vector<torch::Tensor> flat;
    for (auto& t : tensors) flat.push_back(t.reshape({-1}));
    auto all = torch::cat(flat).to(torch::kCPU);  // the transport moves host memory
    runtime.comm().allreduce(all.data_ptr(), static_cast<size_t>(all.numel()),
                             comm_type(type, "a parameter or buffer"), comm::ReduceOp::avg);
    int64_t at = 0;
    for (auto& t : tensors) {
      t.copy_(all.narrow(0, at, t.numel()).view(t.sizes()));
      at += t.numel();
    }
  }
}

double consensus_distance(Runtime& runtime, torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flat;
  for (auto& p : module.parameters())
    if (p.is_floating_point())  // on the host: the transport moves host memory
      flat.push_back(p.detach().to(torch::kCPU, torch::kFloat64).reshape({-1}));
  if (flat.empty()) return 0;
  auto x = torch::cat(flat).contiguous();
  auto mean = x.clone();
  auto& comm = runtime.comm();
  comm.allreduce(mean.data_ptr<double>(), static_cast<size_t>(mean.numel()),
                 comm::DataType::float64, comm::ReduceOp::avg);
  double distance = (x - mean).norm().item<double>();
  comm.allreduce(&distance, 1, comm::DataType::float64, comm::ReduceOp::avg);
  return distance;
}

}  // namespace troupe
