#include "algorithms/optim/sparsified_sgd.h"

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "algorithms/optim/param_groups.h"
#include "comm/codecs/sparse.h"
#include "comm/compression/reductions.h"
#include "comm/status.h"
#include "rank/runtime.h"

namespace troupe::optim {

namespace {

using comm::number_text;

const SparsifiedSgdOptions& options_of(const torch::optim::OptimizerParamGroup& group) {
  return static_cast<const SparsifiedSgdOptions&>(group.options());
}

// k of a tensor of n elements.
size_t k_of(const SparsifiedSgdOptions& o, size_t n) {
  const size_t k =
      o.count() ? o.count()
                : std::max<size_t>(
                      1, static_cast<size_t>(std::llround(o.ratio() * static_cast<double>(n))));
  return std::min(k, n);
}

void check(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  size_t index = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto* o = dynamic_cast<const SparsifiedSgdOptions*>(&groups[g].options());
    if (!o)
      throw comm::Error("SparsifiedSGD param group " + std::to_string(g) +
                        " has options of another optimizer (expected SparsifiedSgdOptions)");
    validate(*o);
    for (const auto& p : groups[g].params()) {
      if (p.scalar_type() != at::kFloat || !p.device().is_cpu() || !p.is_contiguous())
        throw comm::Error("SparsifiedSGD parameter " + std::to_string(index) + " is a " +
                          std::string(c10::toString(p.scalar_type())) + " " + p.device().str() +
                          (p.is_contiguous() ? "" : " non-contiguous") +
                          " tensor (expected a contiguous float32 CPU tensor)");
      if (static_cast<uint64_t>(p.numel()) > std::numeric_limits<uint32_t>::max())
        throw comm::Error("SparsifiedSGD parameter " + std::to_string(index) + " has " +
                          std::to_string(p.numel()) +
                          " elements (expected < 2^32: indices are uint32)");
      ++index;
    }
  }
}

}  // namespace

SparsifiedSgdOptions::SparsifiedSgdOptions(double lr) : lr_(lr) {}

void validate(const SparsifiedSgdOptions& o) {
  if (!(o.lr() > 0))
    throw comm::Error("SparsifiedSgdOptions.lr=" + number_text(o.lr()) + " (expected > 0)");
  if (!(o.weight_decay() >= 0))
    throw comm::Error("SparsifiedSgdOptions.weight_decay=" + number_text(o.weight_decay()) +
                      " (expected >= 0)");
  if (o.count() == 0 && !(o.ratio() > 0 && o.ratio() <= 1))
    throw comm::Error("SparsifiedSgdOptions.ratio=" + number_text(o.ratio()) +
                      " with count=0 (expected 0 < ratio <= 1, or a count > 0)");
  if (!(o.average_shift() >= 0) || std::isinf(o.average_shift()))
    throw comm::Error("SparsifiedSgdOptions.average_shift=" + number_text(o.average_shift()) +
                      " (expected > 0, or 0 for max(1, d / k))");
}

SparsifiedSGD::SparsifiedSGD(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                             SparsifiedSgdOptions defaults)
    : Optimizer(param_groups, std::make_unique<SparsifiedSgdOptions>(defaults)) {
  validate(defaults);
  keep_group_options(param_groups_, param_groups);
  check(param_groups_);
  size_t elements = 0;
  for (const auto& group : param_groups_)
    for (const auto& p : group.params()) {
      elements += static_cast<size_t>(p.numel());
      kept_ += k_of(options_of(group), static_cast<size_t>(p.numel()));
      state_of(p);
    }
  shift_ =
      defaults.average_shift() > 0
          ? defaults.average_shift()
          : std::max(1.0, kept_ ? static_cast<double>(elements) / static_cast<double>(kept_) : 1.0);
}

SparsifiedSGD::SparsifiedSGD(std::vector<torch::Tensor> params, SparsifiedSgdOptions defaults)
    : SparsifiedSGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

void SparsifiedSGD::save(torch::serialize::OutputArchive& archive) const {
  auto* self = const_cast<SparsifiedSGD*>(this);  // state_of() creates nothing here: all exist
  const auto params = all_params();
  archive.write("sparsified_sgd/parameters", c10::IValue(static_cast<int64_t>(params.size())));
  archive.write("sparsified_sgd/steps", c10::IValue(static_cast<int64_t>(steps_)));
  archive.write("sparsified_sgd/weight_sum", c10::IValue(weight_sum_));
  for (size_t i = 0; i < params.size(); ++i) {
    auto& state = self->state_of(params[i]);
    archive.write("sparsified_sgd/memory/" + std::to_string(i), state.memory(), true);
    archive.write("sparsified_sgd/estimated/" + std::to_string(i), state.estimated_weights(), true);
  }
}

void SparsifiedSGD::load(torch::serialize::InputArchive& archive) {
  const auto params = all_params();
  c10::IValue count, steps, weight_sum;
  archive.read("sparsified_sgd/parameters", count);
  archive.read("sparsified_sgd/steps", steps);
  archive.read("sparsified_sgd/weight_sum", weight_sum);
  if (count.toInt() != static_cast<int64_t>(params.size()))
    throw comm::Error("SparsifiedSGD::load: the archive holds " + std::to_string(count.toInt()) +
                      " parameters, this optimizer has " + std::to_string(params.size()));
  std::vector<torch::Tensor> memory(params.size()), estimated(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    archive.read("sparsified_sgd/memory/" + std::to_string(i), memory[i], true);
    archive.read("sparsified_sgd/estimated/" + std::to_string(i), estimated[i], true);
    if (!memory[i].sizes().equals(params[i].sizes()) ||
        !estimated[i].sizes().equals(params[i].sizes()))
      throw comm::Error("SparsifiedSGD::load: parameter " + std::to_string(i) +
                        " has another shape in the archive");
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& state = state_of(params[i]);
    state.memory().copy_(memory[i]);
    state.estimated_weights().copy_(estimated[i]);
  }
  steps_ = static_cast<uint64_t>(steps.toInt());
  weight_sum_ = weight_sum.toDouble();
}

std::vector<torch::Tensor> SparsifiedSGD::all_params() const {
  std::vector<torch::Tensor> out;
  for (const auto& group : param_groups_)
    for (const auto& p : group.params()) out.push_back(p);
  return out;
}

SparsifiedSgdParamState& SparsifiedSGD::state_of(const torch::Tensor& p) {
  void* const key = p.unsafeGetTensorImpl();
  auto it = state_.find(key);
  if (it == state_.end()) {
    at::NoGradGuard no_grad;
    auto state = std::make_unique<SparsifiedSgdParamState>();
    state->memory(at::zeros_like(p, at::MemoryFormat::Contiguous));
    state->estimated_weights(p.detach().clone(at::MemoryFormat::Contiguous));
    it = state_.emplace(key, std::move(state)).first;
  }
  return static_cast<SparsifiedSgdParamState&>(*it->second);
}

void SparsifiedSGD::compress(std::vector<Sparse>& updates) {
  at::NoGradGuard no_grad;
  uint64_t index = 0;
  for (auto& group : param_groups_) {
    const auto& o = options_of(group);
    for (auto& p : group.params()) {
      auto& state = state_of(p);
      at::Tensor v = state.memory();  // becomes v, then v - c: the new memory
      if (p.grad().defined()) v.add_(p.grad(), o.lr());
      if (o.weight_decay() != 0) v.add_(p, o.lr() * o.weight_decay());
      const size_t n = static_cast<size_t>(v.numel());
      const size_t k = k_of(o, n);
      Sparse s;
      s.param = p;
      s.indices.resize(k);
      s.values.resize(k);
      float* x = v.data_ptr<float>();
      const uint64_t seed = comm::mix_seed(o.seed(), steps_, index++);
      if (k > 0) switch (o.mode()) {
          case comm::SparseMode::top_k:
            comm::top_k(x, n, k, s.indices.data());
            break;
          case comm::SparseMode::random_k:
            comm::random_k(seed, n, k, s.indices.data());
            break;
          case comm::SparseMode::block: {
            const size_t start = static_cast<size_t>(seed % n);
            for (size_t j = 0; j < k; ++j) s.indices[j] = static_cast<uint32_t>((start + j) % n);
            break;
          }
        }
      comm::gather(x, s.indices.data(), k, s.values.data());
      for (uint32_t i : s.indices) x[i] = 0.0f;
      updates.push_back(std::move(s));
    }
  }
}

void SparsifiedSGD::apply(std::vector<Sparse>& updates) {
  for (auto& s : updates) {
    comm::scatter_add(s.indices.data(), s.values.data(), s.indices.size(), -1.0f,
                      s.param.data_ptr<float>());
    s.param.unsafeGetTensorImpl()->bump_version();  // written through the pointer
  }
}

void SparsifiedSGD::reset_estimated_weights() {
  at::NoGradGuard no_grad;
  for (const auto& p : all_params()) state_of(p).estimated_weights().copy_(p);
}

void SparsifiedSGD::update_average() {
  at::NoGradGuard no_grad;
  const double w = (shift_ + static_cast<double>(steps_)) * (shift_ + static_cast<double>(steps_));
  weight_sum_ += w;
  const double rho = w / weight_sum_;  // 1 at t = 0: the average starts at x_0
  for (const auto& p : all_params()) {
    at::Tensor avg = state_of(p).estimated_weights();
    avg.add_(p - avg, rho);
  }
}

torch::Tensor SparsifiedSGD::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  std::vector<Sparse> updates;
  compress(updates);
  apply(updates);
  update_average();
  ++steps_;
  return loss;
}

std::vector<torch::Tensor> SparsifiedSGD::estimated_weights() const {
  std::vector<torch::Tensor> out;
  for (const auto& p : all_params()) {
    auto it = state_.find(p.unsafeGetTensorImpl());
    out.push_back(
        it == state_.end()
            ? p.detach().clone()
            : static_cast<const SparsifiedSgdParamState&>(*it->second).estimated_weights().clone());
  }
  return out;
}

std::vector<torch::Tensor> SparsifiedSGD::memory() const {
  std::vector<torch::Tensor> out;
  for (const auto& p : all_params()) {
    auto it = state_.find(p.unsafeGetTensorImpl());
    out.push_back(it == state_.end()
                      ? at::zeros_like(p)
                      : static_cast<const SparsifiedSgdParamState&>(*it->second).memory().clone());
  }
  return out;
}

// --- CentralizedSparsifiedSGD

CentralizedSparsifiedSGD::CentralizedSparsifiedSGD(
    Runtime& runtime, std::vector<torch::optim::OptimizerParamGroup> param_groups,
    SparsifiedSgdOptions defaults)
    : SparsifiedSGD(std::move(param_groups), std::move(defaults)), runtime_(runtime) {
  auto& comm = runtime_.comm();
  const auto params = all_params();
  int64_t elements = 0;
  for (const auto& p : params) elements += p.numel();
  // Every rank must exchange records of the same layout.
  const int64_t mine[3] = {static_cast<int64_t>(params.size()), elements,
                           static_cast<int64_t>(kept_per_step())};
  std::vector<int64_t> all(3 * static_cast<size_t>(comm.world_size()));
  comm.allgather(mine, all.data(), 3, comm::DataType::int64);
  for (int r = 0; r < comm.world_size(); ++r) {
    const int64_t* theirs = all.data() + 3 * r;
    if (!std::equal(mine, mine + 3, theirs))
      throw comm::Error("CentralizedSparsifiedSGD: rank " + std::to_string(r) + " has " +
                            std::to_string(theirs[0]) + " parameters, " +
                            std::to_string(theirs[1]) + " elements, k=" +
                            std::to_string(theirs[2]) + " (rank " + std::to_string(comm.rank()) +
                            " has " + std::to_string(mine[0]) + ", " + std::to_string(mine[1]) +
                            ", k=" + std::to_string(mine[2]) + "; expected the same on every rank)",
                        r);
  }
  at::NoGradGuard no_grad;
  for (auto& p : params) {
    comm.broadcast(p.data_ptr<float>(), static_cast<size_t>(p.numel()), comm::DataType::float32, 0);
    p.unsafeGetTensorImpl()->bump_version();
  }
  reset_estimated_weights();
}

CentralizedSparsifiedSGD::CentralizedSparsifiedSGD(Runtime& runtime,
                                                   std::vector<torch::Tensor> params,
                                                   SparsifiedSgdOptions defaults)
    : CentralizedSparsifiedSGD(runtime, {torch::optim::OptimizerParamGroup(std::move(params))},
                               std::move(defaults)) {}

void CentralizedSparsifiedSGD::apply(std::vector<Sparse>& updates) {
  auto& comm = runtime_.comm();
  // Record: for each parameter in order, its k indices then its k values (4-byte words each).
  size_t words = 0;
  for (const auto& s : updates) words += 2 * s.indices.size();
  record_.resize(words);
  size_t at = 0;
  for (const auto& s : updates) {
    const size_t k = s.indices.size();
    std::memcpy(record_.data() + at, s.indices.data(), k * sizeof(uint32_t));
    std::memcpy(record_.data() + at + k, s.values.data(), k * sizeof(float));
    at += 2 * k;
  }
  const size_t world = static_cast<size_t>(comm.world_size());
  all_.resize(words * world);
  comm.allgather(record_.data(), all_.data(), words, comm::DataType::int32);
  const float scale = -1.0f / static_cast<float>(world);
  for (size_t r = 0; r < world; ++r) {
    const uint32_t* rec = all_.data() + words * r;
    for (const auto& s : updates) {
      const size_t k = s.indices.size();
      comm::scatter_add(rec, reinterpret_cast<const float*>(rec + k), k, scale,
                        s.param.data_ptr<float>());
      rec += 2 * k;
    }
  }
  for (auto& s : updates) s.param.unsafeGetTensorImpl()->bump_version();
}

}  // namespace troupe::optim
