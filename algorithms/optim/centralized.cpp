#include "algorithms/optim/centralized.h"

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <functional>
#include <unordered_set>
#include <utility>

#include "comm/status.h"
#include "rank/checkpoint.h"

namespace troupe::optim {

namespace {

using comm::number_text;

void check_distribution(const std::string& what, double grad_clip) {
  if (!(grad_clip >= 0) || std::isinf(grad_clip))
    throw comm::Error(what + ".grad_clip=" + number_text(grad_clip) +
                      " (expected a finite value >= 0; 0 turns clipping off)");
}

template <class Options>
CentralizedOptions distribution_of(const Options& o) {
  return CentralizedOptions()
      .grad_clip(o.grad_clip())
      .agg_grad(o.agg_grad())
      .average(o.average())
      .divide_before(o.divide_before())
      .ddp(o.ddp());
}

std::shared_ptr<torch::nn::Module> checked(std::shared_ptr<torch::nn::Module> module,
                                           const std::string& name) {
  if (!module) throw comm::Error(name + ": module is null (expected a model)");
  return module;
}

std::unique_ptr<torch::optim::Optimizer> make_sgd(const std::shared_ptr<torch::nn::Module>& module,
                                                  const CentralizedSgdOptions& o) {
  validate(o);
  return std::make_unique<torch::optim::SGD>(checked(module, "CentralizedSGD")->parameters(),
                                             torch::optim::SGDOptions(o.lr())
                                                 .momentum(o.momentum())
                                                 .dampening(o.dampening())
                                                 .weight_decay(o.weight_decay())
                                                 .nesterov(o.nesterov()));
}

std::unique_ptr<torch::optim::Optimizer> make_adam(const std::shared_ptr<torch::nn::Module>& module,
                                                   const CentralizedAdamOptions& o) {
  validate(o);
  return std::make_unique<torch::optim::Adam>(checked(module, "CentralizedAdam")->parameters(),
                                              torch::optim::AdamOptions(o.lr())
                                                  .betas(o.betas())
                                                  .eps(o.eps())
                                                  .weight_decay(o.weight_decay())
                                                  .amsgrad(o.amsgrad()));
}

}  // namespace

CentralizedSgdOptions::CentralizedSgdOptions(double lr) : lr_(lr) {}
CentralizedAdamOptions::CentralizedAdamOptions(double lr) : lr_(lr) {}

void validate(const CentralizedOptions& o) {
  check_distribution("CentralizedOptions", o.grad_clip());
}

void validate(const CentralizedSgdOptions& o) {
  const std::string what = "CentralizedSgdOptions";
  if (!(o.lr() > 0)) throw comm::Error(what + ".lr=" + number_text(o.lr()) + " (expected > 0)");
  if (!(o.momentum() >= 0))
    throw comm::Error(what + ".momentum=" + number_text(o.momentum()) + " (expected >= 0)");
  if (!(o.dampening() >= 0))
    throw comm::Error(what + ".dampening=" + number_text(o.dampening()) + " (expected >= 0)");
  if (!(o.weight_decay() >= 0))
    throw comm::Error(what + ".weight_decay=" + number_text(o.weight_decay()) + " (expected >= 0)");
  if (o.nesterov() && !(o.momentum() > 0 && o.dampening() == 0))
    throw comm::Error(what + ".nesterov=true with momentum=" + number_text(o.momentum()) +
                      " and dampening=" + number_text(o.dampening()) +
                      " (expected momentum > 0 and dampening = 0)");
  check_distribution(what, o.grad_clip());
}

void validate(const CentralizedAdamOptions& o) {
  const std::string what = "CentralizedAdamOptions";
  if (!(o.lr() > 0)) throw comm::Error(what + ".lr=" + number_text(o.lr()) + " (expected > 0)");
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1))
    throw comm::Error(what + ".betas=(" + number_text(beta1) + ", " + number_text(beta2) +
                      ") (expected each in [0, 1))");
  if (!(o.eps() >= 0))
    throw comm::Error(what + ".eps=" + number_text(o.eps()) + " (expected >= 0)");
  if (!(o.weight_decay() >= 0))
    throw comm::Error(what + ".weight_decay=" + number_text(o.weight_decay()) + " (expected >= 0)");
  check_distribution(what, o.grad_clip());
}

struct CentralizedOptimizer::Impl {
  std::string name;
  CentralizedOptions options;
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<torch::optim::Optimizer> inner;
  std::unique_ptr<DistributedModule> ddp;
  double last_norm = 0;

  // Runs where DistributedModule::step would run the optimizer: after the gradient reduction
  // (agg_grad) or before the weight average (!agg_grad).
  void clip_and_step() {
    if (options.grad_clip() > 0)
      last_norm = torch::nn::utils::clip_grad_norm_(module->parameters(), options.grad_clip());
    inner->step();
  }
};

CentralizedOptimizer::CentralizedOptimizer(std::string name, Runtime& runtime,
                                           std::shared_ptr<torch::nn::Module> module,
                                           std::unique_ptr<torch::optim::Optimizer> optimizer,
                                           CentralizedOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.name = std::move(name);
  m.module = checked(std::move(module), m.name);
  if (!optimizer)
    throw comm::Error(m.name + ": optimizer is null (expected a torch::optim optimizer)");
  validate(options);
  // Every parameter the optimizer steps must be one whose gradient the module reduces.
  std::unordered_set<const void*> own;
  for (const auto& p : m.module->parameters()) own.insert(p.unsafeGetTensorImpl());
  size_t index = 0;
  for (const auto& group : optimizer->param_groups())
    for (const auto& p : group.params()) {
      if (!own.count(p.unsafeGetTensorImpl()))
        throw comm::Error(m.name + ": parameter " + std::to_string(index) +
                          " of the optimizer is not a parameter of the module (expected an "
                          "optimizer over module->parameters())");
      ++index;
    }
  m.options = std::move(options);
  m.inner = std::move(optimizer);
  DdpOptions ddp = m.options.ddp();
  ddp.agg_grad = m.options.agg_grad();
  ddp.average = m.options.average();
  ddp.divide_before = m.options.divide_before();
  m.ddp = std::make_unique<DistributedModule>(runtime, m.module, GradientAllReduce{}, ddp);
}

CentralizedOptimizer::~CentralizedOptimizer() = default;

void CentralizedOptimizer::step() {
  impl_->ddp->step([impl = impl_.get()] { impl->clip_and_step(); });
}

void CentralizedOptimizer::zero_grad() {
  // The module's gradients, not only the optimizer's: the DistributedModule reduces them all.
  torch::NoGradGuard no_grad;
  for (auto& p : impl_->module->parameters())
    if (p.grad().defined()) p.mutable_grad().detach_().zero_();
}

void CentralizedOptimizer::set_denominator(double denominator) {
  auto& m = *impl_;
  const std::string call = m.name + ".set_denominator(" + number_text(denominator) + ")";
  if (!(denominator > 0) || std::isinf(denominator))
    throw comm::Error(call +
                      " (expected a finite denominator > 0, e.g. the step's number of "
                      "samples over all ranks)");
  if (!m.options.agg_grad())
    throw comm::Error(call +
                      " with agg_grad=false (expected agg_grad=true: the denominator "
                      "divides gradients, and weights are averaged by the world size)");
  if (!m.options.average())
    throw comm::Error(call +
                      " with average=false (expected average=true: without it the "
                      "gradients are summed)");
  m.ddp->set_denominator(denominator);
}

double CentralizedOptimizer::last_grad_norm() const { return impl_->last_norm; }

void CentralizedOptimizer::save_state(comm::StateWriter& out) const {
  impl_->ddp->save_state(out);
  save_optimizer(*impl_->inner, out);
  out.value(impl_->last_norm);
}

void CentralizedOptimizer::load_state(comm::StateReader& in) {
  auto& m = *impl_;
  m.ddp->load_state(in);
  load_optimizer(*m.inner, in);
  m.last_norm = in.value<double>();
}

DistributedModule& CentralizedOptimizer::module() { return *impl_->ddp; }

torch::optim::Optimizer& CentralizedOptimizer::optimizer() { return *impl_->inner; }

CentralizedSGD::CentralizedSGD(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                               CentralizedSgdOptions options)
    : CentralizedOptimizer("CentralizedSGD", runtime, module, make_sgd(module, options),
                           distribution_of(options)) {}

CentralizedAdam::CentralizedAdam(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                                 CentralizedAdamOptions options)
    : CentralizedOptimizer("CentralizedAdam", runtime, module, make_adam(module, options),
                           distribution_of(options)) {}

CustomCentralizedOptimizer::CustomCentralizedOptimizer(
    Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
    std::unique_ptr<torch::optim::Optimizer> optimizer, CentralizedOptions options)
    : CentralizedOptimizer("CustomCentralizedOptimizer", runtime, std::move(module),
                           std::move(optimizer), std::move(options)) {}

}  // namespace troupe::optim
