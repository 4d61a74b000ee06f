#pragma once
/// Reduction: what a bucket runs on its flat gradient buffer each step, and the state it keeps
/// across steps (error-feedback memory, PowerSGD's Q).
///
/// A reduction is a chain of stages (schedule.h): each stage does local work (compress, decompress,
/// orthogonalise) and returns the collective that follows it. The bucket actor runs the stages
/// with an Execution while backward goes on. Every rank ends with the same values in the buffer:
/// the sum over ranks of what each rank sent (after compression), times ReduceStep::scale.
///
/// One Reduction per bucket, created by make_reduction (algorithms.h); it is used by one thread at
/// a time. Buffers a later stage reads must live in the reduction, not in a stage's Schedule
/// (a stage's scratch is freed when the next stage starts).
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/collectives/collectives.h"
#include "comm/state.h"
#include "comm/types.h"

namespace troupe::comm {

/// One tensor inside a bucket's flat buffer. Low-rank methods view it as a rows x (count / rows)
/// matrix (a tensor of shape [n, ...] as n x numel/n, as PyTorch's PowerSGD hook does); a 1-D
/// tensor has rows == 1.
struct TensorSlot {
  size_t offset = 0;  // elements from the start of the bucket
  size_t count = 0;
  size_t rows = 1;
  size_t cols() const { return rows ? count / rows : 0; }
};

/// The buffer a reduction works on. Elements outside every tensor are padding: their values after
/// a reduction are unspecified.
struct BucketBuffer {
  int index = 0;
  void* data = nullptr;
  size_t count = 0;
  DataType type = DataType::float32;
  std::vector<TensorSlot> tensors;
};

/// The inputs of one step's reduction.
struct ReduceStep {
  Group group{0, 1};
  /// The training step, counted from 0 (shared seeds, PowerSGD's start_iter).
  uint32_t step = 0;
  /// The sum over ranks is multiplied by this: 1 / world size (average), 1 / a denominator, or 1.
  double scale = 1.0;
  /// Apply `scale` before reducing instead of after (against overflow in low precision).
  bool divide_before = false;
  CollectiveOptions collectives;
};

class Reduction {
 public:
  virtual ~Reduction() = default;
  /// "allreduce", "fp16", "powersgd(rank 2)", ... for messages and traces.
  virtual std::string name() const = 0;
  /// The stages of this step's reduction of the bucket, in order.
  virtual std::vector<std::function<Schedule()>> stages(const ReduceStep& step) = 0;
  /// This rank's values of tensor `tensor` for the next stages() lie at `data` (of the bucket's
  /// type, the tensor's count), not in the bucket: a gradient autograd allocated. A reduction
  /// that can read them there returns true; it then writes the tensor's result into the bucket as
  /// ever, and the bucket's bytes of that tensor are unspecified until then. The caller keeps
  /// `data` unchanged until that step's stages have ended. By default false: the caller copies
  /// the values into the bucket. Called between steps; holds for the next stages() only.
  virtual bool take_input(size_t tensor, const void* data) {
    (void)tensor;
    (void)data;
    return false;
  }
  /// The state kept across steps (error feedback, momentum, Q), for checkpoints and healing a
  /// rank; nothing by default. Called between steps, never while stages run.
  virtual void save_state(StateWriter& out) const { (void)out; }
  /// Restores what save_state wrote for the same algorithm over the same bucket. Reads and checks
  /// everything before changing anything: a state of other sizes throws comm::Error (via `in`).
  virtual void load_state(StateReader& in) { (void)in; }
  /// The part of the state every rank holds equal after a step (PowerSGD's Qs), which a
  /// restarted rank takes from a peer; the rest (error feedback, momentum correction) is this
  /// rank's own. Nothing by default.
  virtual void save_shared_state(StateWriter& out) const { (void)out; }
  /// Restores what save_shared_state wrote, leaving the rank's own state as it is.
  virtual void load_shared_state(StateReader& in) { (void)in; }
};

}  // namespace troupe::comm
