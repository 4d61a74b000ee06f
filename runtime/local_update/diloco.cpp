#include "runtime/local_update/diloco.h"

#include <torch/torch.h>

#include <chrono>
#include <sstream>

#include "comm/compression/reduction.h"
#include "comm/state.h"
#include "runtime/local_update/outer_step.h"

namespace troupe {

std::string diloco_name(const DiLoCo& c) {
  std::ostringstream s;
  s << "diloco(h=" << c.inner_steps << ", outer_lr=" << c.outer_lr
    << ", outer_momentum=" << c.outer_momentum << (c.nesterov ? "" : ", heavy ball") << ", "
    << comm::algorithm_name(c.outer_compression) << ")";
  return s.str();
}

namespace {

DiLoCo checked(DiLoCo c) {
  check_outer_settings("DiLoCo", c.inner_steps, c.outer_lr, c.outer_momentum);
  return c;
}

}  // namespace

struct DiLoCoModule::Impl {
  Impl(Runtime& rt, std::shared_ptr<torch::nn::Module> m, DiLoCo c)
      : config(checked(std::move(c))),
        sgd{config.outer_lr, config.outer_momentum, config.nesterov},
        core(rt, m, "DiLoCo", /*with_momentum=*/true) {
    bucket.index = 0;
    bucket.data = core.delta.data_ptr<float>();
    bucket.count = core.flat.count();
    bucket.type = comm::DataType::float32;
    size_t offset = 0;
    for (auto& p : m->parameters()) {
      comm::TensorSlot slot;
      slot.offset = offset;
      slot.count = static_cast<size_t>(p.numel());
      slot.rows = p.dim() >= 2 ? static_cast<size_t>(p.size(0)) : 1;
      bucket.tensors.push_back(slot);
      offset += slot.count;
    }
    reduction = comm::make_reduction(config.outer_compression, bucket);
  }

  // The outer step: the pseudo-gradient averaged over the ranks; global steps by it; every rank
  // continues from global.
  void synchronise() {
    std::lock_guard<std::mutex> lock(core.flat.mutex());
    auto local = core.local();
    core.take_pseudo_gradient(local);
    const auto start = std::chrono::steady_clock::now();
    comm::Communicator::Traffic traffic;
    Runtime& rt = core.runtime;
    if (rt.world_size() > 1)
      traffic = rt.comm().run_stages(
          reduction->stages(core.reduce_step(static_cast<uint32_t>(core.outer))),
          "DiLoCo's outer reduction");
    core.count_wait(start);
    core.count_sync(traffic);
    sgd.step(core.global, core.momentum, core.delta);
    core.continue_from_global(local);
  }

  DiLoCo config;
  OuterSgd sgd;
  OuterStep core;
  comm::BucketBuffer bucket;  // over core.delta
  std::shared_ptr<comm::Reduction> reduction;
};

DiLoCoModule::DiLoCoModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                           DiLoCo config)
    : impl_(std::make_unique<Impl>(runtime, std::move(module), std::move(config))) {}

DiLoCoModule::~DiLoCoModule() = default;

void DiLoCoModule::step(torch::optim::Optimizer& inner) {
  if (impl_->core.inner_step(inner) % impl_->config.inner_steps == 0) impl_->synchronise();
}

std::string DiLoCoModule::algorithm_name() const { return diloco_name(impl_->config); }

CommStats DiLoCoModule::stats() const { return impl_->core.totals; }

int64_t DiLoCoModule::outer_steps() const { return impl_->core.outer; }

void DiLoCoModule::save_state(comm::StateWriter& out) const {
  auto& m = *impl_;
  std::lock_guard<std::mutex> lock(m.core.flat.mutex());
  m.core.save(out, diloco_name(m.config));
  m.reduction->save_state(out);
}

void DiLoCoModule::load_state(comm::StateReader& in) {
  auto& m = *impl_;
  const auto saved = m.core.read(in, diloco_name(m.config));
  std::lock_guard<std::mutex> lock(m.core.flat.mutex());
  m.reduction->load_state(in);  // checks its own state first: refused, nothing else changes
  m.core.restore(saved);
}

}  // namespace troupe
