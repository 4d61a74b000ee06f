#include "runtime/gossip/flat_model.h"

#include <torch/torch.h>

#include <cstring>

#include "runtime/model_check.h"

namespace troupe::gossip {

FlatModel::FlatModel(Runtime& runtime, std::shared_ptr<torch::nn::Module> module, std::string what,
                     bool broadcast)
    : what_(std::move(what)) {
  if (!module) throw comm::Error(what_ + ": the module is null");
  torch::NoGradGuard no_grad;
  std::string mine = "algorithm " + what_ + "\n";
  int64_t total = 0;
  for (auto& p : module->named_parameters(true)) {
    const auto& t = p.value();
    if (t.scalar_type() != torch::kFloat32)
      throw comm::Error(what_ + ": parameter " + p.key() + " is " +
                        std::string(c10::toString(t.scalar_type())) +
                        ", expected float32 (decentralized algorithms mix float32 weights)");
    if (!t.device().is_cpu())
      throw comm::Error(what_ + ": parameter " + p.key() + " is on " + t.device().str() +
                        ", expected the CPU");
    mine += p.key() + " " + shape_of(t) + "\n";
    params_.push_back(t);
    offsets_.push_back(total);
    total += t.numel();
  }
  check_same_on_every_rank(runtime.comm(), mine);
  flat_ = torch::empty({total}, torch::kFloat32);
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    auto slice = flat_.narrow(0, offsets_[i], p.numel());
    slice.copy_(p.reshape({-1}));
    p.set_data(slice.view(p.sizes()));
  }
  if (broadcast && runtime.world_size() > 1)
    runtime.comm().broadcast(data(), count(), comm::DataType::float32, 0);
}

void FlatModel::gradients(float* out) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    float* dst = out + offsets_[i];
    const auto& g = p.grad();
    if (!g.defined()) {
      std::memset(dst, 0, static_cast<size_t>(p.numel()) * sizeof(float));
    } else {
      auto c = g.contiguous();
      std::memcpy(dst, c.data_ptr<float>(), static_cast<size_t>(p.numel()) * sizeof(float));
    }
  }
}

void FlatModel::set_gradients(const float* in) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    auto src = torch::from_blob(const_cast<float*>(in + offsets_[i]), p.sizes(), torch::kFloat32);
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    p.mutable_grad().copy_(src);
  }
}

}  // namespace troupe::gossip
