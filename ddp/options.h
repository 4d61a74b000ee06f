#pragma once
/// DdpOptions: how a DistributedModule (ddp/distributed_module.h) groups, reduces and steps its
/// gradients, and the bucket algorithms it runs. Its own header so that the bucket layout
/// (ddp/bucket_layout.h) reads the options without the module.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/compression/algorithms.h"

namespace troupe {

// The algorithms of the gradient buckets (comm/compression/algorithms.h says what each does).
using comm::ByteGrad;
using comm::GradientAllReduce;
using comm::HalfPrecision;
using comm::Int4Quantization;
using comm::PowerSGD;
using comm::SignCompression;
using comm::SignMode;
using comm::SparseMode;
using comm::Sparsification;
/// What a DistributedModule runs on its buckets: GradientAllReduce{} (the default),
/// HalfPrecision{}, ByteGrad{}, Int4Quantization{}, SignCompression{}, Sparsification{},
/// PowerSGD{.rank = 2}.
using Algorithm = comm::Compression;

/// How gradients (or weights) are grouped into reductions (mlbench-core's by-layer / by-model).
enum class Aggregation {
  bucket,  // flat buckets of about bucket_bytes (PyTorch DDP, Bagua)
  layer,   // one reduction per parameter tensor
  model,   // one flat reduction for the whole model (per dtype)
};

/// Options of a DistributedModule; defaults follow PyTorch DDP.
struct DdpOptions {
  /// What errors call this module where a program wraps several ("the gradient of parameter
  /// 'fc.weight' of module 'discriminator'"). Empty: the module's C++ type (Module::name()).
  std::string name;
  size_t bucket_bytes = 25u << 20;
  size_t first_bucket_bytes = 1u << 20;
  /// Each parameter starts at a multiple of this many bytes inside its bucket.
  size_t align_bytes = 64;
  Aggregation aggregation = Aggregation::bucket;
  /// true: reduce gradients, then step. false: step locally, then average the weights (optimizer
  /// state stays local).
  bool agg_grad = true;
  /// true: average (divide by the world size, or by set_denominator's value); false: sum.
  bool average = true;
  /// Divide before reducing rather than after (against overflow in low precision).
  bool divide_before = false;
  /// Reduce everything after backward instead of overlapping (for comparison).
  bool delay_reduce = false;
  /// Parameters without a gradient in a step are reduced as zeros instead of being an error.
  bool find_unused_parameters = false;
  /// Gradients are views into the buckets (no copy; PyTorch's default is false); false copies
  /// them in and out. Gradients set to none are supported either way (see above).
  bool gradient_as_bucket_view = true;
  /// After step 1, rebuild buckets in the observed gradient-ready order.
  bool rebuild_buckets = true;
  /// With the rebuild, a bucket holding at least min(first_bucket_bytes, 64 KiB) also closes
  /// before a gradient that became ready (in step 1) more than this after the bucket's previous
  /// one, so it reduces while backward computes the layers in between (ddp/bucket_layout.h).
  /// Zero: sizes alone decide.
  std::chrono::microseconds bucket_split_gap{1000};
  /// Multi-host jobs: GradientAllReduce buckets reduce inside each host to a leader, allreduce
  /// across the leaders, and broadcast inside the host (comm/collectives/collectives.h), with the
  /// ranks grouped by the host names of the rendezvous. No effect on one host, on one rank per
  /// host, or on the compressed algorithms.
  bool hierarchical = false;
  /// CUDA parameters: reduce through pinned host memory and the job's transport even where NCCL
  /// is available (ddp/gradient_path/host_staging.cpp). Every rank must agree (the model check
  /// compares the path).
  /// Compressed algorithms always stage; CPU parameters ignore it.
  bool stage_through_host = false;
  /// CPU buckets of a job whose ranks are all on one host are reduced through shared memory
  /// (comm/shm/local_allreduce.h: the buckets live in a segment every rank maps; each rank sums
  /// its share of a bucket straight from the others' memory and writes the result into all of
  /// them) instead of through the transport, which copies every byte into and out of its queues
  /// as well. Only for GradientAllReduce. Every rank must agree (the model check compares it).
  bool shared_memory = true;
  /// With shared_memory and gradient_as_bucket_view: the CPU allocations of this rank's trainer
  /// thread that have a gradient's size come from shared memory (ddp/gradient_arena.h), so that
  /// a gradient set to none and allocated anew by backward is read where autograd put it instead
  /// of being copied into its bucket first. Installs a CPU allocator for the process that serves
  /// those sizes from the arena and passes every other allocation to LibTorch's. Ranks may differ.
  bool gradients_in_shared_memory = true;
  /// A step whose reductions are not done after this long fails with a report of which bucket
  /// waits for which ranks; so does each reduction a path runs (shared memory's, NCCL's, host
  /// staging's copies). Unset: the Runtime's collective timeout (RuntimeOptions), as PyTorch's
  /// DDP reduces under its process group's timeout.
  std::optional<std::chrono::milliseconds> stall_timeout;
  /// At the end of each backward pass that reaches the module (with join or agg_grad = false: of
  /// each step, after the optimizer), copy the module's buffers from rank 0 to every rank, one
  /// flat broadcast per dtype (none when the module has no buffers), so that the next forward
  /// sees rank 0's running statistics (see above for how this compares with PyTorch's broadcast
  /// at the start of each forward). With join, the lowest rank still training is the source.
  /// false: each rank keeps its own (PyTorch's broadcast_buffers=False).
  bool broadcast_buffers = true;
  /// The step's communication goes on while the next forward runs: backward returns once its
  /// reductions are launched, step(optimizer) returns at once, and each bucket's parameters are
  /// stepped when the next forward first needs them, which the model's forward says by calling
  /// troupe::await_parameters(layer) before each layer (LibTorch's C++ modules have no forward
  /// pre-hooks). A gradient of the next backward whose parameter was not awaited is an error
  /// naming it. The first step (before the bucket rebuild) is an ordinary one. Needs agg_grad,
  /// CPU parameters, step(torch::optim::Optimizer&) (an optimizer that steps a parameter only
  /// when it has a gradient, as LibTorch's do: a bucket's step hides the others' gradients) and
  /// no join. After each parameter's step its gradient is zeroed, so the zero_grad() of the loop
  /// is harmless but not needed; after the last step, DistributedModule::await_parameters()
  /// brings the final update before the model is saved or the optimizer goes.
  bool overlap_next_forward = false;
  /// Uneven inputs: ranks may take different numbers of steps, each calling join() after its last
  /// (PyTorch's Join around DDP). Each step then starts with a small allreduce (one flag per rank)
  /// by which every rank learns which ranks still train; nothing of it runs without this option.
  /// Every rank must agree (the model check compares it).
  bool join = false;
  /// With join: the reduced gradient is the sum over the ranks still training divided by the
  /// world size, a joined rank counting as a zero gradient (PyTorch's default,
  /// divide_by_initial_world_size=True); false: divided by the number of ranks still training.
  /// A denominator from set_denominator() takes precedence over both. Weights (agg_grad = false)
  /// are always averaged over the ranks still training.
  bool divide_by_initial_world_size = true;
  /// When set, a Chrome trace (Perfetto) of this rank is written here at destruction; "{rank}" is
  /// replaced by the rank. Spans: forward (end of the previous step to the first gradient),
  /// backward (first to last gradient), the wait in step(), and each bucket's reduction. The
  /// trace keeps the last 65,536 spans (about 12,000 steps of a 3-bucket model); without a path,
  /// no span is recorded.
  /// A path that cannot be written is an error at construction (comm::Error naming it).
  std::string trace_path;
};

}  // namespace troupe
