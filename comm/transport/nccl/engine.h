#pragma once
// Internal to comm/transport/nccl/: the state behind NcclCommunicator and the thread that owns
// the NCCL communicator (engine.cpp); operation.cpp builds the operations it runs.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/transport/nccl/communicator.h"
#include "comm/transport/nccl/library.h"

namespace troupe::comm {

/// One queued operation: what to enqueue on the stream, and whom to tell.
struct NcclOperation {
  std::string name;  // "allreduce of 1000 float32 (sum)", for errors
  /// Enqueues the NCCL calls (a group where there are several); empty for an operation with
  /// nothing to do (count 0), which completes in order without touching NCCL.
  std::function<ncclResult_t(ncclComm_t, cudaStream_t)> issue;
  /// Runs once the NCCL calls are enqueued (the communicator's state is ncclSuccess again):
  /// releases what they needed (a pre-multiplied sum's operator), enqueues work after them.
  std::function<void(ncclComm_t, cudaStream_t)> after;
  ReadyEvents ready;
  Callback done;
  std::chrono::milliseconds timeout{0};  // 0: the communicator's timeout
  std::chrono::steady_clock::time_point deadline;
  /// false: complete as soon as the calls are enqueued (split: nothing runs on the stream).
  bool record = true;
  cudaEvent_t event = nullptr;
};

/// "ncclInvalidUsage: invalid usage (run with NCCL_DEBUG=WARN for details) — <last error>".
std::string nccl_error(ncclResult_t result, ncclComm_t comm = nullptr);

struct NcclCommunicator::Impl {
  Impl(int rank, int world, int device, std::chrono::milliseconds timeout, ncclComm_t comm);
  ~Impl();

  /// Queues an operation (any thread); fails it at once when the communicator is stopping or
  /// broken.
  void submit(NcclOperation op);
  /// Asks the thread to abort the communicator (any thread; returns at once).
  void request_abort(const std::string& reason);
  /// "rank 1 of 4 on device 0"
  std::string who() const;

  const int rank;
  const int world;
  const int device;
  std::atomic<int64_t> timeout_ms;
  cudaStream_t stream = nullptr;
  std::atomic<bool> aborted{false};

 private:
  void loop();
  bool idle() const;
  bool advance();
  void issue_next();
  void issued(NcclOperation op);
  void complete(NcclOperation& op, const Status& status);
  /// Aborts the NCCL communicator and fails every pending operation with `reason`.
  void fail_all(const std::string& reason);
  void teardown();

  ncclComm_t comm_ = nullptr;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<NcclOperation> queue_;  // guarded by mutex_
  std::string abort_request_;        // guarded by mutex_
  bool stop_ = false;                // guarded by mutex_
  std::string broken_;               // guarded by mutex_; written by the thread only
  // The thread's own state.
  std::deque<NcclOperation> todo_;
  std::optional<NcclOperation> enqueuing_;  // its calls answered ncclInProgress
  std::vector<NcclOperation> in_flight_;
  std::vector<cudaEvent_t> spare_events_;
  std::thread thread_;
};

/// Polls ncclCommGetAsyncError until the communicator has left ncclInProgress. Returns "" when it
/// is ready, NCCL's error otherwise, or "timeout" when `deadline` passed first.
std::string nccl_wait_ready(ncclComm_t comm, std::chrono::steady_clock::time_point deadline);

}  // namespace troupe::comm
