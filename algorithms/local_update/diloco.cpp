#include "algorithms/local_update/diloco.h"

#include <torch/torch.h>

#include <chrono>
#include <sstream>

#include "algorithms/local_update/outer_step.h"
#include "comm/compression/reduction.h"
#include "comm/state.h"
#include "comm/status.h"
#include "rank/fault.h"

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

struct DiLoCoModule::Impl : PeriodicAlgorithm {
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
  void synchronise() override {
    std::lock_guard<std::mutex> lock(core.flat.mutex());
    auto local = core.local();
    core.take_pseudo_gradient(local);
    const auto start = std::chrono::steady_clock::now();
    comm::Communicator::Traffic traffic;
    Runtime& rt = core.runtime;
    fault::at(FaultPhase::reduce, core.inner - 1);  // the sync after inner step `inner - 1`
    if (rt.world_size() > 1)
      traffic = rt.comm().run_stages(
          reduction->stages(core.reduce_step(static_cast<uint32_t>(core.outer))),
          "DiLoCo's outer reduction");
    core.count_wait(start);
    core.count_sync(traffic);
    sgd.step(core.global, core.momentum, core.delta);
    core.continue_from_global(local);
  }

  std::string name() const override { return diloco_name(config); }
  OuterStep& outer_step() override { return core; }
  int period() const override { return config.inner_steps; }
  void save_rest(comm::StateWriter& out) override { reduction->save_state(out); }
  std::function<void(comm::StateReader&)> read_rest(comm::StateReader&) override {
    return [this](comm::StateReader& in) { reduction->load_state(in); };
  }
  // Shared: the reduction's part every rank holds equal (PowerSGD's Q); its error feedback is
  // the rank's own.
  void save_shared_rest(comm::StateWriter& out) override { reduction->save_shared_state(out); }
  std::function<void(comm::StateReader&)> read_shared_rest(comm::StateReader&) override {
    return [this](comm::StateReader& in) { reduction->load_shared_state(in); };
  }

  DiLoCo config;
  OuterSgd sgd;
  OuterStep core;
  comm::BucketBuffer bucket;  // over core.delta
  std::shared_ptr<comm::Reduction> reduction;
};

DiLoCoModule::DiLoCoModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                           DiLoCo config)
    : LocalUpdateModule(std::make_unique<Impl>(runtime, std::move(module), std::move(config))) {}

}  // namespace troupe
