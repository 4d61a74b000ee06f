#include "runtime/model_switch.h"

#include <torch/torch.h>

#include <map>

namespace troupe {

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
    auto all = torch::cat(flat).to(torch::kFloat64).contiguous();
    runtime.comm().allreduce(all.data_ptr<double>(), static_cast<size_t>(all.numel()),
                             comm::DataType::float64, comm::ReduceOp::avg);
    int64_t at = 0;
    for (auto& t : tensors) {
      t.copy_(all.narrow(0, at, t.numel()).view(t.sizes()));
      at += t.numel();
    }
  }
}

ModelSwitch::ModelSwitch(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                         JobAlgorithm algorithm, DdpOptions options)
    : runtime_(runtime), module_(std::move(module)), options_(std::move(options)) {
  current_ = make_data_parallel(runtime_, module_, algorithm, options_);
}

ModelSwitch::~ModelSwitch() = default;

void ModelSwitch::switch_to(const JobAlgorithm& algorithm) {
  current_->finish();
  auto done = current_->stats();
  before_.steps += done.steps;
  before_.bytes_sent += done.bytes_sent;
  before_.bytes_received += done.bytes_received;
  before_.comm_wait_sec += done.comm_wait_sec;
  before_.background_rounds += done.background_rounds;
  before_.dropped_peers.insert(before_.dropped_peers.end(), done.dropped_peers.begin(),
                               done.dropped_peers.end());
  current_.reset();
  average_module(runtime_, *module_);
  current_ = make_data_parallel(runtime_, module_, algorithm, options_);
  ++switches_;
}

void ModelSwitch::step(torch::optim::Optimizer& optimizer) { current_->step(optimizer); }

void ModelSwitch::finish() { current_->finish(); }

std::string ModelSwitch::algorithm_name() const { return current_->algorithm_name(); }

CommStats ModelSwitch::stats() const {
  CommStats s = current_->stats();
  s.steps += before_.steps;
  s.bytes_sent += before_.bytes_sent;
  s.bytes_received += before_.bytes_received;
  s.comm_wait_sec += before_.comm_wait_sec;
  s.background_rounds += before_.background_rounds;
  s.dropped_peers.insert(s.dropped_peers.begin(), before_.dropped_peers.begin(),
                         before_.dropped_peers.end());
  return s;
}

}  // namespace troupe
