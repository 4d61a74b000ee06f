#pragma once
/// Communicator: blocking collectives over one Transport, for code that may wait (tests,
/// benchmarks, the rendezvous barrier, a trainer's own thread).
///
/// Every rank must call the same collectives in the same order: each call takes the next key from
/// a counter, and keys name the messages on the wire. Every call has a deadline; when it expires
/// the call throws comm::Error naming the collective and the ranks it was waiting for. A failure
/// of a peer (Transport::fail_peer) ends the call with an error naming that rank.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/collectives/collectives.h"
#include "comm/collectives/driver.h"

namespace troupe::comm {

class LocalAllreduce;

/// Keys at or above this value are never taken by a Communicator: code that names its own
/// collectives (e.g. one key per (module, step, bucket)) uses them.
constexpr uint32_t kFirstUserKey = tags::module_prefix(1);  // comm/tags.h

class Communicator {
 public:
  explicit Communicator(std::shared_ptr<Transport> transport, CollectiveOptions options = {},
                        std::chrono::milliseconds timeout = std::chrono::seconds(60));

  int rank() const { return transport_->rank(); }
  int world_size() const { return transport_->world_size(); }
  Transport& transport() { return *transport_; }
  const CollectiveOptions& options() const { return options_; }
  /// Replaces the options; between collectives only (the Runtime fills in the layout's defaults
  /// once it knows the real hosts: collectives.h, for_layout).
  void set_options(CollectiveOptions options) { options_ = std::move(options); }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

  /// Above options().small_bytes and with shared memory in use (below), through it; else a
  /// schedule over the transport (allreduce_schedule).
  void allreduce(void* data, size_t count, DataType type, ReduceOp op);
  /// Collective: with `on`, allreduce above options().small_bytes goes through memory shared by
  /// the ranks (comm/shm/local_allreduce.h) from now on, instead of the transport; for ranks that
  /// all share one host (the Runtime decides: CollectiveOptions::shared_memory). The allreduce then
  /// runs on the calling thread (LocalAllreduce::allreduce_private): chunk by chunk, each rank
  /// stages the shares the others reduce in its region of shared memory, reduces its own share
  /// from its own buffer and the others' regions, and copies the others' results out of theirs.
  /// A wait spins a few microseconds, then sleeps in the kernel until a peer rings (a futex), so a
  /// busy machine delays the ranks only as long as its scheduler does, where a transport's
  /// progress thread polls. Every rank must call it alike. Returns whether shared memory is in use:
  /// where the region cannot be made (a /dev/shm per container, a full /dev/shm) every rank says so
  /// on stderr and stays on the transport; a peer that fails throws. Off: drops the region.
  bool use_shared_memory(bool on);
  bool uses_shared_memory() const;
  /// allreduce in three stages by host (collectives.h); `host_of[r]` is rank r's host.
  void hierarchical_allreduce(void* data, size_t count, DataType type, ReduceOp op,
                              const std::vector<int>& host_of);
  void reduce_scatter(const void* in, void* out, size_t count, DataType type, ReduceOp op);
  void allgather(const void* in, void* out, size_t count_per_rank, DataType type);
  void allgatherv(const void* in, void* out, const std::vector<size_t>& counts, DataType type);
  void alltoall(const void* in, void* out, size_t count_per_rank, DataType type);
  void broadcast(void* data, size_t count, DataType type, int root);
  void barrier();

  /// Runs any schedule under the next key (for algorithms built outside this class).
  void run(Schedule schedule);
  /// Runs the stages of a multi-stage operation (a Reduction's, compression/reduction.h), each
  /// under the next key, and returns the bytes this rank sent and received.
  struct Traffic {
    size_t sent = 0;
    size_t received = 0;
  };
  Traffic run_stages(std::vector<std::function<Schedule()>> stages, const std::string& what);

  /// Marks the job broken (a rank died), from any thread: the collective running now fails with
  /// `reason`, and so does every later call, at once.
  void abort(const std::string& reason, int peer);

 private:
  Group group() const { return Group{rank(), world_size()}; }
  uint32_t next_key();
  void shared_memory_allreduce(const std::shared_ptr<LocalAllreduce>& local, void* data,
                               size_t count, DataType type, ReduceOp op);

  std::shared_ptr<Transport> transport_;
  CollectiveOptions options_;
  std::chrono::milliseconds timeout_;
  uint32_t key_ = 0;
  BlockingDriver driver_;
  mutable std::mutex broken_mutex_;
  std::string broken_;  // why the job is broken; empty while it is not
  int broken_peer_ = -1;
  std::shared_ptr<LocalAllreduce> local_;  // with shared memory in use (use_shared_memory)
};

}  // namespace troupe::comm
