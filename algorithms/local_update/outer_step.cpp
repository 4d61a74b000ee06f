#include "algorithms/local_update/outer_step.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "comm/status.h"
#include "rank/fault.h"

namespace troupe {

void OuterSgd::step(torch::Tensor x, torch::Tensor buf, torch::Tensor d) const {
  buf.mul_(momentum).add_(d);
  if (nesterov)
    x.sub_(d.add_(buf, momentum), lr);
  else
    x.sub_(buf, lr);
}

void check_outer_settings(const std::string& what, int inner_steps, double outer_lr,
                          std::optional<double> outer_momentum) {
  auto bad = [&](const std::string& setting) { throw comm::Error(what + ": " + setting); };
  if (inner_steps < 1) bad("inner_steps = " + std::to_string(inner_steps) + ", expected >= 1");
  if (!(outer_lr > 0) || !std::isfinite(outer_lr))
    bad("outer_lr = " + comm::number_text(outer_lr) + ", expected a finite number > 0");
  if (outer_momentum && !(*outer_momentum >= 0 && *outer_momentum < 1))
    bad("outer_momentum = " + comm::number_text(*outer_momentum) + ", expected 0 <= it < 1");
}

std::vector<float> values_of(const torch::Tensor& t) {
  const auto* p = t.data_ptr<float>();
  return std::vector<float>(p, p + t.numel());
}

void set_values(torch::Tensor& t, const std::vector<float>& values) {
  std::copy(values.begin(), values.end(), t.data_ptr<float>());
}

OuterStep::OuterStep(Runtime& rt, std::shared_ptr<torch::nn::Module> module,
                     const std::string& what, bool with_momentum)
    : runtime(rt), what(what), flat(rt, std::move(module), what) {
  const auto count = static_cast<int64_t>(flat.count());
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  flat.pull();
  global = torch::from_blob(flat.host(), {count}, f32).clone();
  if (with_momentum) momentum = torch::zeros({count}, f32);
  delta = torch::zeros({count}, f32);
}

int64_t OuterStep::inner_step(torch::optim::Optimizer& optimizer) {
  // Fault injection's backward phase for a local-update step: its backward is done, its inner
  // optimizer has not run.
  fault::at(FaultPhase::backward, inner);
  {
    std::lock_guard<std::mutex> lock(flat.mutex());
    optimizer.step();
  }
  ++totals.steps;
  totals.last_step_bytes_sent = 0;
  return ++inner;
}

torch::Tensor OuterStep::local() {
  flat.reattach();
  flat.pull();
  return torch::from_blob(flat.host(), {static_cast<int64_t>(flat.count())}, torch::kFloat32);
}

torch::Tensor OuterStep::take_pseudo_gradient(const torch::Tensor& local, size_t first,
                                              size_t count) {
  const auto at = static_cast<int64_t>(first);
  const auto n = static_cast<int64_t>(std::min(count, flat.count() - first));
  auto d = delta.narrow(0, at, n);
  torch::sub_out(d, global.narrow(0, at, n), local.narrow(0, at, n));
  return d;
}

comm::ReduceStep OuterStep::reduce_step(uint32_t step) const {
  comm::ReduceStep s;
  s.group = comm::Group{runtime.rank(), runtime.world_size()};
  s.step = step;
  s.scale = 1.0 / runtime.world_size();
  s.collectives = runtime.comm().options();
  return s;
}

void OuterStep::count_sync(const comm::Communicator::Traffic& traffic) {
  totals.bytes_sent += traffic.sent;
  totals.bytes_received += traffic.received;
  totals.last_step_bytes_sent = traffic.sent;
  totals.peak_sync_bytes_sent = std::max<uint64_t>(totals.peak_sync_bytes_sent, traffic.sent);
}

void OuterStep::count_wait(std::chrono::steady_clock::time_point start) {
  totals.comm_wait_sec +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void OuterStep::continue_from_global(torch::Tensor& local) {
  local.copy_(global);
  flat.push();
  ++outer;
}

void OuterStep::save(comm::StateWriter& out, const std::string& name) const {
  out.string(name);
  out.value(inner);
  out.value(outer);
  out.value(totals.steps);
  out.vector(values_of(global));
  if (momentum.defined()) out.vector(values_of(momentum));
}

OuterStep::Saved OuterStep::read(comm::StateReader& in, const std::string& name) const {
  const auto saved = in.string();
  if (saved != name) in.fail("saved under " + saved + ", this module runs " + name);
  Saved s;
  s.inner = in.value<int64_t>();
  s.outer = in.value<int64_t>();
  s.steps = in.value<uint64_t>();
  s.global = in.vector<float>(flat.count(), (what + "'s global weights").c_str());
  if (momentum.defined())
    s.momentum = in.vector<float>(flat.count(), (what + "'s outer momentum").c_str());
  return s;
}

void OuterStep::restore(const Saved& saved) {
  set_values(global, saved.global);
  if (momentum.defined()) set_values(momentum, saved.momentum);
  inner = saved.inner;
  outer = saved.outer;
  totals.steps = saved.steps;
}

}  // namespace troupe
