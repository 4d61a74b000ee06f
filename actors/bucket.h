#pragma once
/// A bucket: the actor that reduces one flat gradient buffer of a DistributedModule.
///
/// Autograd hooks send it one ready message per parameter whose gradient has been accumulated into
/// the buffer; the moment it has them all it starts its reduction (the stages of its algorithm's
/// comm::Reduction, run by an Execution that this actor drives: transport completions come back to
/// it as messages), while backward goes on with earlier layers. When the reduction ends it records its statistics and tells the reducer.
/// Buffers are raw memory here: actors/ knows nothing of tensors.
#include <caf/fwd.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/collectives/collectives.h"
#include "comm/compression/reduction.h"
#include "comm/transport/transport.h"

namespace troupe::actors {

/// The flat buffer a bucket reduces, and what fills it.
struct BucketPlan {
  int index = 0;
  void* data = nullptr;
  size_t count = 0;  // elements, padding included
  comm::DataType type = comm::DataType::float32;
  int parameters = 0;  // ready messages that fill the bucket
  std::vector<comm::TensorSlot> tensors;
};

/// How buckets reduce.
struct ReduceSettings {
  /// true: avg over ranks (or the step's denominator); false: sum.
  bool average = true;
  /// Divide before reducing instead of after (against overflow in low precision).
  bool divide_before = false;
  comm::CollectiveOptions collectives;
  /// Keys of this module's collectives: key_prefix | (step & 0xfff) << 16 | stage << 12 | bucket
  /// (so key_prefix uses bits 28-31, buckets are < 4096 and a reduction has at most 16 stages).
  uint32_t key_prefix = 0;
  /// After a failure, what is in flight with live peers gets this long before it is failed.
  std::chrono::milliseconds failure_grace{1000};
};

/// What one bucket did in one step, written by the bucket before it reports to the reducer (so the
/// trainer may read it once the reducer has answered).
struct BucketStats {
  uint32_t step = 0;
  int64_t ready_us = 0;  // all parameters ready, reduction starts (steady clock, microseconds)
  int64_t done_us = 0;
  size_t bytes_sent = 0;
  size_t bytes_received = 0;
  int ready = 0;  // ready messages counted this step
  std::vector<int> waiting_on;  // at a stall: the ranks the reduction waits for
};

/// Microseconds of the steady clock, the time base of BucketStats and traces.
int64_t now_us();

/// `reduction` is the bucket's algorithm (comm/compression/algorithms.h) over plan's buffer.
caf::actor spawn_bucket(caf::actor_system& system, BucketPlan plan, ReduceSettings settings,
                        std::shared_ptr<comm::Reduction> reduction,
                        std::shared_ptr<comm::Transport> transport, caf::actor reducer,
                        std::shared_ptr<BucketStats> stats);

}  // namespace troupe::actors
