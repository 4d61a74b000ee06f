#pragma once
/// NcclCommunicator: collectives on CUDA buffers with NCCL, for the ranks of a job whose tensors
/// live on GPUs. Built only where CUDA and NCCL are found (TROUPE_HAVE_NCCL).
///
/// Not a comm::Transport: NCCL has no tags, it matches operations by the order in which ranks
/// issue them. So, as with comm::Communicator, **every rank must issue the same operations in the
/// same order** (DistributedModule issues its buckets in bucket order for that reason).
///
/// Every operation is non-blocking, like a Transport's: it is queued with a completion callback
/// and returns. One thread per communicator owns the NCCL communicator (NCCL communicators are
/// not thread-safe) and one dedicated CUDA stream: for each operation, in queue order, it makes
/// the stream wait on the caller's "ready" events (CUDA events recorded where the inputs were
/// produced, e.g. on torch's stream when a gradient was accumulated), enqueues the NCCL call
/// (the communicator is non-blocking: a call that answers ncclInProgress is polled with
/// ncclCommGetAsyncError before anything else touches the communicator or the stream), and
/// records a completion event. It then polls the pending completion events (cudaEventQuery) and
/// the communicator's asynchronous error, and calls each operation's callback once its event has
/// completed: the results are then in device memory, visible to any stream.
///
/// Deadlines: an operation that has not completed `timeout` after it was queued aborts the
/// communicator (ncclCommAbort) and fails with an error naming the operation and the timeout;
/// every other pending operation fails too, and so does every later one (a job whose NCCL
/// communicator broke cannot go on with it). An asynchronous NCCL error (a peer died, a network
/// failure) does the same, naming NCCL's error.
///
/// Bad arguments (a null buffer, a host buffer, a peer or root outside the world, an unknown type
/// or operator) throw comm::Error at the call, naming the argument, its value and what was
/// expected; nothing is queued then. Callbacks run on the communicator's thread; they must be
/// short and must not block (sending a message, posting work is fine; queuing another operation
/// too).
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport/transport.h"
#include "comm/types.h"

namespace troupe::comm {

/// CUDA events (cudaEvent_t as void*) that an operation's stream waits for before it starts.
using ReadyEvents = std::vector<void*>;

class NcclCommunicator {
 public:
  /// Bytes of an NCCL unique id.
  static constexpr size_t kUniqueIdBytes = 128;
  /// NCCL versions as NCCL_VERSION_CODE numbers them (2.28.3 is 22803): that of the nccl.h troupe
  /// was compiled with, and that of the libnccl.so.2 this process loaded (ncclGetVersion). A
  /// process holds one libnccl.so.2, whoever loaded it first (torch's wheel brings its own).
  static int compiled_version();
  static int loaded_version();
  /// "" when troupe compiled against NCCL `compiled` can run with the loaded NCCL `loaded` (the
  /// same or newer: NCCL keeps its ABI); otherwise why not, naming both versions — an older
  /// library may lack calls troupe makes. unique_id() and the constructor throw it as comm::Error.
  static std::string version_mismatch(int compiled, int loaded);
  /// A new NCCL unique id (ncclGetUniqueId: it opens rank 0's bootstrap socket), as bytes to hand
  /// to every rank. Throws comm::Error naming NCCL's error.
  static std::string unique_id();

  /// Creates this rank's member of the communicator named by `unique_id` (every rank passes the
  /// same id, its own rank and the same world size) on CUDA device `device`, in NCCL's
  /// non-blocking mode. Waits until every rank has joined; after `timeout` it aborts and throws
  /// comm::Error naming rank, world size and timeout. `timeout` is also each operation's deadline.
  NcclCommunicator(int rank, int world_size, const std::string& unique_id, int device,
                   std::chrono::milliseconds timeout);
  /// Lets operations in flight finish (up to their deadlines) and fails those not started yet;
  /// then finalizes the communicator (aborting it when that does not end within the timeout).
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const;
  int world_size() const;
  int device() const;
  /// The dedicated stream (a cudaStream_t) every operation runs on.
  void* stream() const;
  std::chrono::milliseconds timeout() const;
  void set_timeout(std::chrono::milliseconds timeout);

  /// out := op over all ranks of in (count elements; out may be in). avg divides by the world
  /// size (ncclAvg for float types; integer types sum, then divide truncating toward zero, as
  /// comm::ReduceOp::avg does on the CPU).
  void allreduce(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                 const ReadyEvents& ready, Callback done);
  /// out := sum over all ranks of scale * in (NCCL's pre-multiplied sum; float types only): an
  /// average by any denominator, divided before the sum.
  void allreduce_scaled(const void* in, void* out, size_t count, DataType type, double scale,
                        const ReadyEvents& ready, Callback done);
  /// data := root's data on every rank.
  void broadcast(void* data, size_t count, DataType type, int root, const ReadyEvents& ready,
                 Callback done);
  /// out (world_size * count_per_rank elements) := every rank's in, in rank order.
  void allgather(const void* in, void* out, size_t count_per_rank, DataType type,
                 const ReadyEvents& ready, Callback done);
  /// out (count_per_rank elements) := block `rank` of op over all ranks of in (world_size *
  /// count_per_rank elements). Unlike comm::reduce_scatter_schedule, blocks are of equal size.
  void reduce_scatter(const void* in, void* out, size_t count_per_rank, DataType type, ReduceOp op,
                      const ReadyEvents& ready, Callback done);
  /// Block j of out := block `rank` of rank j's in; blocks of count_per_rank elements (one group
  /// of sends and receives).
  void alltoall(const void* in, void* out, size_t count_per_rank, DataType type,
                const ReadyEvents& ready, Callback done);
  /// A gossip round in one group of sends and receives: `send` (count elements) to every peer of
  /// send_to, and from each peer recv_from[i] count elements into recv_buffers[i]. Peers are
  /// distinct from this rank and from each other within each list; every peer must post the
  /// matching operations in the same round. Unlike comm::NeighborExchange, a failing peer fails
  /// the round (and the communicator): NCCL cannot drop one peer of a group.
  void exchange(const void* send, size_t count, DataType type, const std::vector<int>& send_to,
                const std::vector<int>& recv_from, const std::vector<void*>& recv_buffers,
                const ReadyEvents& ready, Callback done);

  /// A new communicator of the same ranks (ncclCommSplit): collective, issued in order like an
  /// operation. Blocks until it is ready; throws comm::Error after `timeout`.
  std::unique_ptr<NcclCommunicator> split(std::chrono::milliseconds timeout);

  /// Aborts the communicator from any thread: every pending and later operation fails with
  /// `reason`. Returns at once (the communicator's thread does the abort).
  void abort(const std::string& reason);
  /// True once the communicator has been aborted (by abort(), a deadline or an NCCL error).
  bool aborted() const;

  struct Impl;

 private:
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::comm
