#include "ddp/distributed_module.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "actors/bucket.h"
#include "actors/handoff.h"
#include "actors/node.h"
#include "actors/reducer.h"
#include "comm/tags.h"
#include "comm/timeout_setting.h"
#include "ddp/bucket_layout.h"
#include "ddp/cuda_gradients.h"
#include "ddp/data_parallel.h"
#include "ddp/gradient_arena.h"
#include "ddp/gradient_path.h"
#include "ddp/module_buffers.h"
#include "ddp/wrapped_modules.h"
#include "rank/fault.h"
#include "rank/model_check.h"
#include "rank/module_id.h"
#include "rank/runtime_internal.h"

namespace troupe {

namespace {

// DdpOptions::overlap_next_forward: the module that holds each parameter (by its TensorImpl),
// for await_parameters(layer), and how many modules have a step still to apply (none: it
// returns at once).
struct OverlapRegistry {
  std::mutex mutex;
  std::unordered_map<const void*, DistributedModule*> owner;
};
OverlapRegistry& overlap_registry() {
  static auto* registry = new OverlapRegistry;  // outlives every module, even static ones
  return *registry;
}
std::atomic<int> pending_steps{0};

// One span of the trace. The name is a literal (plus the bucket for a reduction), so recording
// an event allocates nothing.
struct TraceEvent {
  const char* name;
  int bucket;  // -1: not a bucket's span
  int tid;
  int64_t ts_us;
  int64_t dur_us;
};

// The last kTraceEvents spans of a rank, recorded only when a trace was asked for: a job of any
// length keeps a bounded trace (about 12,000 steps of a 3-bucket model), and one without a trace
// keeps nothing.
constexpr size_t kTraceEvents = size_t{1} << 16;

class TraceRing {
 public:
  void add(const TraceEvent& e) {
    if (events_.size() < kTraceEvents) {
      events_.push_back(e);
      return;
    }
    events_[next_] = e;
    next_ = (next_ + 1) % kTraceEvents;
  }
  size_t size() const { return events_.size(); }
  // The i-th oldest event kept.
  const TraceEvent& operator[](size_t i) const { return events_[(next_ + i) % events_.size()]; }

 private:
  std::vector<TraceEvent> events_;
  size_t next_ = 0;  // once full: the oldest event, overwritten next
};

// The actors a failure listener must reach; replaced when buckets are rebuilt.
struct Targets {
  std::mutex mutex;
  std::vector<actors::Bucket> buckets;
};

}  // namespace

struct DistributedModule::Impl {
  Runtime& rt;
  ModuleId id;  // given back last, once the actors that use its keys are gone
  std::shared_ptr<torch::nn::Module> module;
  WrappedModule wrapped;  // refuses a second wrapper of the module while this one lives
  Algorithm algorithm;
  DdpOptions opt;
  int rank = 0;
  int world = 1;
  uint32_t key_prefix = 0;

  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  // CUDA parameters: their events (null for a CPU module).
  std::unique_ptr<CudaGradients> cuda;
  // How the buckets are reduced (ddp/gradient_path.h), chosen at construction, and why the
  // candidates before it declined. Declared after `cuda`: a path's device work waits on its
  // events, so the path goes first.
  GradientPathContext path_context;
  std::unique_ptr<GradientPath> path;
  std::vector<std::string> declined;

  struct Bucket {
    torch::Tensor flat;
    std::vector<int> params;
    std::vector<int64_t> offsets;  // of each parameter, in elements
    comm::DataType type = comm::DataType::float32;
    actors::Bucket actor;
    std::shared_ptr<actors::BucketStats> stats;
    std::shared_ptr<actors::BucketPath> path;  // its algorithm state lives here (save_state)
  };
  std::vector<Bucket> buckets;
  std::vector<int> bucket_of;
  std::vector<int64_t> offset_of;
  // Each parameter's slot of its bucket, shaped as the parameter (agg_grad only): with
  // gradient_as_bucket_view, what its gradient must be for the bucket to reduce it.
  std::vector<torch::Tensor> grad_views;
  // Per parameter: the data of its gradient where the path reduces it in place
  // (Adoption::reduced_in_place: the gradient autograd allocated holds the average, its slot
  // does not); null where the slot holds it. Set by adopt_gradient, cleared wherever the
  // gradient points at its slot again.
  std::vector<const void*> in_place;
  actors::Reducer reducer;
  std::shared_ptr<Targets> targets = std::make_shared<Targets>();
  int listener = 0;

  // The autograd hooks on the parameters' gradient accumulators (install_hooks): a post-hook
  // each (on_grad_ready) and, with overlap_next_forward, a pre-hook each (before_gradient). The
  // accumulators are kept alive; `target` turns the hooks off at destruction.
  struct Hooks {
    // What grad_accumulator returns: a std::shared_ptr<Node> up to LibTorch 2.14, a
    // c10::intrusive_ptr<Node> from 2.15.
    std::vector<decltype(torch::autograd::impl::grad_accumulator(
        std::declval<const at::Tensor&>()))>
        accumulators;
    std::vector<uintptr_t> post_keys;
    std::vector<uintptr_t> pre_keys;
    std::shared_ptr<std::atomic<Impl*>> target;
  } hooks;

  // The step in progress (trainer thread only), and the first this module took (resume_at).
  uint32_t step = 0;
  uint32_t first_step = 0;
  // The reduction the buckets and the reducer are told: one per backward pass that reduces (so a
  // step of several backward passes counts several), the step's number while each step has one.
  uint32_t round = 0;
  // Backward passes of this step whose reductions are done (closed at the end of their backward,
  // as PyTorch DDP's backward returns with the gradients averaged), and what a failed one said:
  // step() throws it.
  int rounds_closed = 0;
  std::string round_error;
  // A backward pass whose reductions were launched and not yet awaited, and its round.
  bool in_flight = false;
  uint32_t in_flight_round = 0;
  // Between the end of a step's reductions and next_step (agg_grad: while the optimizer runs):
  // the algorithm state is the next step's, which save_state may record.
  bool reduced = false;
  // Off inside no_sync().
  bool sync = true;

  // The backward pass in progress: which gradients are ready, in what order and when, and
  // whether a callback waits for its end (queued by its first gradient).
  struct Pass {
    std::vector<char> ready;
    std::vector<int> order;
    std::vector<int64_t> order_us;  // when each gradient of `order` became ready
    bool end_queued = false;
    bool started() const { return !order.empty(); }
    void clear() {
      std::fill(ready.begin(), ready.end(), 0);
      order.clear();
      order_us.clear();
    }
  } pass;

  // The bucket rebuild after the first step: the gradient-ready order and times of the step's
  // first backward pass (what it follows); the order and times the buckets were rebuilt from
  // (empty before the rebuild: what save_state records of the layout); and whether the buckets
  // are in a rebuilt layout loaded by load_state (no rebuild after the first step then).
  struct Rebuild {
    std::vector<int> first_order;
    std::vector<int64_t> first_order_us;
    std::vector<int> order;
    std::vector<int64_t> ready_us;
    bool loaded = false;
  } rebuild;

  // When the step's parts happened (its StepMetrics and trace): its first and latest gradient,
  // the end of the step before, and the time spent waiting for its reductions.
  struct Times {
    int64_t first_hook_us = 0;
    int64_t last_hook_us = 0;
    int64_t previous_end_us = 0;
    int64_t wait_us = 0;
    std::vector<std::pair<int64_t, int64_t>> waits;  // start and length of each, when tracing
    void waited(int64_t start, int64_t end, bool tracing) {
      wait_us += end - start;
      if (tracing) waits.emplace_back(start, end - start);
    }
  } times;
  StepMetrics metrics;
  bool tracing = false;  // a trace was asked for (DdpOptions::trace_path)
  TraceRing trace;

  // save_state's per-bucket scratch and comm::algorithm_name(algorithm), kept so that saving
  // each step (ElasticTrainer does) allocates nothing.
  mutable std::string bucket_scratch;
  mutable std::string saved_name;

  // set_denominator: `denominator` is what the buckets are told this step (fixed once backward
  // has told them; with join always the world size, which joined ranks can match), `requested`
  // what the step must divide by (0: the default); step() rescales where they differ.
  double denominator = 0;
  double requested = 0;
  // broadcast_buffers (null: off, one rank, or no buffer).
  std::unique_ptr<ModuleBuffers> buffers;

  // DdpOptions::join: one flag per rank, 1 where the rank trains this step (summed over ranks),
  // how many train, and the lowest of them (of the last step in which any trained): the source
  // of buffers and of the rebuilt bucket order, and at the end of join() of the parameters.
  struct Join {
    std::vector<float> training;
    int count = 0;
    int lead = 0;
  } join;

  // DdpOptions::overlap_next_forward: a step whose optimizer runs bucket by bucket as the next
  // forward awaits the parameters. Each parameter's index by its TensorImpl; the optimizer of
  // the step not yet applied (null: none), the buckets whose parameters it has not stepped yet,
  // and the factor of a set_denominator() after backward; the buckets this backward's first
  // gradient had to step because the forward did not await them (a gradient of one of their
  // parameters is then an error); and the figures of the last deferred reduction that
  // completed, reported by the step that completed it.
  struct Deferred {
    std::unordered_map<const void*, int> index_of;
    torch::optim::Optimizer* optimizer = nullptr;
    std::vector<char> unstepped;
    size_t unstepped_count = 0;
    double scale = 1;
    std::vector<char> late;
    StepMetrics completed;
    // Per parameter, the gradient reduced in place (see in_place) that the deferred step is to
    // apply, held while the parameter's gradient is none.
    std::vector<torch::Tensor> grads;
  } deferred;

  Impl(Runtime& r, std::shared_ptr<torch::nn::Module> m, Algorithm a, DdpOptions o)
      : rt(r),
        id(r),
        module(std::move(m)),
        wrapped(module.get(), "DistributedModule"),
        algorithm(std::move(a)),
        opt(std::move(o)) {}

  void check_options();
  void collect_parameters();
  void choose_path();
  void verify_same_model();
  BucketLayout plan(const std::vector<int>& order_hint, const std::vector<int64_t>& ready_us = {});
  void build_buckets(const BucketLayout& layout);
  void spawn_actors();
  void stop_actors();
  void install_hooks(DistributedModule* owner);
  void remove_hooks();
  void on_grad_ready(int index);
  void on_backward_end();
  void close_round();
  void launch_round();
  void finish_round();
  void launch_and_await(double by, bool fault_point = false);
  void copy_out();
  std::string describe(int index) const;
  void adopt_gradient(int index);
  size_t bytes_copied = 0;  // by adopt_gradient since the last step (StepMetrics)
  void await_round(uint32_t which, const std::vector<int>& wanted = {});
  double rescale_factor() const;
  bool rebuild_due() const;
  void before_gradient(int index);
  void defer_step(torch::optim::Optimizer& optimizer);
  void step_buckets(const std::vector<int>& wanted);
  void masked_step(const std::vector<int>& wanted);
  void zero_gradients(const std::vector<int>& wanted);
  void await_for(const std::vector<int>& indices);
  void await_all();
  void used_before_update(int index) const;
  void run_step(torch::optim::Optimizer* optimizer, const std::function<void()>& optimizer_step);
  // run_step's parts: refuse a step that cannot be taken; close a backward pass still open;
  // average the weights (agg_grad = false); record the step's metrics and trace.
  void check_step() const;
  void close_open_pass();
  void average_weights();
  void record_step(int64_t wait_start, int64_t reduced, int64_t end, bool defer);
  StepMetrics reduction_figures();
  void rebuild_from_observed_order(int root);
  std::vector<torch::Tensor> state_tensors();
  void agree_on_training(bool mine);
  bool rescale_reduced();
  torch::Tensor reduced_in_place(size_t i) const;
  void scale_reduced(int b, double factor);
  void point_at_slot(size_t i);
  void load_averaged_weights();
  void shadow_step();
  void next_step();
  // A backward pass of this step has begun (its gradients became ready) or been reduced.
  bool step_begun() const { return pass.started() || rounds_closed > 0; }
  // What the buckets divide the sum over ranks by: the step's denominator when averaging, 1 for a
  // sum.
  double bucket_denominator() const { return opt.average ? denominator : 1.0; }
};

namespace {

// Target is DistributedModule::Impl (private: named where the hooks are made).
template <class Target>
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::shared_ptr<std::atomic<Target*>> target, int index)
      : target_(std::move(target)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto* impl = target_->load()) impl->on_grad_ready(index_);
    return outputs;
  }

 private:
  std::shared_ptr<std::atomic<Target*>> target_;
  int index_;
};

// Before a gradient is accumulated (DdpOptions::overlap_next_forward): the step still to apply
// must reach its parameter first.
template <class Target>
class BeforeGradientHook : public torch::autograd::FunctionPreHook {
 public:
  BeforeGradientHook(std::shared_ptr<std::atomic<Target*>> target, int index)
      : target_(std::move(target)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto* impl = target_->load()) impl->before_gradient(index_);
    return grads;
  }

 private:
  std::shared_ptr<std::atomic<Target*>> target_;
  int index_;
};

/// Throws comm::Error naming the file when rank `rank`'s trace (DdpOptions::trace_path
/// `pattern`) cannot be written. Checked at construction, because the trace is written in the
/// destructor, which must not throw.
void check_trace_writable(const std::string& pattern, int rank) {
  std::string path = pattern;
  if (auto at = path.find("{rank}"); at != std::string::npos)
    path.replace(at, 6, std::to_string(rank));
  errno = 0;
  std::ofstream probe(path, std::ios::out | std::ios::app);
  if (!probe)
    throw comm::Error("DdpOptions.trace_path: cannot write the trace of rank " +
                      std::to_string(rank) + " to '" + path +
                      "': " + (errno != 0 ? std::strerror(errno) : "cannot open") +
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
    throw comm::Error("DdpOptions.bucket_split_gap=" +
                      std::to_string(opt.bucket_split_gap.count()) + "us (expected >= 0)");
  comm::validate(algorithm);
  if (!std::holds_alternative<GradientAllReduce>(algorithm) && !opt.agg_grad)
    throw comm::Error(comm::algorithm_name(algorithm) +
                      " compresses gradients: it needs DdpOptions.agg_grad = true (weights are "
                      "averaged with GradientAllReduce)");
  if (opt.stall_timeout && opt.stall_timeout->count() <= 0)
    throw comm::Error("DdpOptions.stall_timeout=" + std::to_string(opt.stall_timeout->count()) +
                      " ms (expected > 0, or unset for the Runtime's collective timeout)");
  // From here on it is set: every wait of the step and of its path has this deadline.
  if (!opt.stall_timeout) opt.stall_timeout = detail::RuntimeAccess::collective_timeout(rt);
  const auto* sign = std::get_if<SignCompression>(&algorithm);
  if (opt.overlap_next_forward && (opt.join || !opt.agg_grad))
    throw comm::Error(std::string("DdpOptions.overlap_next_forward with ") +
                      (opt.join ? "join" : "agg_grad = false") +
                      " (expected agg_grad = true and no join: the optimizer steps each bucket's "
                      "reduced gradients during the next forward)");
  if (opt.join && sign && sign->mode == SignMode::majority_vote)
    throw comm::Error("DdpOptions.join with " + comm::algorithm_name(algorithm) +
                      ": a joined rank's zero gradient would vote (expected another algorithm, or "
                      "SignMode::scaled)");
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
  const bool on_cuda =
      std::any_of(params.begin(), params.end(), [](const torch::Tensor& p) { return p.is_cuda(); });
  if (on_cuda && opt.overlap_next_forward)
    throw comm::Error(
        "DdpOptions.overlap_next_forward with CUDA parameters (expected CPU "
        "parameters: the overlap of the next forward has not run on a GPU yet)");
  if (on_cuda) cuda = std::make_unique<CudaGradients>(params, names);
  for (size_t i = 0; i < params.size(); ++i)
    deferred.index_of[params[i].unsafeGetTensorImpl()] = static_cast<int>(i);
}

void DistributedModule::Impl::choose_path() {
  path_context.runtime = &rt;
  path_context.algorithm = &algorithm;
  path_context.options = &opt;
  path_context.params = &params;
  path_context.cuda = cuda.get();
  path_context.key_prefix = key_prefix;
  auto choice = choose_gradient_path(gradient_path_candidates(), path_context);
  path = std::move(choice.path);
  declined = std::move(choice.declined);
}

// Every rank describes its model; rank by rank, the first difference is reported by name.
void DistributedModule::Impl::verify_same_model() {
  std::string mine = "algorithm " + comm::algorithm_name(algorithm) + "\n";
  mine += std::string("shared_memory ") + (opt.shared_memory ? "on" : "off") + "\n";
  mine += std::string("broadcast_buffers ") + (opt.broadcast_buffers ? "on" : "off") + "\n";
  mine += std::string("join ") +
          (!opt.join                          ? "off"
           : opt.divide_by_initial_world_size ? "on, divide by world size"
                                              : "on, divide by ranks training") +
          "\n";
  mine += "gradient path " + path->name() + "\n";
  for (size_t i = 0; i < params.size(); ++i) mine += names[i] + " " + shape_of(params[i]) + "\n";
  for (auto& b : module->named_buffers(true))
    mine += "buffer " + b.key() + " " + shape_of(b.value()) + "\n";
  check_same_on_every_rank(rt.comm(), mine);
}

BucketLayout DistributedModule::Impl::plan(const std::vector<int>& order_hint,
                                           const std::vector<int64_t>& ready_us) {
  std::vector<ParameterShape> shapes;
  for (auto& p : params) shapes.push_back(ParameterShape{p.numel(), p.scalar_type()});
  return plan_buckets(shapes, order_hint, opt, ready_us);
}

void DistributedModule::Impl::build_buckets(const BucketLayout& layout) {
  buckets.clear();
  deferred.late.assign(layout.buckets.size(), 0);
  deferred.unstepped.assign(layout.buckets.size(), 0);
  grad_views.assign(params.size(), torch::Tensor());
  in_place.assign(params.size(), nullptr);  // the gradients are copied into the new slots below
  bucket_of = layout.bucket_of;
  offset_of = layout.offset_of;
  std::vector<int64_t> fill;
  for (auto& planned : layout.buckets) {
    Bucket b;
    b.type = comm_type(planned.type,
                       "parameter '" + names[static_cast<size_t>(planned.params[0])] + "'");
    b.params = planned.params;
    b.offsets = planned.offsets;
    buckets.push_back(std::move(b));
    fill.push_back(planned.elements);
  }
  torch::NoGradGuard no_grad;
  path->begin_buckets(static_cast<int>(buckets.size()));
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bucket = buckets[b];
    const auto& first = params[static_cast<size_t>(bucket.params[0])];
    const auto options = first.options().requires_grad(false);
    const int64_t elements = std::max<int64_t>(fill[b], 1);
    bucket.flat = path->bucket_memory(static_cast<int>(b), elements, options);
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
      grad_views[static_cast<size_t>(bucket.params[k])] = std::move(grad);
    }
  }
}

void DistributedModule::Impl::spawn_actors() {
  auto& system = detail::node(rt).system();
  reducer = actors::Reducer::spawn(system, static_cast<int>(buckets.size()));
  std::vector<actors::Bucket> handles;
  std::vector<std::vector<std::string>> bucket_names;
  std::vector<int> expected;
  if (buckets.size() > static_cast<size_t>(comm::tags::kMaxBuckets))
    throw comm::Error("DistributedModule: " + std::to_string(buckets.size()) +
                      " buckets (at most " + std::to_string(comm::tags::kMaxBuckets) +
                      "; raise bucket_bytes or use Aggregation::bucket)");
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bucket = buckets[b];
    bucket.stats = std::make_shared<actors::BucketStats>();
    comm::BucketBuffer buffer{static_cast<int>(b),
                              bucket.flat.data_ptr(),
                              static_cast<size_t>(bucket.flat.numel()),
                              bucket.type,
                              {}};
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const auto& p = params[static_cast<size_t>(bucket.params[k])];
      comm::TensorSlot slot;
      slot.offset = static_cast<size_t>(bucket.offsets[k]);
      slot.count = static_cast<size_t>(p.numel());
      slot.rows = p.dim() >= 2 ? static_cast<size_t>(p.size(0)) : 1;
      buffer.tensors.push_back(slot);
    }
    bucket.path =
        path->bucket(buffer, cuda ? cuda->ready_events(bucket.params) : std::vector<void*>{});
    const int parameters = static_cast<int>(bucket.params.size());
    bucket.actor = actors::Bucket::spawn(system, buffer.index, parameters, bucket.path,
                                         reducer.sink(), bucket.stats);
    handles.push_back(bucket.actor);
    std::vector<std::string> n;
    for (int p : bucket.params) n.push_back(names[static_cast<size_t>(p)]);
    bucket_names.push_back(n);
    expected.push_back(parameters);
  }
  reducer.set_buckets(handles, bucket_names, expected);
  std::lock_guard<std::mutex> lock(targets->mutex);
  targets->buckets = handles;
}

void DistributedModule::Impl::stop_actors() {
  for (auto& b : buckets) b.actor.stop();
  reducer.stop();
}

// A gradient that is not its bucket slot — backward allocated it because the user had set the
// gradient to none (LibTorch >= 2.0's zero_grad() default, Module::zero_grad(true)), or replaced
// it — is brought into the slot by the path (copied, or handed to a reduction that reads it where
// it lies), and the gradient points at the slot again (as PyTorch DDP does).
void DistributedModule::Impl::adopt_gradient(int index) {
  auto& p = params[static_cast<size_t>(index)];
  const auto& view = grad_views[static_cast<size_t>(index)];
  const auto& grad = p.grad();
  auto& reduced_at = in_place[static_cast<size_t>(index)];
  reduced_at = nullptr;
  if (grad.defined() && !grad.is_sparse() && grad.data_ptr() == view.data_ptr()) return;
  torch::NoGradGuard no_grad;
  if (grad.defined() && !grad.is_sparse() && grad.device().is_cpu() && view.device().is_cpu() &&
      grad.scalar_type() == view.scalar_type() && grad.is_contiguous() &&
      grad.sizes() == view.sizes()) {
    const Adoption how = path->adopt(bucket_of[static_cast<size_t>(index)],
                                     offset_of[static_cast<size_t>(index)], grad, view);
    if (how == Adoption::reduced_in_place) {
      reduced_at = grad.data_ptr();  // the gradient stays where it is and receives the average
      return;
    }
    if (how == Adoption::copied) bytes_copied += view.nbytes();
  } else if (grad.defined()) {
    view.copy_(grad.is_sparse() ? grad.to_dense() : grad);
    bytes_copied += view.nbytes();
  } else {
    view.zero_();
  }
  p.mutable_grad() = view;
}

std::string DistributedModule::Impl::describe(int index) const {
  return "parameter '" + names[static_cast<size_t>(index)] + "' of module '" + opt.name + "'";
}

void DistributedModule::Impl::on_grad_ready(int index) {
  if (!sync || !round_error.empty()) return;
  const int64_t now = actors::now_us();
  if (!pass.started()) {
    if (rounds_closed == 0) {
      times.first_hook_us = now;
      fault::at(FaultPhase::backward, step);  // once per step: the first gradient
    } else if (opt.average && denominator != world) {
      // A later backward pass reduces the gradient accumulated so far again, which only an
      // average over the world size leaves as it was.
      throw comm::Error("step " + std::to_string(step) + ": a backward pass after " +
                        std::to_string(rounds_closed) + " reduced one(s), with set_denominator(" +
                        std::to_string(denominator) +
                        ") called before them (expected "
                        "set_denominator() after the step's last backward pass)");
    }
    // The reductions of this backward pass are launched (what is left of them) and awaited when
    // it ends, so that the next backward pass accumulates onto averaged gradients, never into
    // buckets still reducing. With join, step() reduces (the joined ranks meet it there).
    if (opt.agg_grad && !opt.join && !pass.end_queued) {
      pass.end_queued = true;
      torch::autograd::Engine::get_default_engine().queue_callback([target = hooks.target] {
        if (auto* impl = target->load()) impl->on_backward_end();
      });
    }
  }
  times.last_hook_us = now;
  if (pass.ready[static_cast<size_t>(index)]) {
    if (!opt.agg_grad) return;  // local gradient accumulation before a local step: harmless
    // The bucket may already be reduced or reducing: a second gradient would be lost on some
    // ranks or summed into the average on others. Thrown here, it leaves backward().
    std::string why =
        opt.join ? "with DdpOptions.join a step takes one backward pass (expected step() after "
                   "each backward, or the earlier backward passes inside no_sync() to accumulate "
                   "gradients)"
                 : "the previous backward pass left parameter(s) without a gradient, so its "
                   "reductions could not run (expected every parameter in each backward pass, "
                   "DdpOptions.find_unused_parameters, or the earlier backward passes inside "
                   "no_sync() to accumulate gradients)";
    throw comm::Error("step " + std::to_string(step) + ": the gradient of " + describe(index) +
                      " became ready twice before step(): " + why);
  }
  pass.ready[static_cast<size_t>(index)] = 1;
  pass.order.push_back(index);
  pass.order_us.push_back(now);
  if (!opt.agg_grad) return;
  const int b = bucket_of[static_cast<size_t>(index)];
  auto& bucket = buckets[static_cast<size_t>(b)];
  if (opt.gradient_as_bucket_view) {
    adopt_gradient(index);
  } else {
    torch::NoGradGuard no_grad;
    grad_views[static_cast<size_t>(index)].copy_(params[static_cast<size_t>(index)].grad());
    bytes_copied += grad_views[static_cast<size_t>(index)].nbytes();
  }
  if (cuda) cuda->record_gradient(index);
  if (!opt.delay_reduce) {
    actors::handoff_release();  // the bucket's gradients, for its actor (actors/handoff.h)
    bucket.actor.ready(round, bucket_denominator());
  }
}

// The end of a backward pass that reached this module: its reductions are finished here, as
// PyTorch DDP finishes them before backward() returns, so that another backward pass before
// step() (a GAN's discriminator on real, then on fake images) accumulates onto the average.
// A failure is kept for step() to throw (as when step() waited): nothing is thrown out of
// backward's final callback. A pass that left parameters without a gradient (and no
// find_unused_parameters) stays open: step() names them.
void DistributedModule::Impl::on_backward_end() {
  pass.end_queued = false;
  if (!pass.started() || !round_error.empty()) return;
  if (!opt.find_unused_parameters &&
      std::find(pass.ready.begin(), pass.ready.end(), char{0}) != pass.ready.end())
    return;
  try {
    std::fill(deferred.late.begin(), deferred.late.end(), 0);
    // overlap_next_forward: the reductions go on; the next backward pass or the next forward
    // awaits them.
    if (opt.overlap_next_forward)
      launch_round();
    else
      close_round();
  } catch (const std::exception& e) {
    round_error = e.what();
  }
}

// Ends the reductions of one backward pass: launched, then awaited.
void DistributedModule::Impl::close_round() {
  launch_round();
  finish_round();
}

// Launches the reductions of one backward pass: parameters without a gradient in it are filled,
// and every bucket is told to launch (one that filled already has and ignores it). With
// overlap_next_forward the buffers are brought to rank 0's here (the next forward needs them
// before any bucket), else once the reductions are done.
void DistributedModule::Impl::launch_round() {
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      // In a later pass an unused parameter's slot holds its gradient averaged so far, which
      // reduces to itself; in the first it becomes zeros (receiving the others' gradients), and
      // becomes the gradient, whatever it was (none, or a tensor of the user's).
      if (pass.ready[i] || rounds_closed > 0) continue;
      grad_views[i].zero_();
      if (opt.gradient_as_bucket_view) point_at_slot(i);
    }
  }
  if (cuda) cuda->record_step();
  actors::handoff_release();
  const double by = bucket_denominator();
  for (auto& bucket : buckets) bucket.actor.launch(round, by);
  fault::at(FaultPhase::reduce, step);
  in_flight = true;
  in_flight_round = round++;
  if (rounds_closed++ == 0) {
    rebuild.first_order = pass.order;
    rebuild.first_order_us = pass.order_us;
  }
  pass.clear();
  if (buffers && !opt.join && opt.overlap_next_forward) buffers->broadcast(rt.comm(), 0);
}

// Awaits the launched backward pass: the averaged gradients go back to the parameters' own
// gradients (onto which the next backward pass accumulates), and the buffers to rank 0's.
void DistributedModule::Impl::finish_round() {
  const int64_t start = actors::now_us();
  in_flight = false;
  await_round(in_flight_round);
  const int64_t end = actors::now_us();
  times.waited(start, end, tracing);
  if (!opt.gradient_as_bucket_view) copy_out();
  if (buffers && !opt.join && !opt.overlap_next_forward) buffers->broadcast(rt.comm(), 0);
}

// gradient_as_bucket_view = false: the buckets' gradients into the parameters' own.
void DistributedModule::Impl::copy_out() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    auto view = buckets[static_cast<size_t>(bucket_of[i])].flat.narrow(0, offset_of[i], p.numel());
    if (p.grad().defined())
      p.mutable_grad().copy_(view.view(p.sizes()));
    else
      p.mutable_grad() = view.view(p.sizes()).clone();
  }
}

// One reduction of every bucket (numbered `round`), launched where it has not already, then
// awaited; `by` divides the sum over ranks. `fault_point`: where TROUPE_FAULT's phase=reduce
// strikes (rank/fault.h).
void DistributedModule::Impl::launch_and_await(double by, bool fault_point) {
  actors::handoff_release();
  for (auto& bucket : buckets) bucket.actor.launch(round, by);
  if (fault_point) fault::at(FaultPhase::reduce, step);
  await_round(round);
  ++round;
}

// Waits for reduction `which` of the buckets `wanted` (empty: all of them, which ends it).
void DistributedModule::Impl::await_round(uint32_t which, const std::vector<int>& wanted) {
  const auto [ok, error] = reducer.await(which, *opt.stall_timeout, wanted);
  actors::handoff_acquire();  // the buckets' reductions (actors/handoff.h)
  // The reducer's stall report ("step N stalled: not done after T ms: ...") says where each bucket
  // stands; the user also needs to know which setting gave T.
  if (!ok)
    throw comm::Error("module '" + opt.name + "': " + error +
                      (error.find(" stalled: not done after ") != std::string::npos
                           ? comm::kTimeoutSetting
                           : ""));
}

void DistributedModule::Impl::rebuild_from_observed_order(int root) {
  // The root's order (rank 0's; with join, the lowest rank that trained), completed with
  // parameters that had no gradient, becomes everyone's, and so do its ready times (microseconds
  // after its first gradient; -1 for none), which split buckets where backward paused between
  // two gradients.
  const size_t n = params.size();
  std::vector<int64_t> seen(2 * n, -1);
  if (rank == root) {
    size_t k = 0;
    std::vector<char> used(n, 0);
    for (size_t j = 0; j < rebuild.first_order.size(); ++j) {
      const int i = rebuild.first_order[j];
      seen[k++] = i;
      seen[n + static_cast<size_t>(i)] = rebuild.first_order_us[j] - rebuild.first_order_us.front();
      used[static_cast<size_t>(i)] = 1;
    }
    for (int i = static_cast<int>(n) - 1; i >= 0; --i)
      if (!used[static_cast<size_t>(i)]) seen[k++] = i;
  }
  rt.comm().broadcast(seen.data(), seen.size(), comm::DataType::int64, root);
  std::vector<int> new_order(seen.begin(), seen.begin() + static_cast<std::ptrdiff_t>(n));
  std::vector<int64_t> ready_us(seen.begin() + static_cast<std::ptrdiff_t>(n), seen.end());
  rebuild.order = new_order;
  rebuild.ready_us = ready_us;
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

// join: every rank says whether it trains this step; all learn who does.
void DistributedModule::Impl::agree_on_training(bool mine) {
  std::fill(join.training.begin(), join.training.end(), 0.0f);
  join.training[static_cast<size_t>(rank)] = mine ? 1.0f : 0.0f;
  rt.comm().allreduce(join.training.data(), join.training.size(), comm::DataType::float32,
                      comm::ReduceOp::sum);
  join.count = 0;
  for (int r = world - 1; r >= 0; --r)
    if (join.training[static_cast<size_t>(r)] > 0.5f) {
      ++join.count;
      join.lead = r;
    }
}

// The buckets divided by `denominator`; the step divides by `requested` (set_denominator after
// backward), or with join by the number of ranks training. The result is linear in
// 1/denominator for every algorithm (the error feedback memories do not depend on it) except the
// majority vote, whose result is a sign, so a factor old / new makes it what `requested` would have
// given.
double DistributedModule::Impl::rescale_factor() const {
  double want = requested;
  if (want == 0) want = opt.join && !opt.divide_by_initial_world_size ? join.count : denominator;
  const auto* sign = std::get_if<SignCompression>(&algorithm);
  if (want == denominator || !opt.average || (sign && sign->mode == SignMode::majority_vote))
    return 1;
  return denominator / want;
}

bool DistributedModule::Impl::rescale_reduced() {
  const double factor = rescale_factor();
  if (factor == 1) return false;
  for (size_t b = 0; b < buckets.size(); ++b) scale_reduced(static_cast<int>(b), factor);
  return true;
}

// Parameter i's gradient where its bucket's reduction wrote the average over it (in_place), while
// it is still there (the parameter's gradient, or held for the deferred step); undefined where
// the slot holds the average.
torch::Tensor DistributedModule::Impl::reduced_in_place(size_t i) const {
  if (!in_place[i]) return {};
  if (i < deferred.grads.size() && deferred.grads[i].defined()) return deferred.grads[i];
  const auto& grad = params[i].grad();
  if (grad.defined() && grad.data_ptr() == in_place[i]) return grad;
  return {};
}

// The reduced gradients of bucket `b` times `factor`: its buffer and those reduced in place.
void DistributedModule::Impl::scale_reduced(int b, double factor) {
  torch::NoGradGuard no_grad;
  auto& bucket = buckets[static_cast<size_t>(b)];
  bucket.flat.mul_(factor);
  for (int i : bucket.params)
    if (auto grad = reduced_in_place(static_cast<size_t>(i)); grad.defined()) grad.mul_(factor);
}

// gradient_as_bucket_view: parameter i's gradient is its slot again.
void DistributedModule::Impl::point_at_slot(size_t i) {
  params[i].mutable_grad() = grad_views[i];
  in_place[i] = nullptr;
  if (i < deferred.grads.size()) deferred.grads[i] = torch::Tensor();
}

// Whether the step in progress is followed by the bucket rebuild (the module's first step).
bool DistributedModule::Impl::rebuild_due() const {
  return step == first_step && !rebuild.loaded && opt.rebuild_buckets && opt.agg_grad &&
         opt.aggregation == Aggregation::bucket;
}

// ---- overlap_next_forward ------------------------------------------------------------------

void DistributedModule::Impl::used_before_update(int index) const {
  throw comm::Error("step " + std::to_string(step) + ": the forward used " + describe(index) +
                    " before its update from step " + std::to_string(step - 1) +
                    " (DdpOptions.overlap_next_forward: expected the model's forward to call "
                    "troupe::await_parameters(layer) before each layer)");
}

// The pre-hook of a gradient's accumulation: the step still to apply must have reached the
// parameter (its forward awaited it); what the forward did not await is stepped now, before
// backward writes into the buckets, and a gradient of one of those parameters is an error.
// A later backward pass of the same step awaits the reductions of the one before it.
void DistributedModule::Impl::before_gradient(int index) {
  const int b = bucket_of[static_cast<size_t>(index)];
  if (deferred.late[static_cast<size_t>(b)]) used_before_update(index);
  if (deferred.optimizer) {
    if (deferred.unstepped[static_cast<size_t>(b)]) used_before_update(index);
    deferred.late = deferred.unstepped;  // what the forward did not await
  }
  await_all();
}

// step(optimizer) with overlap_next_forward after the bucket rebuild: parameters the optimizer
// holds outside this module are stepped now; this module's wait for their buckets (their
// gradients are set to none until then, so the loop's zero_grad() cannot touch the buckets).
void DistributedModule::Impl::defer_step(torch::optim::Optimizer& optimizer) {
  deferred.grads.assign(params.size(), torch::Tensor());
  for (size_t i = 0; i < params.size(); ++i) {
    deferred.grads[i] = reduced_in_place(i);  // the reduction still writes into it
    params[i].mutable_grad() = torch::Tensor();
  }
  bool others = false;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params())
      others = others || (!deferred.index_of.count(p.unsafeGetTensorImpl()) && p.grad().defined());
  if (others) optimizer.step();
  deferred.optimizer = &optimizer;
  deferred.unstepped.assign(buckets.size(), 1);
  deferred.unstepped_count = buckets.size();
  deferred.late.assign(buckets.size(), 0);
  deferred.scale = rescale_factor();
  pending_steps.fetch_add(1, std::memory_order_release);
}

// Awaits the buckets `wanted` of the deferred step (all of them: the whole reduction) and steps
// their parameters.
void DistributedModule::Impl::step_buckets(const std::vector<int>& wanted) {
  if (wanted.empty() || !deferred.optimizer) return;
  const int64_t start = actors::now_us();
  const bool all = wanted.size() == deferred.unstepped_count;
  await_round(in_flight_round, all ? std::vector<int>{} : wanted);
  const int64_t end = actors::now_us();
  times.waited(start, end, tracing);
  {
    torch::NoGradGuard no_grad;
    for (int b : wanted) {
      auto& bucket = buckets[static_cast<size_t>(b)];
      if (deferred.scale != 1) scale_reduced(b, deferred.scale);
      for (size_t k = 0; k < bucket.params.size(); ++k) {
        const auto i = static_cast<size_t>(bucket.params[k]);
        auto& p = params[i];
        if (deferred.grads[i].defined())
          p.mutable_grad() = deferred.grads[i];  // reduced in place
        else if (opt.gradient_as_bucket_view)
          p.mutable_grad() = grad_views[i];
        else
          p.mutable_grad() = grad_views[i].clone();
      }
    }
  }
  masked_step(wanted);
  zero_gradients(wanted);
  for (int b : wanted) deferred.unstepped[static_cast<size_t>(b)] = 0;
  deferred.unstepped_count -= wanted.size();
  if (deferred.unstepped_count > 0) return;
  deferred.optimizer = nullptr;
  in_flight = false;
  pending_steps.fetch_sub(1, std::memory_order_release);
  // The reduction is over: what the buckets counted goes into the metrics of the step in which
  // it completed (the next one).
  deferred.completed = reduction_figures();
}

// What the buckets' last reduction sent and received and when each bucket's started and ended
// (a span each in the trace). Read once the reduction is awaited: the bucket actors write them.
StepMetrics DistributedModule::Impl::reduction_figures() {
  StepMetrics figures;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const auto& stats = *buckets[b].stats;
    figures.bytes_sent += stats.bytes_sent;
    figures.bytes_received += stats.bytes_received;
    figures.bucket_start_us.push_back(stats.ready_us);
    figures.bucket_done_us.push_back(stats.done_us);
    if (tracing)
      trace.add({"reduce bucket", static_cast<int>(b), 1, stats.ready_us,
                 stats.done_us - stats.ready_us});
  }
  return figures;
}

// The deferred optimizer's step over the parameters of `wanted` only: every other parameter it
// holds has its gradient hidden (set to none) meanwhile, and LibTorch's optimizers skip a
// parameter without a gradient.
void DistributedModule::Impl::masked_step(const std::vector<int>& wanted) {
  std::vector<char> stepped(params.size(), 0);
  for (int b : wanted)
    for (int i : buckets[static_cast<size_t>(b)].params) stepped[static_cast<size_t>(i)] = 1;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> hidden;
  for (auto& group : deferred.optimizer->param_groups())
    for (auto& p : group.params()) {
      auto it = deferred.index_of.find(p.unsafeGetTensorImpl());
      if (it != deferred.index_of.end() && stepped[static_cast<size_t>(it->second)]) continue;
      if (!p.grad().defined()) continue;
      hidden.emplace_back(p, p.grad());
      p.mutable_grad() = torch::Tensor();
    }
  struct Restore {
    std::vector<std::pair<torch::Tensor, torch::Tensor>>& hidden;
    ~Restore() {
      for (auto& [p, g] : hidden) p.mutable_grad() = g;
    }
  } restore{hidden};
  const GradientArena::Unserved optimizer_state;  // outside the gradients' arena
  deferred.optimizer->step();
}

// After a bucket's step its gradients are zero, onto which the next backward accumulates.
void DistributedModule::Impl::zero_gradients(const std::vector<int>& wanted) {
  torch::NoGradGuard no_grad;
  for (int b : wanted) {
    auto& bucket = buckets[static_cast<size_t>(b)];
    if (opt.gradient_as_bucket_view) {
      bucket.flat.zero_();
      for (int i : bucket.params)
        if (in_place[static_cast<size_t>(i)]) point_at_slot(static_cast<size_t>(i));
      continue;
    }
    for (int i : bucket.params) params[static_cast<size_t>(i)].mutable_grad().zero_();
  }
}

// await_parameters(layer): steps the buckets of parameters `indices` that wait for the deferred
// step.
void DistributedModule::Impl::await_for(const std::vector<int>& indices) {
  if (!deferred.optimizer) return;
  std::vector<int> wanted;
  for (int i : indices) {
    const int b = bucket_of[static_cast<size_t>(i)];
    if (deferred.unstepped[static_cast<size_t>(b)] &&
        std::find(wanted.begin(), wanted.end(), b) == wanted.end())
      wanted.push_back(b);
  }
  step_buckets(wanted);
}

void DistributedModule::Impl::await_all() {
  if (deferred.optimizer) {
    std::vector<int> rest;
    for (size_t k = 0; k < buckets.size(); ++k)
      if (deferred.unstepped[k]) rest.push_back(static_cast<int>(k));
    step_buckets(rest);
  } else if (in_flight) {
    finish_round();
  }
}

// agg_grad = false: the averaged weights, from the buckets into the parameters.
void DistributedModule::Impl::load_averaged_weights() {
  torch::NoGradGuard no_grad;
  for (auto& bucket : buckets)
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      auto& p = params[static_cast<size_t>(bucket.params[k])];
      p.copy_(bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes()));
    }
}

// A joined rank's part in a step of the others: zeros in every bucket (gradients, or weights
// averaged over the ranks training), the buffers, and the rebuild after step 1.
void DistributedModule::Impl::shadow_step() {
  {
    torch::NoGradGuard no_grad;
    for (auto& bucket : buckets) bucket.flat.zero_();
  }
  if (cuda) cuda->record_step();
  launch_and_await(opt.agg_grad ? bucket_denominator() : join.count);
  if (!opt.agg_grad) load_averaged_weights();
  next_step();
}

// What ends every step, trained or shadowed: buffers from the lead rank, the step count, the
// rebuild after step 1, and this step's per-step state.
void DistributedModule::Impl::next_step() {
  // agg_grad without join: each backward pass brought them (close_round).
  if (buffers && (opt.join || !opt.agg_grad)) buffers->broadcast(rt.comm(), join.lead);
  const bool first = step == first_step && !rebuild.loaded;
  ++step;
  reduced = false;
  if (first && opt.rebuild_buckets && opt.agg_grad && opt.aggregation == Aggregation::bucket)
    rebuild_from_observed_order(join.lead);
  pass.clear();
  rebuild.first_order.clear();
  rebuild.first_order_us.clear();
  rounds_closed = 0;
  times.wait_us = 0;
  times.waits.clear();
  denominator = world;
  requested = 0;
}

// The gradient hooks (Hooks), and with overlap_next_forward the registry entries through which
// await_parameters(layer) finds `owner`, this module.
void DistributedModule::Impl::install_hooks(DistributedModule* owner) {
  hooks.target = std::make_shared<std::atomic<Impl*>>(this);
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    hooks.post_keys.push_back(
        acc->add_post_hook(std::make_unique<ReadyHook<Impl>>(hooks.target, static_cast<int>(i))));
    if (opt.overlap_next_forward) {
      auto hook = std::make_unique<BeforeGradientHook<Impl>>(hooks.target, static_cast<int>(i));
      hooks.pre_keys.push_back(reinterpret_cast<uintptr_t>(hook.get()));
      acc->add_pre_hook(std::move(hook));
    }
    hooks.accumulators.push_back(std::move(acc));
  }
  if (opt.overlap_next_forward) {
    auto& registry = overlap_registry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    for (auto& p : params) registry.owner[p.unsafeGetTensorImpl()] = owner;
  }
}

// Turns the hooks off (a gradient from here on reaches no module) and takes them and the
// registry entries away.
void DistributedModule::Impl::remove_hooks() {
  hooks.target->store(nullptr);
  for (size_t i = 0; i < hooks.accumulators.size(); ++i)
    hooks.accumulators[i]->del_post_hook(hooks.post_keys[i]);
  for (size_t i = 0; i < hooks.pre_keys.size(); ++i) {
    auto& pre = hooks.accumulators[i]->pre_hooks();
    const uintptr_t key = hooks.pre_keys[i];
    pre.erase(std::remove_if(
                  pre.begin(), pre.end(),
                  [key](const auto& h) { return reinterpret_cast<uintptr_t>(h.get()) == key; }),
              pre.end());
  }
  if (opt.overlap_next_forward) {
    auto& registry = overlap_registry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    for (auto& p : params) registry.owner.erase(p.unsafeGetTensorImpl());
  }
}

DistributedModule::DistributedModule(Runtime& runtime, ModelRef model, Algorithm algorithm,
                                     DdpOptions options) {
  auto module = model.get("DistributedModule");
  if (!module) throw comm::Error("DistributedModule: module is null");
  impl_ =
      std::make_unique<Impl>(runtime, std::move(module), std::move(algorithm), std::move(options));
  auto& m = *impl_;
  m.check_options();
  if (m.opt.name.empty()) m.opt.name = m.module->name();
  m.rank = runtime.rank();
  m.world = runtime.world_size();
  if (!m.opt.trace_path.empty()) check_trace_writable(m.opt.trace_path, m.rank);
  m.key_prefix = m.id.key_prefix();
  m.denominator = m.world;
  m.tracing = !m.opt.trace_path.empty();
  m.collect_parameters();
  m.choose_path();
  m.verify_same_model();
  m.path->connect(m.path_context);  // may be collective: every rank has passed the model check
  broadcast_parameters(0);
  if (m.opt.broadcast_buffers && m.world > 1) {
    m.buffers = std::make_unique<ModuleBuffers>(*m.module);
    if (m.buffers->empty()) m.buffers.reset();
  }
  m.join.training.assign(static_cast<size_t>(m.world), 0.0f);
  m.build_buckets(m.plan({}));
  m.spawn_actors();
  m.pass.ready.assign(m.params.size(), 0);
  m.install_hooks(this);
  auto targets = m.targets;
  m.listener = runtime.add_failure_listener([targets](int rank, const std::string& reason) {
    std::lock_guard<std::mutex> lock(targets->mutex);
    for (auto& b : targets->buckets) b.abort(reason, rank);
  });
  m.times.previous_end_us = actors::now_us();
}

DistributedModule::~DistributedModule() {
  auto& m = *impl_;
  m.remove_hooks();
  // A step never applied (no await_parameters() after the last step) stays unapplied (its
  // optimizer may be gone), but its reductions still write into the buckets: they are awaited
  // before the buckets go (a failed or stalled one ends the wait; a destructor does not throw).
  if (m.deferred.optimizer) pending_steps.fetch_sub(1, std::memory_order_release);
  if (m.in_flight) {
    try {
      m.await_round(m.in_flight_round);
    } catch (const std::exception&) {
    }
  }
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
  auto& m = *impl_;
  const std::string call = "set_denominator(" + std::to_string(denominator) + ")";
  if (!(denominator > 0) || std::isinf(denominator))
    throw comm::Error(call + ": expected a finite denominator > 0");
  if (!m.opt.agg_grad)
    throw comm::Error(call +
                      " with DdpOptions.agg_grad = false (expected agg_grad = true: the "
                      "denominator divides gradients, weights are averaged by the world size)");
  if (!m.opt.average)
    throw comm::Error(call +
                      " with DdpOptions.average = false (expected average = true: "
                      "without it the gradients are summed)");
  m.requested = denominator;
  // Backward's ready messages carry `denominator`: once one is sent, step() rescales instead.
  const bool sent = (m.pass.started() && !m.opt.delay_reduce) || m.rounds_closed > 0;
  if (!sent && !m.opt.join) m.denominator = denominator;
}

void DistributedModule::join() {
  auto& m = *impl_;
  if (!m.opt.join)
    throw comm::Error(
        "DistributedModule::join() without DdpOptions.join (expected join = true "
        "on every rank: each step then tells the ranks which still train)");
  if (!m.sync)
    throw comm::Error("DistributedModule::join() called inside no_sync(): leave the scope first");
  if (m.step_begun())
    throw comm::Error("DistributedModule::join() at step " + std::to_string(m.step) +
                      " after a "
                      "backward without its step() (expected step() first)");
  for (;;) {
    m.agree_on_training(false);
    if (m.join.count == 0) break;
    m.shadow_step();
  }
  // The joined ranks did not run the optimizer: the last ranks to train hold the model.
  broadcast_parameters(m.join.lead);
}

void DistributedModule::resume_at(uint64_t step) {
  auto& m = *impl_;
  if (m.step != m.first_step || m.step_begun())
    throw comm::Error("DistributedModule::resume_at(" + std::to_string(step) + ") after step " +
                      std::to_string(m.step) + " began (expected it before the first backward)");
  if (step > UINT32_MAX)
    throw comm::Error("DistributedModule::resume_at(" + std::to_string(step) +
                      ") (expected at most " + std::to_string(UINT32_MAX) + ")");
  m.step = m.first_step = m.round = static_cast<uint32_t>(step);
}

uint64_t DistributedModule::steps() const { return impl_->step; }

void DistributedModule::step(torch::optim::Optimizer& optimizer) {
  impl_->run_step(&optimizer, [&optimizer] { optimizer.step(); });
}

void DistributedModule::step(const std::function<void()>& optimizer_step) {
  impl_->run_step(nullptr, optimizer_step);
}

void DistributedModule::await_parameters() { impl_->await_all(); }

void await_parameters(const torch::nn::Module& module) {
  if (pending_steps.load(std::memory_order_acquire) == 0) return;
  // The modules wrapping parameters of `module` (one, as a rule) and the parameters' indices.
  std::vector<std::pair<DistributedModule*, std::vector<int>>> found;
  {
    auto& registry = overlap_registry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    for (const auto& p : module.parameters(/*recurse=*/true)) {
      auto it = registry.owner.find(p.unsafeGetTensorImpl());
      if (it == registry.owner.end()) continue;
      auto at = std::find_if(found.begin(), found.end(),
                             [&](const auto& f) { return f.first == it->second; });
      if (at == found.end()) at = found.insert(found.end(), {it->second, {}});
      at->second.push_back(it->second->impl_->deferred.index_of.at(p.unsafeGetTensorImpl()));
    }
  }
  for (auto& [ddp, indices] : found) ddp->impl_->await_for(indices);
}

void DistributedModule::Impl::run_step(torch::optim::Optimizer* optimizer,
                                       const std::function<void()>& optimizer_step) {
  auto& m = *this;
  const GradientArena::Unserved optimizer_state;  // outside the gradients' arena
  m.check_step();
  if (m.opt.join) m.agree_on_training(true);
  const int64_t wait_start = actors::now_us();
  // Every backward pass that ended with all its gradients is reduced already; a pass still open
  // (parameters without a gradient, join, or no backward at all) is closed here.
  if (m.opt.agg_grad && (m.pass.started() || m.rounds_closed == 0)) m.close_open_pass();
  // overlap_next_forward after the rebuild: the buckets' parameters are stepped when the next
  // forward awaits them.
  const bool defer = m.opt.overlap_next_forward && optimizer && !m.rebuild_due();
  if (m.opt.agg_grad && !defer) {
    if (m.in_flight) m.finish_round();
    if (m.rescale_reduced() && !m.opt.gradient_as_bucket_view) m.copy_out();
  }
  const int64_t reduced = actors::now_us();
  fault::at(FaultPhase::optimizer, m.step);
  m.reduced = m.opt.agg_grad && !defer;
  if (defer) {
    m.defer_step(*optimizer);
  } else {
    optimizer_step();
    if (m.opt.overlap_next_forward) {
      std::vector<int> all(m.buckets.size());
      for (size_t b = 0; b < all.size(); ++b) all[b] = static_cast<int>(b);
      m.zero_gradients(all);
    }
  }
  if (!m.opt.agg_grad) m.average_weights();
  m.record_step(wait_start, reduced, actors::now_us(), defer);
  m.next_step();
}

void DistributedModule::Impl::check_step() const {
  if (!sync)
    throw comm::Error(
        "DistributedModule::step() called inside no_sync(): leave the scope and "
        "run one more backward first");
  if (!round_error.empty()) throw comm::Error(round_error);
  if (opt.agg_grad && !step_begun() && !opt.find_unused_parameters)
    throw comm::Error("step " + std::to_string(step) + " of module '" + opt.name +
                      "': step() without a backward pass since the previous step() (a second "
                      "step() in a row?); expected loss.backward() before each step()");
}

void DistributedModule::Impl::close_open_pass() {
  std::vector<std::string> missing;
  for (size_t i = 0; i < params.size(); ++i)
    if (!pass.ready[i]) missing.push_back(names[i]);
  if (!missing.empty() && !opt.find_unused_parameters) {
    std::string list;
    for (auto& n : missing) list += (list.empty() ? "" : ", ") + n;
    throw comm::Error("step " + std::to_string(step) +
                      ": parameter(s) without a gradient: " + list + " of module '" + opt.name +
                      "' (use DdpOptions.find_unused_parameters to reduce them as zeros)");
  }
  launch_round();
}

void DistributedModule::Impl::average_weights() {
  {
    torch::NoGradGuard no_grad;
    for (auto& bucket : buckets)
      for (size_t k = 0; k < bucket.params.size(); ++k) {
        auto& p = params[static_cast<size_t>(bucket.params[k])];
        bucket.flat.narrow(0, bucket.offsets[k], p.numel()).copy_(p.reshape({-1}));
      }
  }
  if (cuda) cuda->record_step();
  launch_and_await(opt.join ? join.count : world);
  load_averaged_weights();
}

void DistributedModule::Impl::record_step(int64_t wait_start, int64_t reduced, int64_t end,
                                          bool defer) {
  auto& m = *this;
  StepMetrics metrics;
  metrics.step = m.step;
  metrics.step_sec = static_cast<double>(end - m.times.previous_end_us) / 1e6;
  metrics.comm_wait_sec =
      static_cast<double>((m.opt.agg_grad ? m.times.wait_us : end - reduced)) / 1e6;
  metrics.backward_end_us = m.times.last_hook_us;
  // A deferred step's buckets are still reducing: it reports the reduction its forward completed.
  StepMetrics figures =
      defer ? std::exchange(m.deferred.completed, StepMetrics{}) : m.reduction_figures();
  metrics.bytes_sent = figures.bytes_sent;
  metrics.bytes_received = figures.bytes_received;
  metrics.gradient_bytes_copied = std::exchange(m.bytes_copied, 0);
  metrics.bucket_start_us = std::move(figures.bucket_start_us);
  metrics.bucket_done_us = std::move(figures.bucket_done_us);
  m.metrics = metrics;
  if (m.tracing) {
    if (m.times.last_hook_us >= m.times.previous_end_us) {
      // Forward is not observed directly: it is what runs between the end of the previous step
      // and the first gradient (forward, loss, and the last layer's backward).
      m.trace.add({"forward", -1, 0, m.times.previous_end_us,
                   m.times.first_hook_us - m.times.previous_end_us});
      m.trace.add(
          {"backward", -1, 0, m.times.first_hook_us, m.times.last_hook_us - m.times.first_hook_us});
    }
    if (m.opt.agg_grad)
      for (auto& w : m.times.waits) m.trace.add({"wait for reductions", -1, 0, w.first, w.second});
    else
      m.trace.add({"average weights", -1, 0, wait_start, end - wait_start});
  }
  m.times.previous_end_us = end;
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
  m.await_all();
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

void DistributedModule::allreduce_parameters() {
  impl_->await_all();
  average_module(impl_->rt, *impl_->module);
}

const StepMetrics& DistributedModule::last_step() const { return impl_->metrics; }

std::string DistributedModule::algorithm_name() const {
  return comm::algorithm_name(impl_->algorithm);
}

size_t DistributedModule::bucket_count() const { return impl_->buckets.size(); }

std::string DistributedModule::gradient_path() const { return impl_->path->name(); }

std::vector<std::string> DistributedModule::declined_gradient_paths() const {
  return impl_->declined;
}

std::vector<std::vector<std::string>> DistributedModule::bucket_parameters() const {
  std::vector<std::vector<std::string>> out;
  for (auto& b : impl_->buckets) {
    out.emplace_back();
    for (int p : b.params) out.back().push_back(impl_->names[static_cast<size_t>(p)]);
  }
  return out;
}

void DistributedModule::save_state(comm::StateWriter& out, StatePart part) const {
  // A deferred step's buckets hold state (error feedback) only once their reduction is done.
  impl_->await_all();
  const auto& m = *impl_;
  if (m.step_begun() && !m.reduced)
    throw comm::Error("DistributedModule::save_state at step " + std::to_string(m.step) +
                      ": a backward ran without its step() (expected a state between steps, "
                      "or inside step()'s optimizer step)");
  if (m.saved_name.empty()) m.saved_name = comm::algorithm_name(m.algorithm);
  out.string(m.saved_name);
  // Inside step()'s optimizer step the reductions are done: the state is the next step's.
  out.value<uint32_t>(m.reduced ? m.step + 1 : m.step);
  out.vector(m.rebuild.order);
  out.vector(m.rebuild.ready_us);
  out.value<uint64_t>(m.buckets.size());
  for (const auto& b : m.buckets) {
    m.bucket_scratch.clear();
    comm::StateWriter inner(m.bucket_scratch);
    if (auto* r = b.path->reduction()) {
      if (part == StatePart::all)
        r->save_state(inner);
      else
        r->save_shared_state(inner);
    }
    out.string(m.bucket_scratch);
  }
}

void DistributedModule::load_state(comm::StateReader& in, StatePart part) {
  auto& m = *impl_;
  m.await_all();
  if (m.step_begun())
    throw comm::Error("DistributedModule::load_state at step " + std::to_string(m.step) +
                      ": a backward ran without its step() (expected to load between steps)");
  const std::string name = comm::algorithm_name(m.algorithm);
  const auto saved = in.string();
  if (saved != name)
    in.fail("saved under algorithm " + saved + ", this DistributedModule runs " + name);
  const auto step = in.value<uint32_t>();
  auto order = in.vector<int>();
  auto ready_us = in.vector<int64_t>();
  if (!order.empty() && order.size() != m.params.size())
    in.fail("a bucket order of " + std::to_string(order.size()) + " parameters, the model has " +
            std::to_string(m.params.size()));
  for (int i : order)
    if (i < 0 || static_cast<size_t>(i) >= m.params.size())
      in.fail("parameter index " + std::to_string(i) + " in the bucket order (expected < " +
              std::to_string(m.params.size()) + ")");
  const auto count = in.value<uint64_t>();
  std::vector<std::string> states;
  for (uint64_t b = 0; b < count; ++b) states.push_back(in.string());
  auto layout = m.plan(order, ready_us);
  if (layout.buckets.size() != count)
    in.fail(std::to_string(count) + " buckets saved, this model and these options make " +
            std::to_string(layout.buckets.size()));
  bool same = layout.buckets.size() == m.buckets.size();
  for (size_t b = 0; same && b < m.buckets.size(); ++b)
    same = layout.buckets[b].params == m.buckets[b].params;
  if (!same) {
    m.stop_actors();
    m.build_buckets(layout);
    m.spawn_actors();
  }
  for (size_t b = 0; b < m.buckets.size(); ++b) {
    comm::StateReader bucket(states[b], "bucket " + std::to_string(b) + " of " + in.what());
    if (auto* r = m.buckets[b].path->reduction()) {
      if (part == StatePart::all)
        r->load_state(bucket);
      else
        r->load_shared_state(bucket);
    }
    bucket.expect_end();
  }
  // A rebuilt layout stays; without one (saved before the first step ended) the rebuild follows
  // the first step from here.
  m.step = m.first_step = m.round = step;
  m.rebuild.loaded = !order.empty();
  m.rebuild.order = std::move(order);
  m.rebuild.ready_us = std::move(ready_us);
}

void DistributedModule::write_trace(const std::string& path) const {
  std::ofstream out(path);
  if (!out) throw comm::Error("cannot write the trace to '" + path + "'");
  out << "{\"traceEvents\": [\n";
  const auto& events = impl_->trace;
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    out << "  {\"name\": \"" << e.name;
    if (e.bucket >= 0) out << " " << e.bucket;
    out << "\", \"ph\": \"X\", \"pid\": " << impl_->rank << ", \"tid\": " << e.tid
        << ", \"ts\": " << e.ts_us << ", \"dur\": " << e.dur_us << "}"
        << (i + 1 < events.size() ? ",\n" : "\n");
  }
  out << "]}\n";
}

}  // namespace troupe
