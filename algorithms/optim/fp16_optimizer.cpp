#include "algorithms/optim/fp16_optimizer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "comm/status.h"
#include "rank/checkpoint.h"

namespace troupe::optim {

namespace {

using comm::number_text;

bool scaling_on(const Fp16OptimizerOptions& o) {
  return o.loss_scaling().value_or(o.dtype() == torch::kHalf);
}

}  // namespace

void validate(const Fp16OptimizerOptions& o) {
  const std::string what = "Fp16OptimizerOptions";
  if (o.dtype() != torch::kHalf && o.dtype() != torch::kBFloat16)
    throw comm::Error(what + ".dtype=" + std::string(c10::toString(o.dtype())) +
                      " (expected Half or BFloat16)");
  if (!(o.init_scale() > 0) || std::isinf(o.init_scale()))
    throw comm::Error(what + ".init_scale=" + number_text(o.init_scale()) +
                      " (expected a finite value > 0)");
  if (!(o.scale_factor() > 1) || std::isinf(o.scale_factor()))
    throw comm::Error(what + ".scale_factor=" + number_text(o.scale_factor()) +
                      " (expected a finite value > 1)");
  if (o.scale_window() < 1)
    throw comm::Error(what + ".scale_window=" + std::to_string(o.scale_window()) +
                      " (expected >= 1)");
  if (!(o.min_scale() > 0))
    throw comm::Error(what + ".min_scale=" + number_text(o.min_scale()) + " (expected > 0)");
  if (o.min_scale() > o.init_scale())
    throw comm::Error(what + ".min_scale=" + number_text(o.min_scale()) + " with init_scale=" +
                      number_text(o.init_scale()) + " (expected 0 < min_scale <= init_scale)");
  if (o.max_scale() && !(*o.max_scale() >= o.init_scale()))
    throw comm::Error(what + ".max_scale=" + number_text(*o.max_scale()) + " with init_scale=" +
                      number_text(o.init_scale()) + " (expected max_scale >= init_scale)");
  if (!o.ddp().agg_grad)
    throw comm::Error(what +
                      ".ddp.agg_grad=false (expected true: FP16Optimizer averages the "
                      "gradients, then steps the float32 masters)");
}

struct FP16Optimizer::Impl {
  Fp16OptimizerOptions options;
  bool scaling = true;
  double scale = 1;
  int64_t good_steps = 0;  // steps without overflow since the last overflow or scale increase
  int64_t skipped = 0;
  int64_t steps = 0;
  bool stepped = false;
  std::string error;  // set by a step that must throw, thrown after the DistributedModule's step

  std::shared_ptr<torch::nn::Module> module;
  std::vector<torch::Tensor> params;  // the model's trainable parameters (half)
  torch::Tensor master_flat, grad_flat;
  std::vector<torch::Tensor> masters, master_grads;
  std::unique_ptr<torch::optim::Optimizer> inner;
  std::unique_ptr<DistributedModule> ddp;

  void convert_model(Runtime& runtime);
  void unscale_and_step();
};

// Takes the masters from the trainable parameters, then converts the float32 parameters and
// buffers to the working precision.
void FP16Optimizer::Impl::convert_model(Runtime& runtime) {
  const auto dtype = options.dtype();
  std::vector<torch::Tensor> initial;
  int64_t total = 0;
  for (auto& item : module->named_parameters(/*recurse=*/true)) {
    auto& p = item.value();
    if (!p.requires_grad()) continue;
    if (p.scalar_type() != torch::kFloat && p.scalar_type() != dtype)
      throw comm::Error("FP16Optimizer: parameter '" + item.key() + "' is a " +
                        std::string(c10::toString(p.scalar_type())) +
                        " tensor (expected Float, or " + std::string(c10::toString(dtype)) +
                        " as Fp16OptimizerOptions.dtype)");
    params.push_back(p);
    initial.push_back(p.detach().reshape({-1}).to(torch::kFloat));
    total += p.numel();
  }
  if (params.empty()) throw comm::Error("FP16Optimizer: the module has no trainable parameter");

  torch::NoGradGuard no_grad;
  for (auto& p : module->parameters(/*recurse=*/true))
    if (p.scalar_type() == torch::kFloat) p.set_data(p.to(dtype));
  for (auto& b : module->buffers(/*recurse=*/true))
    if (b.scalar_type() == torch::kFloat) b.set_data(b.to(dtype));

  auto as_float = params[0].options().dtype(torch::kFloat).requires_grad(false);
  master_flat = torch::cat(initial).to(as_float);
  grad_flat = torch::zeros({total}, as_float);
  int64_t offset = 0;
  for (auto& p : params) {
    masters.push_back(master_flat.narrow(0, offset, p.numel()).view(p.sizes()));
    master_grads.push_back(grad_flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }

  // The DistributedModule checks that every rank has the same model and broadcasts the half
  // parameters; the masters, which carry more than the half parameters, come from rank 0 too.
  ddp = std::make_unique<DistributedModule>(runtime, module, GradientAllReduce{}, options.ddp());
  runtime.comm().broadcast(master_flat.data_ptr(), static_cast<size_t>(total),
                           comm::DataType::float32, 0);
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i]);
}

void FP16Optimizer::Impl::unscale_and_step() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& g = params[i].grad();
    if (g.defined())
      master_grads[i].copy_(g);
    else
      master_grads[i].zero_();
  }
  const bool overflow = !torch::isfinite(grad_flat).all().item<bool>();
  ++steps;
  stepped = !overflow;
  if (overflow) {
    ++skipped;
    good_steps = 0;
    if (!scaling) return;
    if (scale <= options.min_scale())
      error = "FP16Optimizer: step " + std::to_string(steps - 1) +
              ": the gradients overflow (inf or NaN) with the loss scale already at min_scale=" +
              number_text(options.min_scale()) +
              " (the step was skipped; expected finite gradients at this scale: lower min_scale, "
              "or look for the source of the inf/NaN)";
    else
      scale = std::max(scale / options.scale_factor(), options.min_scale());
    return;
  }
  if (scale != 1) grad_flat.div_(scale);
  for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = master_grads[i];
  inner->step();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i]);
  if (scaling && ++good_steps == options.scale_window()) {
    good_steps = 0;
    scale *= options.scale_factor();
    if (options.max_scale()) scale = std::min(scale, *options.max_scale());
  }
}

FP16Optimizer::FP16Optimizer(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                             MasterOptimizerFactory make_optimizer, Fp16OptimizerOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!module) throw comm::Error("FP16Optimizer: module is null (expected a model)");
  if (!make_optimizer)
    throw comm::Error(
        "FP16Optimizer: the optimizer factory is empty (expected a function that "
        "makes a torch::optim optimizer over the master weights)");
  validate(options);
  auto& m = *impl_;
  m.options = std::move(options);
  m.scaling = scaling_on(m.options);
  m.scale = m.scaling ? m.options.init_scale() : 1.0;
  m.module = std::move(module);
  m.convert_model(runtime);
  m.inner = make_optimizer(m.masters);
  if (!m.inner)
    throw comm::Error(
        "FP16Optimizer: the optimizer factory returned null (expected an optimizer "
        "over the master weights)");
}

FP16Optimizer::FP16Optimizer(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                             torch::optim::SGDOptions sgd, Fp16OptimizerOptions options)
    : FP16Optimizer(
          runtime, std::move(module),
          [sgd](std::vector<torch::Tensor> masters) {
            return std::make_unique<torch::optim::SGD>(std::move(masters), sgd);
          },
          std::move(options)) {}

FP16Optimizer::~FP16Optimizer() = default;

torch::Tensor FP16Optimizer::scale_loss(const torch::Tensor& loss) const {
  auto full = loss.to(torch::kFloat);
  return impl_->scale == 1 ? full : full * impl_->scale;
}

void FP16Optimizer::backward(const torch::Tensor& loss) { scale_loss(loss).backward(); }

bool FP16Optimizer::step() {
  auto& m = *impl_;
  m.ddp->step([&m] { m.unscale_and_step(); });
  if (!m.error.empty()) {
    std::string error;
    std::swap(error, m.error);
    throw comm::Error(error);
  }
  return m.stepped;
}

void FP16Optimizer::zero_grad() {
  torch::NoGradGuard no_grad;
  for (auto& p : impl_->params)
    if (p.grad().defined()) p.mutable_grad().detach_().zero_();
}

double FP16Optimizer::loss_scale() const { return impl_->scale; }

int64_t FP16Optimizer::skipped_steps() const { return impl_->skipped; }

const std::vector<torch::Tensor>& FP16Optimizer::master_weights() const { return impl_->masters; }

const torch::Tensor& FP16Optimizer::master_buffer() const { return impl_->master_flat; }

void FP16Optimizer::save_state(comm::StateWriter& out) const {
  const auto& m = *impl_;
  out.value(m.scale);
  out.value(m.good_steps);
  out.value(m.skipped);
  out.value(m.steps);
  out.value<uint64_t>(static_cast<uint64_t>(m.master_flat.numel()));
  auto masters = m.master_flat.to(torch::kCPU).contiguous();
  out.bytes(masters.data_ptr(), static_cast<size_t>(masters.numel()) * sizeof(float));
  save_optimizer(*m.inner, out);
  m.ddp->save_state(out);
}

void FP16Optimizer::load_state(comm::StateReader& in) {
  auto& m = *impl_;
  const auto scale = in.value<double>();
  const auto good_steps = in.value<int64_t>();
  const auto skipped = in.value<int64_t>();
  const auto steps = in.value<int64_t>();
  const auto count = in.value<uint64_t>();
  if (count != static_cast<uint64_t>(m.master_flat.numel()))
    in.fail(std::to_string(count) + " master weights saved, this model has " +
            std::to_string(m.master_flat.numel()));
  auto masters = torch::empty({m.master_flat.numel()}, torch::kFloat);
  in.bytes(masters.data_ptr(), static_cast<size_t>(count) * sizeof(float));
  load_optimizer(*m.inner, in);
  m.ddp->load_state(in);
  torch::NoGradGuard no_grad;
  m.master_flat.copy_(masters);
  m.scale = scale;
  m.good_steps = good_steps;
  m.skipped = skipped;
  m.steps = steps;
}

DistributedModule& FP16Optimizer::module() { return *impl_->ddp; }

torch::optim::Optimizer& FP16Optimizer::optimizer() { return *impl_->inner; }

}  // namespace troupe::optim
