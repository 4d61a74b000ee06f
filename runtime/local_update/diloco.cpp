#include "runtime/local_update/diloco.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <algorithm>
#include <sstream>

#include "comm/compression/reduction.h"
#include "comm/state.h"
#include "runtime/gossip/flat_model.h"

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
  auto bad = [](const std::string& what) { throw comm::Error("DiLoCo: " + what); };
  if (c.inner_steps < 1)
    bad("inner_steps = " + std::to_string(c.inner_steps) + ", expected >= 1");
  if (!(c.outer_lr > 0) || !std::isfinite(c.outer_lr))
    bad("outer_lr = " + std::to_string(c.outer_lr) + ", expected a finite number > 0");
  if (!(c.outer_momentum >= 0 && c.outer_momentum < 1))
    bad("outer_momentum = " + std::to_string(c.outer_momentum) + ", expected 0 <= it < 1");
  return c;
}

}  // namespace

struct DiLoCoModule::Impl {
  Impl(Runtime& rt, std::shared_ptr<torch::nn::Module> m, DiLoCo c)
      : runtime(rt), config(checked(std::move(c))), flat(rt, m, "DiLoCo") {
    const auto count = static_cast<int64_t>(flat.count());
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    flat.pull();
    global = torch::from_blob(flat.host(), {count}, f32).clone();
    momentum = torch::zeros({count}, f32);
    delta = torch::zeros({count}, f32);
    bucket.index = 0;
    bucket.data = delta.data_ptr<float>();
    bucket.count = static_cast<size_t>(count);
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

  // The outer step: delta := global - local, averaged over the ranks; global steps by it; every
  // rank continues from global.
  void synchronise() {
    std::lock_guard<std::mutex> lock(flat.mutex());
    flat.reattach();
    flat.pull();
    const auto count = static_cast<int64_t>(flat.count());
    auto local = torch::from_blob(flat.host(), {count}, torch::kFloat32);
    torch::sub_out(delta, global, local);
    const auto start = std::chrono::steady_clock::now();
    comm::Communicator::Traffic traffic;
    if (runtime.world_size() > 1) {
      comm::ReduceStep step;
      step.group = comm::Group{runtime.rank(), runtime.world_size()};
      step.step = static_cast<uint32_t>(outer);
      step.scale = 1.0 / runtime.world_size();
      step.collectives = runtime.comm().options();
      traffic = runtime.comm().run_stages(reduction->stages(step), "DiLoCo's outer reduction");
    }
    totals.comm_wait_sec +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    totals.bytes_sent += traffic.sent;
    totals.bytes_received += traffic.received;
    totals.last_step_bytes_sent = traffic.sent;
    totals.peak_sync_bytes_sent = std::max<uint64_t>(totals.peak_sync_bytes_sent, traffic.sent);
    // torch.optim.SGD's momentum: buf = mu buf + g; Nesterov steps by g + mu buf, else by buf.
    momentum.mul_(config.outer_momentum).add_(delta);
    if (config.nesterov)
      global.sub_(delta.add_(momentum, config.outer_momentum), config.outer_lr);  // delta is spent
    else
      global.sub_(momentum, config.outer_lr);
    local.copy_(global);
    flat.push();
    ++outer;
  }

  Runtime& runtime;
  DiLoCo config;
  gossip::FlatModel flat;
  torch::Tensor global, momentum, delta;  // flat float32, in host memory
  comm::BucketBuffer bucket;               // over delta
  std::shared_ptr<comm::Reduction> reduction;
  int64_t inner = 0, outer = 0;
  CommStats totals;
};

DiLoCoModule::DiLoCoModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                           DiLoCo config)
    : impl_(std::make_unique<Impl>(runtime, std::move(module), std::move(config))) {}

DiLoCoModule::~DiLoCoModule() = default;

void DiLoCoModule::step(torch::optim::Optimizer& inner) {
  {
    std::lock_guard<std::mutex> lock(impl_->flat.mutex());
    inner.step();
  }
  ++impl_->totals.steps;
  impl_->totals.last_step_bytes_sent = 0;
  if (++impl_->inner % impl_->config.inner_steps == 0) impl_->synchronise();
}

std::string DiLoCoModule::algorithm_name() const { return diloco_name(impl_->config); }

CommStats DiLoCoModule::stats() const { return impl_->totals; }

int64_t DiLoCoModule::outer_steps() const { return impl_->outer; }

void DiLoCoModule::save_state(comm::StateWriter& out) const {
  auto& m = *impl_;
  std::lock_guard<std::mutex> lock(m.flat.mutex());
  out.string(diloco_name(m.config));
  out.value(m.inner);
  out.value(m.outer);
  out.value(m.totals.steps);
  const auto* g = m.global.data_ptr<float>();
  const auto* v = m.momentum.data_ptr<float>();
  out.vector(std::vector<float>(g, g + m.global.numel()));
  out.vector(std::vector<float>(v, v + m.momentum.numel()));
  m.reduction->save_state(out);
}

void DiLoCoModule::load_state(comm::StateReader& in) {
  auto& m = *impl_;
  const auto saved = in.string();
  if (saved != diloco_name(m.config))
    in.fail("saved under " + saved + ", this module runs " + diloco_name(m.config));
  const auto inner = in.value<int64_t>(), outer = in.value<int64_t>();
  const auto steps = in.value<uint64_t>();
  const auto count = static_cast<size_t>(m.global.numel());
  auto global = in.vector<float>(count, "DiLoCo's global weights");
  auto momentum = in.vector<float>(count, "DiLoCo's outer momentum");
  std::lock_guard<std::mutex> lock(m.flat.mutex());
  m.reduction->load_state(in);  // checks its own state first: refused, nothing else changes
  std::copy(global.begin(), global.end(), m.global.data_ptr<float>());
  std::copy(momentum.begin(), momentum.end(), m.momentum.data_ptr<float>());
  m.inner = inner;
  m.outer = outer;
  m.totals.steps = steps;
}

}  // namespace troupe
