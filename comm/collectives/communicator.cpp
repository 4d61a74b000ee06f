#include "comm/collectives/communicator.h"

#include <cstdio>
#include <cstring>

#include "comm/shm/local_allreduce.h"
#include "comm/timeout_setting.h"

namespace troupe::comm {

namespace {

// The staging region of allreduce through shared memory: kSharedSlots chunks of
// kSharedChunkBytes, taken in turn (LocalAllreduce::allreduce_private), so that a rank stages
// the next chunks while the others still reduce or take an earlier one.
constexpr int kSharedSlots = 4;
constexpr size_t kSharedChunkBytes = size_t{256} << 10;

}  // namespace

Communicator::Communicator(std::shared_ptr<Transport> transport, CollectiveOptions options,
                           std::chrono::milliseconds timeout)
    : transport_(std::move(transport)), options_(options), timeout_(timeout) {
  if (!transport_) throw Error("Communicator: transport is null");
}

uint32_t Communicator::next_key() {
  // Keys from kFirstUserKey up are left to callers that name their messages themselves
  // (the buckets of a DistributedModule); 0 is never used.
  if (++key_ >= kFirstUserKey) key_ = 1;
  return key_;
}

void Communicator::abort(const std::string& reason, int peer) {
  {
    std::lock_guard<std::mutex> guard(broken_mutex_);
    if (broken_.empty()) {
      broken_ = reason;
      broken_peer_ = peer;
    }
  }
  driver_.abort(Status::failure(reason, peer));
  std::shared_ptr<LocalAllreduce> local;
  {
    std::lock_guard<std::mutex> guard(broken_mutex_);
    local = local_;
  }
  if (local) local->abort(Status::failure(reason, peer));
}

void Communicator::run(Schedule schedule) {
  {
    std::lock_guard<std::mutex> guard(broken_mutex_);
    if (!broken_.empty()) throw Error(schedule.name + " refused: " + broken_, broken_peer_);
  }
  Status status = driver_.run(std::move(schedule), next_key(), transport_, timeout_);
  if (!status.ok()) throw Error(status.message(), status.peer());
}

void Communicator::allreduce(void* data, size_t count, DataType type, ReduceOp op) {
  if (count * element_size(type) > options_.small_bytes) {
    std::shared_ptr<LocalAllreduce> local;
    {
      std::lock_guard<std::mutex> guard(broken_mutex_);
      if (!broken_.empty()) throw Error("allreduce refused: " + broken_, broken_peer_);
      local = local_;
    }
    if (local) return shared_memory_allreduce(local, data, count, type, op);
  }
  run(allreduce_schedule(group(), data, count, type, op, options_));
}

bool Communicator::use_shared_memory(bool on) {
  std::shared_ptr<LocalAllreduce> local;
  if (on && world_size() > 1) {
    try {
      local = LocalAllreduce::connect(*this, kSharedSlots * kSharedChunkBytes, timeout_);
    } catch (const Error& e) {
      if (e.peer() >= 0) throw;  // a peer that died or never came: not a matter of memory
      // Every rank fails alike (connect agrees on the outcome), so every rank goes on over the
      // transport: ranks that look alike to the host check but see different /dev/shm (a
      // container each), or a /dev/shm that is full.
      std::fprintf(stderr,
                   "troupe: rank %d: allreduce goes over the transport, not shared memory: %s\n",
                   rank(), e.what());
    }
  }
  std::lock_guard<std::mutex> guard(broken_mutex_);
  local_ = std::move(local);
  // A rank that died while the region was being made: abort() found no region to fail.
  if (local_ && !broken_.empty()) local_->abort(Status::failure(broken_, broken_peer_));
  return local_ != nullptr;
}

bool Communicator::uses_shared_memory() const {
  std::lock_guard<std::mutex> guard(broken_mutex_);
  return local_ != nullptr;
}

void Communicator::shared_memory_allreduce(const std::shared_ptr<LocalAllreduce>& local, void* data,
                                           size_t count, DataType type, ReduceOp op) {
  local->allreduce_private(data, count, type, op, kSharedChunkBytes);
}

void Communicator::hierarchical_allreduce(void* data, size_t count, DataType type, ReduceOp op,
                                          const std::vector<int>& host_of) {
  run_stages(hierarchical_allreduce_stages(group(), host_of, data, count, type, op, options_),
             "hierarchical allreduce");
}

Communicator::Traffic Communicator::run_stages(std::vector<std::function<Schedule()>> stages,
                                               const std::string& what) {
  {
    std::lock_guard<std::mutex> guard(broken_mutex_);
    if (!broken_.empty()) throw Error(what + " refused: " + broken_, broken_peer_);
  }
  std::vector<Stage> keyed;
  for (auto& build : stages) keyed.push_back(Stage{next_key(), std::move(build)});
  Status status = driver_.run(std::move(keyed), transport_, timeout_);
  if (!status.ok()) throw Error(status.message(), status.peer());
  return Traffic{driver_.last_bytes_sent(), driver_.last_bytes_received()};
}

void Communicator::reduce_scatter(const void* in, void* out, size_t count, DataType type,
                                  ReduceOp op) {
  run(reduce_scatter_schedule(group(), in, out, count, type, op, options_));
}

void Communicator::allgather(const void* in, void* out, size_t count_per_rank, DataType type) {
  run(allgather_schedule(group(), in, out, count_per_rank, type, options_));
}

void Communicator::allgatherv(const void* in, void* out, const std::vector<size_t>& counts,
                              DataType type) {
  run(allgatherv_schedule(group(), in, out, counts, type, options_));
}

void Communicator::alltoall(const void* in, void* out, size_t count_per_rank, DataType type) {
  run(alltoall_schedule(group(), in, out, count_per_rank, type));
}

void Communicator::broadcast(void* data, size_t count, DataType type, int root) {
  run(broadcast_schedule(group(), data, count, type, root, options_));
}

void Communicator::barrier() { run(barrier_schedule(group())); }

}  // namespace troupe::comm
