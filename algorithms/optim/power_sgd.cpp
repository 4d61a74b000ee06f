#include "algorithms/optim/power_sgd.h"

#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <sstream>
#include <string>
#include <utility>

#include "comm/status.h"
#include "rank/checkpoint.h"

namespace troupe::optim {

namespace {

using comm::number_text;

}  // namespace

PowerSgdOptimizerOptions::PowerSgdOptimizerOptions(double lr) : lr_(lr) {}

void validate(const PowerSgdOptimizerOptions& o) {
  if (!(o.lr() > 0))
    throw comm::Error("PowerSgdOptimizerOptions.lr=" + number_text(o.lr()) + " (expected > 0)");
  if (!(o.momentum() >= 0))
    throw comm::Error("PowerSgdOptimizerOptions.momentum=" + number_text(o.momentum()) +
                      " (expected >= 0)");
  if (!(o.weight_decay() >= 0))
    throw comm::Error("PowerSgdOptimizerOptions.weight_decay=" + number_text(o.weight_decay()) +
                      " (expected >= 0)");
  if (o.nesterov() && !(o.momentum() > 0))
    throw comm::Error("PowerSgdOptimizerOptions.nesterov=true with momentum=" +
                      number_text(o.momentum()) + " (expected momentum > 0)");
  comm::validate(comm::Compression(o.algorithm()));
}

PowerSGD::PowerSGD(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                   PowerSgdOptimizerOptions options) {
  validate(options);
  auto parameters = module->parameters();
  ddp_ = std::make_unique<DistributedModule>(runtime, std::move(module), options.algorithm(),
                                             options.ddp());
  sgd_ = std::make_unique<torch::optim::SGD>(std::move(parameters),
                                             torch::optim::SGDOptions(options.lr())
                                                 .momentum(options.momentum())
                                                 .weight_decay(options.weight_decay())
                                                 .nesterov(options.nesterov()));
}

PowerSGD::~PowerSGD() = default;

void PowerSGD::step() { ddp_->step(*sgd_); }

void PowerSGD::zero_grad() {
  // In place, whatever the LibTorch version's default (>= 2.0 sets gradients to none): they stay
  // views of the buckets, and backward needs no fresh gradient for the module to copy in.
  torch::NoGradGuard no_grad;
  for (auto& group : sgd_->param_groups())
    for (auto& p : group.params())
      if (p.grad().defined()) p.mutable_grad().detach_().zero_();
}

void PowerSGD::save_state(comm::StateWriter& out) const {
  ddp_->save_state(out);
  save_optimizer(*sgd_, out);
}

void PowerSGD::load_state(comm::StateReader& in) {
  ddp_->load_state(in);
  load_optimizer(*sgd_, in);
}

torch::optim::Optimizer& PowerSGD::sgd() { return *sgd_; }

}  // namespace troupe::optim
