#pragma once
/// A bucket: the actor that reduces one flat gradient buffer of a DistributedModule.
///
/// Autograd hooks send it one ready message per parameter whose gradient has been accumulated into
/// the buffer; the moment it has them all it starts its reduction (the stages of its algorithm's
/// comm::Reduction, run by an Execution that this actor drives: transport completions come back to
/// it as messages), while backward goes on with earlier layers. When the reduction ends it records
/// its statistics and tells the reducer.
/// Buffers are raw memory here: actors/ knows nothing of tensors.
///
/// A bucket of CUDA gradients is reduced one of two ways. With NCCL (`BucketPlan::nccl`): an NCCL
/// allreduce on the communicator's stream, after the events recorded where its gradients were
/// ready; the communicator's completion callback reports to the reducer. Without
/// (`BucketPlan::staging`): through a pinned host mirror (actors/staging.h), the usual execution
/// running on the mirror between a copy to the host and a copy back.
///
/// A CPU bucket of a job whose ranks all share one host (`BucketPlan::local`) is reduced by the
/// module's comm::LocalAllreduce: straight from and into every rank's shared memory.
#include <caf/fwd.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/collectives/collectives.h"
#include "comm/compression/reduction.h"
#include "comm/transport/transport.h"

namespace troupe::comm {
class NcclCommunicator;  // comm/transport/nccl/communicator.h (built with NCCL only)
class LocalAllreduce;    // comm/shm/local_allreduce.h
}  // namespace troupe::comm

namespace troupe::actors {

class HostStaging;  // actors/staging.h (built with CUDA only)

/// Issues the NCCL reductions of a module's buckets in bucket order, whatever order they fill in:
/// NCCL matches operations by the order ranks issue them, and buckets fill in different orders on
/// different ranks. Every bucket submits once per step.
class NcclOrder {
 public:
  explicit NcclOrder(int buckets) : buckets_(buckets) {}
  /// Runs `issue` (on this thread, or later on the thread that submits the bucket before it) once
  /// every bucket before `index` has been issued in this round.
  void submit(int index, std::function<void()> issue);
  /// After a failure: runs whatever waits, and from now on everything at once (the communicator
  /// is aborted, so the operations fail at once instead of waiting for their turn).
  void release();

 private:
  std::mutex mutex_;
  int buckets_;
  int next_ = 0;
  bool released_ = false;
  std::map<int, std::function<void()>> waiting_;
};

/// The flat buffer a bucket reduces, and what fills it.
struct BucketPlan {
  int index = 0;
  void* data = nullptr;  // host memory (a CPU bucket, or a staged bucket's mirror) or device memory
  size_t count = 0;  // elements, padding included
  comm::DataType type = comm::DataType::float32;
  int parameters = 0;  // ready messages that fill the bucket
  std::vector<comm::TensorSlot> tensors;
  /// CUDA buckets: events (cudaEvent_t) recorded where the bucket's gradients were ready and where
  /// step() last touched the buckets; the reduction's device work waits for all of them.
  std::vector<void*> ready_events;
  /// CUDA buckets with NCCL: the module's communicator (data is device memory) and the order in
  /// which its buckets issue. Weak: the module owns the communicator and destroys it.
  std::weak_ptr<comm::NcclCommunicator> nccl;
  std::shared_ptr<NcclOrder> nccl_order;
  /// CUDA buckets without NCCL: the pinned mirror (data is its host memory).
  std::shared_ptr<HostStaging> staging;
  /// CPU buckets of a job whose ranks share one host: the module's LocalAllreduce, whose shared
  /// region holds data at byte `local_offset` (the same on every rank). The bucket's index is its
  /// slot. The bucket is then reduced through shared memory; its Reduction is not used.
  std::shared_ptr<comm::LocalAllreduce> local;
  size_t local_offset = 0;
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
  /// CUDA buckets: the deadline of each copy to or from the host mirror.
  std::chrono::milliseconds device_timeout{60000};
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
