#pragma once
/// DistributedModule: data parallelism for a LibTorch module, with bucket reductions that overlap
/// backward (what PyTorch's DistributedDataParallel is to Python).
///
/// ```cpp
/// troupe::Runtime rt;
/// auto net = std::make_shared<Net>();
/// torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
/// troupe::DistributedModule ddp(rt, net, troupe::GradientAllReduce{});
/// for (auto& batch : *loader) {
///   opt.zero_grad();
///   auto loss = torch::nll_loss(net->forward(batch.data), batch.target);
///   loss.backward();   // buckets reduce while backward runs
///   ddp.step(opt);     // waits for what is in flight, then steps
/// }
/// ```
/// Construction checks that every rank wraps the same model (names, shapes, dtypes), broadcasts
/// parameters and buffers from rank 0, and cuts the gradients into buckets: flat buffers of about
/// `bucket_bytes` (the first `first_bucket_bytes`), parameters in reverse definition order (the
/// order backward produces them), one dtype each; gradients are views into them. A post-hook on
/// each parameter's gradient accumulator tells its bucket actor (actors/bucket.h) when the gradient
/// is ready; a full bucket starts its allreduce at once. After step 1 the buckets are rebuilt in
/// the gradient-ready order that rank 0 observed, the same on every rank, and split where backward
/// paused between two gradients (`bucket_split_gap`).
///
/// Gradients are views into the buckets by default (DdpOptions::gradient_as_bucket_view; PyTorch's
/// default is off). Zeroing them in place (LibTorch 1.13's Optimizer::zero_grad()) keeps them
/// there; setting them to none (Module::zero_grad(true), LibTorch >= 2.0's Optimizer::zero_grad())
/// or replacing them works too, at the price of one copy per parameter and step: the hook copies
/// the gradient backward allocated into the parameter's bucket slot and points the gradient back
/// at the slot, as PyTorch DDP does. Unlike PyTorch, a parameter without a gradient in a step
/// (find_unused_parameters) always gets its slot as gradient, zeros where no rank used it, so
/// optimizers with weight decay or momentum still step it.
///
/// One wrapper per module: a DistributedModule, DecentralizedModule or AsynchronousModule over a
/// module (or a submodule) that a live one wraps throws comm::Error naming the module and the
/// parameter (ddp/wrapped_modules.h).
///
/// Several backward passes per step (a GAN's discriminator on real, then on fake images; a
/// generator's backward that passes through the discriminator) work as in PyTorch DDP: each
/// backward pass that reaches the module is averaged over the ranks, its reductions overlapping
/// it and finished before backward() returns (the wait that step() does for a single pass), and
/// the next pass accumulates onto the averaged gradients, so that after passes 1..k each gradient
/// is the sum over passes of the mean over ranks. Every rank must run the same number of passes;
/// a pass must give every parameter a gradient unless find_unused_parameters (a parameter it
/// does not reach keeps the average so far); the compressed algorithms compress each pass's
/// accumulated gradient, as a DDP communication hook would. With DdpOptions::join a step takes
/// one backward pass. To accumulate without communicating, run the earlier passes inside
/// no_sync() (a guard: keep it in a variable). With agg_grad = false gradients stay local and may
/// accumulate.
///
/// CUDA parameters (all on one device) get CUDA buckets, reduced with NCCL where the Runtime has
/// it, else through pinned host memory (ddp/gradient_path.h says which and how).
///
/// Buffers (BatchNorm's running statistics, any registered buffer) are copied from rank 0 to every
/// rank at the end of each backward pass that reaches the module (`broadcast_buffers`, on by
/// default; with join or agg_grad = false, at the end of each step). PyTorch DDP copies them at
/// the start of each forward instead; a forward followed by its backward sees the same buffers
/// either way, and here the ranks also agree after the last backward (DDP's ranks other than 0
/// keep their own last forward's update). A forward that no backward follows (under NoGradGuard
/// in training mode) changes this rank's buffers until the next backward; an evaluation in eval()
/// mode does not change them. Ranks with different numbers of batches set
/// `DdpOptions::join` and call `join()` after their last step (PyTorch's `Join`):
///
/// ```cpp
/// troupe::DdpOptions options;
/// options.join = true;
/// troupe::DistributedModule ddp(rt, net, troupe::GradientAllReduce{}, options);
/// for (auto& batch : *my_shard) { ...; loss.backward(); ddp.step(opt); }
/// ddp.join();  // shadows the others' steps with zero gradients until every rank has joined
/// ```
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/compression/algorithms.h"
#include "ddp/data_parallel.h"
#include "ddp/options.h"
#include "rank/module_holder.h"
#include "rank/runtime.h"

namespace troupe {

/// What the last step did, on this rank. With DdpOptions::overlap_next_forward a step's
/// reduction completes during the next step: the bytes and bucket times are then those of the
/// reduction that completed during this step (the previous step's), and comm_wait_sec is what
/// this step's forward and backward waited for it.
struct StepMetrics {
  uint64_t step = 0;
  double step_sec = 0;       // from the first gradient hook (or the previous step) to the end
  double comm_wait_sec = 0;  // waiting for reductions after backward (at its end, in step())
  size_t bytes_sent = 0;
  size_t bytes_received = 0;
  /// Bytes of gradients that autograd put outside their bucket slot (set to none, replaced) and
  /// this rank copied into the slot; a gradient the path reads where it lies (the shared-memory
  /// path's arena, ddp/gradient_arena.h) is not copied.
  size_t gradient_bytes_copied = 0;
  int64_t backward_end_us = 0;           // last gradient hook (steady clock, microseconds)
  std::vector<int64_t> bucket_start_us;  // each bucket's reduction start, by bucket
  std::vector<int64_t> bucket_done_us;
};

/// Waits until `module`'s parameters hold their update from the last step of the
/// DistributedModule that wraps them with DdpOptions::overlap_next_forward (waiting for the
/// buckets that hold them, then stepping those): call it in a forward before each layer. Returns
/// at once where no such step is pending, so a model that calls it runs unchanged without troupe.
void await_parameters(const torch::nn::Module& module);
/// The same for a ModuleHolder (`await_parameters(conv1)` for a torch::nn::Conv2d).
template <typename Contained>
void await_parameters(const torch::nn::ModuleHolder<Contained>& module) {
  await_parameters(*module);
}

class DistributedModule {
 public:
  /// `module`: a shared_ptr or a ModuleHolder (TORCH_MODULE(Net)'s Net, torch::nn::Linear, ...;
  /// rank/module_holder.h). Compressed algorithms need agg_grad (they compress gradients) and
  /// float32 parameters.
  DistributedModule(Runtime& runtime, ModelRef module, Algorithm algorithm = GradientAllReduce{},
                    DdpOptions options = {});
  ~DistributedModule();
  DistributedModule(const DistributedModule&) = delete;
  DistributedModule& operator=(const DistributedModule&) = delete;

  /// Waits for the step's reductions (with the stall deadline), then runs `optimizer.step()`
  /// (agg_grad), or steps and then averages the weights (!agg_grad). Throws comm::Error naming
  /// parameters without gradient, a failed bucket and the rank, a stall, or a step() with no
  /// backward since the previous one (a second step() in a row).
  void step(torch::optim::Optimizer& optimizer);
  /// The same with any step in place of `optimizer.step()` (clip then step, unscale then step).
  void step(const std::function<void()>& optimizer_step);
  /// With DdpOptions::overlap_next_forward: waits for every reduction still in flight and steps
  /// the parameters they belong to (what the next forward's await_parameters() calls would do).
  /// Nothing to do otherwise.
  void await_parameters();
  /// The denominator of this step's average (default: world size), e.g. the global number of
  /// samples; the same on every rank. Takes effect whenever it is called before step(): after
  /// backward has launched reductions, step() rescales the reduced gradients by old / new (exact
  /// up to rounding, divide_before included). Must be finite and > 0; refused with agg_grad =
  /// false (weights are averaged by the world size) or average = false (gradients are summed).
  /// SignCompression's majority vote ignores it (the result is a sign). Reset after each step.
  void set_denominator(double denominator);
  /// With DdpOptions::join: call after this rank's last step. Until every rank has joined, takes
  /// part in each step of the ranks still training with zero gradients (and, with agg_grad =
  /// false, zero weights, averaging over the ranks still training), and receives their buffers;
  /// then copies the parameters and buffers of the lowest of the ranks that joined last to every
  /// rank, so all ranks end equal. The optimizer is not run while joined: a joined rank's
  /// optimizer state (momentum) stays as it was. Each step of the others must come within the
  /// Runtime's collective timeout. Training may go on afterwards (a next epoch, then join()
  /// again). Throws inside no_sync(), after a backward without its step(), or without the option.
  void join();

  /// Inside this scope backward accumulates gradients locally and reduces nothing (gradient
  /// accumulation); the first backward after it reduces the accumulated gradients. A guard: it
  /// holds while the returned object lives (`auto guard = ddp.no_sync();`), so a discarded result
  /// is a compile warning.
  class [[nodiscard("no_sync() holds only while its guard lives: keep it in a variable")]] NoSync {
   public:
    explicit NoSync(DistributedModule * module);
    ~NoSync();
    NoSync(NoSync && other) noexcept;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedModule* module_;
  };
  [[nodiscard("no_sync() holds only while its guard lives: keep it in a variable")]] NoSync
  no_sync();

  /// Copies rank `root`'s parameters and buffers to every rank.
  void broadcast_parameters(int root = 0);
  /// Averages parameters and buffers (floating point) over all ranks.
  void allreduce_parameters();

  /// Numbers the next step `step` instead of 0 (a job re-formed by an elastic membership change,
  /// or resumed, continues its count; fault injection, rank/fault.h, reads it). Call before
  /// the first backward; the bucket rebuild still follows this module's first step.
  void resume_at(uint64_t step);
  /// The number of the next step (steps completed, counting from resume_at's).
  uint64_t steps() const;

  const StepMetrics& last_step() const;
  /// The algorithm's name and main setting ("allreduce", "powersgd(rank=2)", ...).
  std::string algorithm_name() const;
  size_t bucket_count() const;
  /// How the gradients are reduced: "cpu" (through the transport), "cpu via shared memory"
  /// (DdpOptions::shared_memory), "cuda via nccl" or "cuda via host staging": the first gradient
  /// path (ddp/gradient_path.h) that could serve this module.
  std::string gradient_path() const;
  /// Why the paths tried before it declined, in order ("cuda via nccl: the parameters are on the
  /// CPU").
  std::vector<std::string> declined_gradient_paths() const;
  /// The names of the parameters of each bucket, in bucket order.
  std::vector<std::vector<std::string>> bucket_parameters() const;
  /// The state this module keeps across steps, for checkpoints (rank/checkpoint.h) and for
  /// healing a rank: the step counter, the bucket layout (after the rebuild) and each bucket's
  /// algorithm state (error feedback, momentum correction, PowerSGD's Qs), or with
  /// StatePart::shared only what every rank holds equal. Not the parameters or the optimizer.
  /// Call between steps (not after a backward without its step()), or inside step()'s optimizer
  /// step, where the reductions are done and the state saved is the next step's.
  void save_state(comm::StateWriter& out, StatePart part = StatePart::all) const;
  /// Restores what save_state wrote (with the same `part`) on a module of the same model,
  /// algorithm and options: the buckets are rebuilt in the saved layout (dropping the state of
  /// the layout they had), then each takes its state; the step numbering goes on from the saved
  /// step, and a rebuilt layout is not rebuilt again after it. Local (no collective). Throws
  /// comm::Error naming the difference (algorithm, layout, a bucket's sizes).
  void load_state(comm::StateReader& in, StatePart part = StatePart::all);
  /// Writes the Chrome trace recorded so far to `path` (empty unless DdpOptions::trace_path is
  /// set).
  void write_trace(const std::string& path) const;

 private:
  friend void await_parameters(const torch::nn::Module& module);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe
