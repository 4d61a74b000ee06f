#include "algorithms/optim/sign_sgd.h"

#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <sstream>
#include <string>
#include <utility>

#include "algorithms/optim/param_groups.h"
#include "comm/status.h"

namespace troupe::optim {

namespace {

using comm::number_text;

void check_groups(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto* options = dynamic_cast<const SignSgdOptions*>(&groups[i].options());
    if (!options)
      throw comm::Error("SignSGD param group " + std::to_string(i) +
                        " has options of another optimizer (expected SignSgdOptions)");
    validate(*options);
  }
}

}  // namespace

SignSgdOptions::SignSgdOptions(double lr) : lr_(lr) {}

void SignSgdOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(dampening);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
}

void SignSgdOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, dampening);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
}

void SignSgdParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
}

void SignSgdParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, momentum_buffer);
}

void validate(const SignSgdOptions& o) {
  if (!(o.lr() > 0))
    throw comm::Error("SignSgdOptions.lr=" + number_text(o.lr()) + " (expected > 0)");
  if (!(o.momentum() >= 0))
    throw comm::Error("SignSgdOptions.momentum=" + number_text(o.momentum()) + " (expected >= 0)");
  if (!(o.weight_decay() >= 0))
    throw comm::Error("SignSgdOptions.weight_decay=" + number_text(o.weight_decay()) +
                      " (expected >= 0)");
  if (o.nesterov() && !(o.momentum() > 0 && o.dampening() == 0))
    throw comm::Error("SignSgdOptions.nesterov=true with momentum=" + number_text(o.momentum()) +
                      " and dampening=" + number_text(o.dampening()) +
                      " (expected momentum > 0 and dampening = 0)");
}

SignSGD::SignSGD(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                 SignSgdOptions defaults)
    : Optimizer(param_groups, std::make_unique<SignSgdOptions>(defaults)) {
  validate(defaults);
  keep_group_options(param_groups_, param_groups);
  check_groups(param_groups_);
}

SignSGD::SignSGD(std::vector<torch::Tensor> params, SignSgdOptions defaults)
    : SignSGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

torch::Tensor SignSGD::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const SignSgdOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      at::Tensor d = p.grad();
      if (o.weight_decay() != 0) d = d.add(p, o.weight_decay());
      if (o.momentum() != 0) {
        void* const key = p.unsafeGetTensorImpl();
        auto it = state_.find(key);
        if (it == state_.end())
          it = state_.emplace(key, std::make_unique<SignSgdParamState>()).first;
        auto& state = static_cast<SignSgdParamState&>(*it->second);
        at::Tensor buf = state.momentum_buffer();
        if (!buf.defined()) {
          buf = d.clone().detach();
          state.momentum_buffer(buf);
        } else {
          buf.mul_(o.momentum()).add_(d, 1 - o.dampening());
        }
        d = o.nesterov() ? d.add(buf, o.momentum()) : buf;
      }
      p.add_(d.sign(), -o.lr());
    }
  }
  return loss;
}

void SignSGD::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<SignSgdParamState, SignSgdOptions>(archive, *this);
}

void SignSGD::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<SignSgdParamState, SignSgdOptions>(archive, *this);
}

}  // namespace troupe::optim
