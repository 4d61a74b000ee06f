#include "runtime/distributed_module.h"

#include <caf/all.hpp>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>

#include "actors/atoms.h"
#include "actors/bucket.h"
#include "actors/reducer.h"
#include "comm/shm/local_allreduce.h"
#include "runtime/bucket_layout.h"
#include "runtime/cuda_gradients.h"
#include "runtime/data_parallel.h"
#include "runtime/model_check.h"

namespace troupe {

namespace {



struct TraceEvent {
  std::string name;
  int tid;
  int64_t ts_us;
  int64_t dur_us;
};

// The actors a failure listener must reach; replaced when buckets are rebuilt.
struct Targets {
  std::mutex mutex;
  std::vector<caf::actor> buckets;
};

}  // namespace

struct DistributedModule::Impl {
  Runtime& rt;
  std::shared_ptr<torch::nn::Module> module;
  Algorithm algorithm;
  DdpOptions opt;
  int rank = 0;
  int world = 1;
  uint32_t key_prefix = 0;

  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  // CUDA parameters: their events and the path of their buckets (null for a CPU module).
  std::unique_ptr<CudaGradients> cuda;
  // CPU buckets of a single-host job: the shared memory they live in (null: the transport's
  // path). Its data region has two halves; each build of the buckets takes the other one, so a
  // rebuild can copy the gradients over from the old buckets.
  std::shared_ptr<comm::LocalAllreduce> local;
  size_t local_half_bytes = 0;
  int local_half = 0;

  struct Bucket {
    torch::Tensor flat;
    std::vector<int> params;
    std::vector<int64_t> offsets;  // of each parameter, in elements
    comm::DataType type = comm::DataType::float32;
    caf::actor actor;
    std::shared_ptr<actors::BucketStats> stats;
  };
  std::vector<Bucket> buckets;
  std::vector<int> bucket_of;
  std::vector<int64_t> offset_of;
  caf::actor reducer;
  std::shared_ptr<Targets> targets = std::make_shared<Targets>();
  int listener = 0;

  // Hooks: the accumulators are kept alive; `alive` turns the hooks off at destruction.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;
  std::shared_ptr<std::atomic<Impl*>> hook_target;

  // The step in progress (trainer thread only).
  uint32_t step = 0;
  std::vector<char> ready;
  std::vector<int> order;
  std::vector<int64_t> order_us;  // when each gradient of `order` became ready
  bool sync = true;
  double denominator = 0;
  int64_t first_hook_us = 0;
  int64_t last_hook_us = 0;
  int64_t previous_end_us = 0;
  StepMetrics metrics;
  std::vector<TraceEvent> trace;

  Impl(Runtime& r, std::shared_ptr<torch::nn::Module> m, Algorithm a, DdpOptions o)
      : rt(r), module(std::move(m)), algorithm(std::move(a)), opt(std::move(o)) {}

  void check_options();
  void collect_parameters();
  void verify_same_model();
  void connect_local();
  BucketLayout plan(const std::vector<int>& order_hint, const std::vector<int64_t>& ready_us = {});
  void build_buckets(const BucketLayout& layout);
  void spawn_actors();
  void stop_actors();
  void on_grad_ready(int index);
  void await_step();
  void rebuild_from_observed_order();
  std::vector<torch::Tensor> state_tensors();
};

namespace {

class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::shared_ptr<std::atomic<DistributedModule::Impl*>> target, int index)
      : target_(std::move(target)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto* impl = target_->load()) impl->on_grad_ready(index_);
    return outputs;
  }

 private:
  std::shared_ptr<std::atomic<DistributedModule::Impl*>> target_;
  int index_;
};

/// Throws comm::Error naming the file when rank `rank`'s trace (DdpOptions::trace_path
/// `pattern`) cannot be written. Checked at construction, because the trace is written in the
/// destructor, which must not throw.
void check_trace_writable(const std::string& pattern, int rank) {
  std::string path = pattern;
  if (auto at = path.find("{rank}"); at != std::string::npos) path.replace(at, 6, std::to_string(rank));
  errno = 0;
  std::ofstream probe(path, std::ios::out | std::ios::app);
  if (!probe)
    throw comm::Error("DdpOptions.trace_path: cannot write the trace of rank " +
                      std::to_string(rank) + " to '" + path + "': " +
                      (errno != 0 ? std::strerror(errno) : "cannot open") +
                      " (expected a writable file)");
}

}  // namespace

void DistributedModule::Impl::check_options() {
  if (opt.bucket_bytes == 0 || opt.first_bucket_bytes == 0)
    throw comm::Error("DdpOptions.bucket_bytes=" + std::to_string(opt.bucket_bytes) +
                      ", first_bucket_bytes=" + std::to_string(opt.first_bucket_bytes) +
                      " (expected > 0)");
  if (opt.align_bytes == 0 || (opt.align_bytes & (opt.align_bytes - 1)) != 0)
    throw comm::Error("DdpOptions.align_bytes=" + std::to_string(opt.align_bytes) +
                      " (expected a power of two)");
  if (opt.bucket_split_gap.count() < 0)
    throw comm::Error("DdpOptions.bucket_split_gap=" + std::to_string(opt.bucket_split_gap.count()) +
                      "us (expected >= 0)");
  comm::validate(algorithm);
  if (!std::holds_alternative<GradientAllReduce>(algorithm) && !opt.agg_grad)
    throw comm::Error(comm::algorithm_name(algorithm) +
                      " compresses gradients: it needs DdpOptions.agg_grad = true (weights are "
                      "averaged with GradientAllReduce)");
  if (opt.stall_timeout.count() <= 0)
    throw comm::Error("DdpOptions.stall_timeout=" + std::to_string(opt.stall_timeout.count()) +
                      " ms (expected > 0)");
}

void DistributedModule::Impl::collect_parameters() {
  for (auto& item : module->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    if (!item.value().is_contiguous())
      throw comm::Error("parameter '" + item.key() + "' is not contiguous");
    comm_type(item.value().scalar_type(), "parameter '" + item.key() + "'");
    names.push_back(item.key());
    params.push_back(item.value());
  }
  if (params.empty()) throw comm::Error("DistributedModule: the module has no trainable parameter");
  const bool on_cuda = std::any_of(params.begin(), params.end(),
                                   [](const torch::Tensor& p) { return p.is_cuda(); });
  if (on_cuda)
    cuda = std::make_unique<CudaGradients>(rt, params, names,
                                           std::holds_alternative<GradientAllReduce>(algorithm),
                                           opt.stage_through_host, opt.stall_timeout);
}

// Every rank describes its model; rank by rank, the first difference is reported by name.
void DistributedModule::Impl::verify_same_model() {
  std::string mine = "algorithm " + comm::algorithm_name(algorithm) + "\n";
  if (cuda) mine += cuda->path() + "\n";
  mine += std::string("shared_memory ") + (opt.shared_memory ? "on" : "off") + "\n";
  for (size_t i = 0; i < params.size(); ++i) mine += names[i] + " " + shape_of(params[i]) + "\n";
  for (auto& b : module->named_buffers(true))
    mine += "buffer " + b.key() + " " + shape_of(b.value()) + "\n";
  check_same_on_every_rank(rt.comm(), mine);
}

void DistributedModule::Impl::connect_local() {
  if (!opt.shared_memory || world < 2 || cuda || !std::holds_alternative<GradientAllReduce>(algorithm))
    return;
  const auto& hosts = rt.hosts();
  if (std::any_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h != hosts[0]; }))
    return;
  // Room for any layout: every parameter padded to align_bytes, every bucket to a 64-byte line.
  const size_t align = std::max<size_t>(opt.align_bytes, 64);
  size_t bytes = 0;
  for (auto& p : params)
    bytes += (static_cast<size_t>(p.numel()) * p.element_size() + 2 * align - 1) / align * align;
  local_half_bytes = (bytes + align + 4095) / 4096 * 4096;
  try {
    local = comm::LocalAllreduce::connect(rt.comm(), 2 * local_half_bytes,
                                          opt.stall_timeout + std::chrono::seconds(10));
  } catch (const comm::Error& e) {  // every rank throws (connect agrees on failures)
    throw comm::Error("DistributedModule: shared memory for the buckets (" +
                      std::to_string(2 * local_half_bytes) + " bytes per rank): " + e.what() +
                      " (enlarge /dev/shm, or set DdpOptions::shared_memory = false to reduce "
                      "through the transport)",
                      e.peer());
  }
}

BucketLayout DistributedModule::Impl::plan(const std::vector<int>& order_hint,
                                           const std::vector<int64_t>& ready_us) {
  std::vector<ParameterShape> shapes;
  for (auto& p : params) shapes.push_back(ParameterShape{p.numel(), p.scalar_type()});
  return plan_buckets(shapes, order_hint, opt, ready_us);
}

void DistributedModule::Impl::build_buckets(const BucketLayout& layout) {
  buckets.clear();
  bucket_of = layout.bucket_of;
  offset_of = layout.offset_of;
  std::vector<int64_t> fill;
  for (auto& planned : layout.buckets) {
    Bucket b;
    b.type = comm_type(planned.type, "parameter '" + names[static_cast<size_t>(planned.params[0])] + "'");
    b.params = planned.params;
    b.offsets = planned.offsets;
    buckets.push_back(std::move(b));
    fill.push_back(planned.elements);
  }
  torch::NoGradGuard no_grad;
  const size_t align = std::max<size_t>(opt.align_bytes, 64);
  size_t cursor = static_cast<size_t>(local_half) * local_half_bytes;
  const size_t half_end = cursor + local_half_bytes;
  local_half ^= 1;
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bucket = buckets[b];
    const auto& first = params[static_cast<size_t>(bucket.params[0])];
    const auto options = first.options().requires_grad(false);
    const int64_t elements = std::max<int64_t>(fill[b], 1);
    if (local) {  // in this rank's shared region, at the same place on every rank
      cursor = (cursor + align - 1) / align * align;
      const size_t bytes = static_cast<size_t>(elements) * first.element_size();
      if (cursor + bytes > half_end)
        throw comm::Error("DistributedModule: bucket " + std::to_string(b) + " (" +
                          std::to_string(bytes) + " bytes at " + std::to_string(cursor) +
                          ") does not fit the shared region's half ending at " +
                          std::to_string(half_end));
      bucket.flat = torch::from_blob(local->data() + cursor, {elements}, [keep = local](void*) {},
                                     options);
      bucket.flat.zero_();
      cursor += bytes;
    } else {
      bucket.flat = torch::zeros({elements}, options);
    }
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      auto& p = params[static_cast<size_t>(bucket.params[k])];
      if (!opt.agg_grad) continue;
      // The gradient shares the bucket's memory but is not an autograd view of it, so that
      // optimizers may detach_() and zero_() it as they do any gradient.
      auto flat = bucket.flat;
      auto grad = torch::from_blob(
          static_cast<char*>(flat.data_ptr()) + bucket.offsets[k] * p.element_size(), p.sizes(),
          [flat](void*) {}, flat.options());
      if (p.grad().defined()) grad.copy_(p.grad());
      if (opt.gradient_as_bucket_view) p.mutable_grad() = grad;
    }
  }
}

void DistributedModule::Impl::spawn_actors() {
  auto& system = rt.system();
  reducer = actors::spawn_reducer(system, static_cast<int>(buckets.size()));
  actors::ReduceSettings settings;
  settings.average = opt.average || !opt.agg_grad;
  settings.divide_before = opt.divide_before && opt.agg_grad;
  settings.collectives = rt.comm().options();
  if (opt.hierarchical) {
    // By host only where that changes anything: several hosts, and some with several ranks.
    auto hosts = host_indices(rt.hosts());
    const int distinct = *std::max_element(hosts.begin(), hosts.end()) + 1;
    if (distinct > 1 && distinct < world) settings.collectives.hosts = std::move(hosts);
  }
  settings.key_prefix = key_prefix;
  settings.device_timeout = opt.stall_timeout;
  const auto order = cuda ? cuda->make_order(static_cast<int>(buckets.size())) : nullptr;
  std::vector<caf::actor> handles;
  std::vector<std::vector<std::string>> bucket_names;
  std::vector<int> expected;
  if (buckets.size() > 4096)
    throw comm::Error("DistributedModule: " + std::to_string(buckets.size()) +
                      " buckets (at most 4096; raise bucket_bytes or use Aggregation::bucket)");
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bucket = buckets[b];
    bucket.stats = std::make_shared<actors::BucketStats>();
    actors::BucketPlan plan;
    plan.index = static_cast<int>(b);
    plan.data = bucket.flat.data_ptr();
    plan.count = static_cast<size_t>(bucket.flat.numel());
    plan.type = bucket.type;
    plan.parameters = static_cast<int>(bucket.params.size());
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const auto& p = params[static_cast<size_t>(bucket.params[k])];
      comm::TensorSlot slot;
      slot.offset = static_cast<size_t>(bucket.offsets[k]);
      slot.count = static_cast<size_t>(p.numel());
      slot.rows = p.dim() >= 2 ? static_cast<size_t>(p.size(0)) : 1;
      plan.tensors.push_back(slot);
    }
    if (cuda)  // the events to wait on, and NCCL or a host mirror (then plan.data is the mirror)
      cuda->prepare(plan, bucket.params, plan.data,
                    plan.count * static_cast<size_t>(bucket.flat.element_size()), order);
    plan.local = local;
    if (local)  // the bucket lies in the shared region
      plan.local_offset = static_cast<size_t>(static_cast<char*>(plan.data) - local->data());
    comm::BucketBuffer buffer{plan.index, plan.data, plan.count, plan.type, plan.tensors};
    auto reduction = comm::make_reduction(algorithm, buffer);
    bucket.actor = actors::spawn_bucket(system, plan, settings, std::move(reduction),
                                        rt.transport(), reducer, bucket.stats);
    handles.push_back(bucket.actor);
    std::vector<std::string> n;
    for (int p : bucket.params) n.push_back(names[static_cast<size_t>(p)]);
    bucket_names.push_back(n);
    expected.push_back(plan.parameters);
  }
  actors::set_buckets(reducer, handles, bucket_names, expected);
  std::lock_guard<std::mutex> lock(targets->mutex);
  targets->buckets = handles;
}

void DistributedModule::Impl::stop_actors() {
  for (auto& b : buckets)
    if (b.actor) caf::anon_send_exit(b.actor, caf::exit_reason::user_shutdown);
  if (reducer) caf::anon_send_exit(reducer, caf::exit_reason::user_shutdown);
  reducer = nullptr;
}

void DistributedModule::Impl::on_grad_ready(int index) {
  if (!sync) return;
  const int64_t now = actors::now_us();
  if (order.empty()) first_hook_us = now;
  last_hook_us = now;
  if (ready[static_cast<size_t>(index)]) return;
  ready[static_cast<size_t>(index)] = 1;
  order.push_back(index);
  order_us.push_back(now);
  if (!opt.agg_grad) return;
  const int b = bucket_of[static_cast<size_t>(index)];
  auto& bucket = buckets[static_cast<size_t>(b)];
  if (!opt.gradient_as_bucket_view) {
    auto& p = params[static_cast<size_t>(index)];
    torch::NoGradGuard no_grad;
    bucket.flat.narrow(0, offset_of[static_cast<size_t>(index)], p.numel())
        .copy_(p.grad().reshape({-1}));
  }
  if (cuda) cuda->record_gradient(index);
  if (!opt.delay_reduce)
    caf::anon_send(bucket.actor, actors::ready_atom::value, step, denominator);
}

void DistributedModule::Impl::await_step() {
  caf::scoped_actor self{rt.system()};
  bool ok = false;
  std::string error;
  const int64_t stall_ms = opt.stall_timeout.count();
  self->request(reducer, opt.stall_timeout + std::chrono::seconds(10), actors::await_atom::value,
                step, stall_ms)
      .receive([&](bool k, const std::string& e) {
                 ok = k;
                 error = e;
               },
               [&](caf::error& e) {
                 error = "step " + std::to_string(step) + ": no answer from the reducer: " +
                         rt.system().render(e);
               });
  if (!ok) throw comm::Error(error);
}

void DistributedModule::Impl::rebuild_from_observed_order() {
  // Rank 0's order, completed with parameters that had no gradient, becomes everyone's, and so
  // do its ready times (microseconds after its first gradient; -1 for none), which split buckets
  // where backward paused between two gradients.
  const size_t n = params.size();
  std::vector<int64_t> seen(2 * n, -1);
  if (rank == 0) {
    size_t k = 0;
    std::vector<char> used(n, 0);
    for (size_t j = 0; j < order.size(); ++j) {
      const int i = order[j];
      seen[k++] = i;
      seen[n + static_cast<size_t>(i)] = order_us[j] - order_us.front();
      used[static_cast<size_t>(i)] = 1;
    }
    for (int i = static_cast<int>(n) - 1; i >= 0; --i)
      if (!used[static_cast<size_t>(i)]) seen[k++] = i;
  }
  rt.comm().broadcast(seen.data(), seen.size(), comm::DataType::int64, 0);
  std::vector<int> new_order(seen.begin(), seen.begin() + static_cast<std::ptrdiff_t>(n));
  std::vector<int64_t> ready_us(seen.begin() + static_cast<std::ptrdiff_t>(n), seen.end());
  auto planned = plan(new_order, ready_us);
  bool same = planned.buckets.size() == buckets.size();
  for (size_t b = 0; same && b < buckets.size(); ++b)
    same = planned.buckets[b].params == buckets[b].params;
  if (same) return;
  stop_actors();
  build_buckets(planned);
  spawn_actors();
}

std::vector<torch::Tensor> DistributedModule::Impl::state_tensors() {
  std::vector<torch::Tensor> out;
  for (auto& p : module->parameters(true)) out.push_back(p);
  for (auto& b : module->buffers(true)) out.push_back(b);
  return out;
}

DistributedModule::DistributedModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                                     Algorithm algorithm, DdpOptions options) {
  if (!module) throw comm::Error("DistributedModule: module is null");
  impl_ = std::make_unique<Impl>(runtime, std::move(module), std::move(algorithm),
                                 std::move(options));
  auto& m = *impl_;
  m.check_options();
  m.rank = runtime.rank();
  m.world = runtime.world_size();
  if (!m.opt.trace_path.empty()) check_trace_writable(m.opt.trace_path, m.rank);
  m.key_prefix = static_cast<uint32_t>(runtime.next_module_id()) << 28;
  m.denominator = m.world;
  m.collect_parameters();
  m.verify_same_model();
  if (m.cuda) m.cuda->connect();  // collective: every rank has passed the model check
  m.connect_local();              // collective too
  broadcast_parameters(0);
  m.build_buckets(m.plan({}));
  m.spawn_actors();
  m.ready.assign(m.params.size(), 0);
  m.hook_target = std::make_shared<std::atomic<Impl*>>(impl_.get());
  for (size_t i = 0; i < m.params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(m.params[i]);
    m.hook_keys.push_back(
        acc->add_post_hook(std::make_unique<ReadyHook>(m.hook_target, static_cast<int>(i))));
    m.accumulators.push_back(std::move(acc));
  }
  auto targets = m.targets;
  m.listener = runtime.add_failure_listener([targets](int rank, const std::string& reason) {
    std::lock_guard<std::mutex> lock(targets->mutex);
    for (auto& b : targets->buckets) caf::anon_send(b, actors::abort_atom::value, reason, rank);
  });
  m.previous_end_us = actors::now_us();
}

DistributedModule::~DistributedModule() {
  auto& m = *impl_;
  m.hook_target->store(nullptr);
  for (size_t i = 0; i < m.accumulators.size(); ++i) m.accumulators[i]->del_post_hook(m.hook_keys[i]);
  m.rt.remove_failure_listener(m.listener);
  m.stop_actors();
  if (!m.opt.trace_path.empty()) {
    std::string path = m.opt.trace_path;
    auto at = path.find("{rank}");
    if (at != std::string::npos) path.replace(at, 6, std::to_string(m.rank));
    try {
      write_trace(path);
    } catch (const std::exception&) {
      // A destructor must not throw; the trace is a diagnostic.
    }
  }
}

void DistributedModule::set_denominator(double denominator) {
  if (!(denominator > 0))
    throw comm::Error("set_denominator(" + std::to_string(denominator) + "): expected > 0");
  impl_->denominator = denominator;
}

void DistributedModule::step(torch::optim::Optimizer& optimizer) {
  step([&optimizer] { optimizer.step(); });
}

void DistributedModule::step(const std::function<void()>& optimizer_step) {
  auto& m = *impl_;
  if (!m.sync)
    throw comm::Error("DistributedModule::step() called inside no_sync(): leave the scope and "
                      "run one more backward first");
  const int64_t wait_start = actors::now_us();
  if (m.opt.agg_grad) {
    std::vector<std::string> missing;
    for (size_t i = 0; i < m.params.size(); ++i)
      if (!m.ready[i]) missing.push_back(m.names[i]);
    if (!missing.empty() && !m.opt.find_unused_parameters) {
      std::string list;
      for (auto& n : missing) list += (list.empty() ? "" : ", ") + n;
      throw comm::Error("step " + std::to_string(m.step) + ": parameter(s) without a gradient: " +
                        list + " (use DdpOptions.find_unused_parameters to reduce them as zeros)");
    }
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < m.params.size(); ++i) {
      if (m.ready[i]) continue;
      const int b = m.bucket_of[i];
      m.buckets[static_cast<size_t>(b)].flat.narrow(0, m.offset_of[i], m.params[i].numel()).zero_();
    }
    // Every bucket is told to launch: one that filled already has (this message comes after the
    // hooks' ready messages from this thread) and ignores it; the rest are not full because of
    // delay_reduce or of unused parameters. CUDA buckets wait for what was enqueued here.
    if (m.cuda) m.cuda->record_step();
    for (auto& bucket : m.buckets)
      caf::anon_send(bucket.actor, actors::launch_atom::value, m.step, m.denominator);
    m.await_step();
    if (!m.opt.gradient_as_bucket_view)
      for (size_t i = 0; i < m.params.size(); ++i) {
        auto& p = m.params[i];
        auto view = m.buckets[static_cast<size_t>(m.bucket_of[i])].flat.narrow(0, m.offset_of[i], p.numel());
        if (p.grad().defined()) p.mutable_grad().copy_(view.view(p.sizes()));
        else p.mutable_grad() = view.view(p.sizes()).clone();
      }
  }
  const int64_t reduced = actors::now_us();
  optimizer_step();
  if (!m.opt.agg_grad) {
    torch::NoGradGuard no_grad;
    for (auto& bucket : m.buckets)
      for (size_t k = 0; k < bucket.params.size(); ++k) {
        auto& p = m.params[static_cast<size_t>(bucket.params[k])];
        bucket.flat.narrow(0, bucket.offsets[k], p.numel()).copy_(p.reshape({-1}));
      }
    if (m.cuda) m.cuda->record_step();
    for (auto& bucket : m.buckets)
      caf::anon_send(bucket.actor, actors::launch_atom::value, m.step, double(m.world));
    m.await_step();
    for (auto& bucket : m.buckets)
      for (size_t k = 0; k < bucket.params.size(); ++k) {
        auto& p = m.params[static_cast<size_t>(bucket.params[k])];
        p.copy_(bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes()));
      }
  }
  const int64_t end = actors::now_us();

  StepMetrics metrics;
  metrics.step = m.step;
  metrics.step_sec = static_cast<double>(end - m.previous_end_us) / 1e6;
  metrics.comm_wait_sec =
      static_cast<double>((m.opt.agg_grad ? reduced - wait_start : end - reduced)) / 1e6;
  metrics.backward_end_us = m.last_hook_us;
  for (auto& bucket : m.buckets) {
    metrics.bytes_sent += bucket.stats->bytes_sent;
    metrics.bytes_received += bucket.stats->bytes_received;
    metrics.bucket_start_us.push_back(bucket.stats->ready_us);
    metrics.bucket_done_us.push_back(bucket.stats->done_us);
  }
  m.metrics = metrics;
  if (!m.order.empty()) {
    // Forward is not observed directly: it is what runs between the end of the previous step
    // and the first gradient (forward, loss, and the last layer's backward).
    m.trace.push_back({"forward", 0, m.previous_end_us, m.first_hook_us - m.previous_end_us});
    m.trace.push_back({"backward", 0, m.first_hook_us, m.last_hook_us - m.first_hook_us});
  }
  m.trace.push_back({m.opt.agg_grad ? "wait for reductions" : "average weights", 0, wait_start,
                     (m.opt.agg_grad ? reduced : end) - wait_start});
  for (size_t b = 0; b < m.buckets.size(); ++b)
    m.trace.push_back({"reduce bucket " + std::to_string(b), 1, m.buckets[b].stats->ready_us,
                       m.buckets[b].stats->done_us - m.buckets[b].stats->ready_us});

  const bool first = m.step == 0;
  ++m.step;
  m.previous_end_us = end;
  if (first && m.opt.rebuild_buckets && m.opt.agg_grad && m.opt.aggregation == Aggregation::bucket)
    m.rebuild_from_observed_order();
  std::fill(m.ready.begin(), m.ready.end(), 0);
  m.order.clear();
  m.order_us.clear();
  m.denominator = m.world;
}

DistributedModule::NoSync::NoSync(DistributedModule* module) : module_(module) {
  module_->impl_->sync = false;
}
DistributedModule::NoSync::~NoSync() {
  if (module_) module_->impl_->sync = true;
}
DistributedModule::NoSync::NoSync(NoSync&& other) noexcept : module_(other.module_) {
  other.module_ = nullptr;
}
DistributedModule::NoSync DistributedModule::no_sync() { return NoSync(this); }

void DistributedModule::broadcast_parameters(int root) {
  torch::NoGradGuard no_grad;
  auto& m = *impl_;
  for (auto& t : m.state_tensors()) {
    auto type = comm_type(t.scalar_type(), "a parameter or buffer");
    if (!t.is_cuda()) {
      m.rt.comm().broadcast(t.data_ptr(), static_cast<size_t>(t.numel()), type, root);
      continue;
    }
    // The transport moves host memory: a CUDA tensor travels through a host copy.
    auto host = t.to(torch::kCPU).contiguous();
    m.rt.comm().broadcast(host.data_ptr(), static_cast<size_t>(host.numel()), type, root);
    t.copy_(host);
  }
}

void DistributedModule::allreduce_parameters() { average_module(impl_->rt, *impl_->module); }

const StepMetrics& DistributedModule::last_step() const { return impl_->metrics; }

std::string DistributedModule::algorithm_name() const {
  return comm::algorithm_name(impl_->algorithm);
}

size_t DistributedModule::bucket_count() const { return impl_->buckets.size(); }

std::string DistributedModule::gradient_path() const {
  if (!impl_->cuda) return impl_->local ? "cpu via shared memory" : "cpu";
  return impl_->cuda->uses_nccl() ? "cuda via nccl" : "cuda via host staging";
}

std::vector<std::vector<std::string>> DistributedModule::bucket_parameters() const {
  std::vector<std::vector<std::string>> out;
  for (auto& b : impl_->buckets) {
    out.emplace_back();
    for (int p : b.params) out.back().push_back(impl_->names[static_cast<size_t>(p)]);
  }
  return out;
}

void DistributedModule::write_trace(const std::string& path) const {
  std::ofstream out(path);
  if (!out) throw comm::Error("cannot write the trace to '" + path + "'");
  out << "{\"traceEvents\": [\n";
  const auto& events = impl_->trace;
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    out << "  {\"name\": \"" << e.name << "\", \"ph\": \"X\", \"pid\": " << impl_->rank
        << ", \"tid\": " << e.tid << ", \"ts\": " << e.ts_us << ", \"dur\": " << e.dur_us << "}"
        << (i + 1 < events.size() ? ",\n" : "\n");
  }
  out << "]}\n";
}

}  // namespace troupe
