#include "comm/collectives/communicator.h"

#include <condition_variable>
#include <cstdio>
#include <cstring>

#include "comm/shm/local_allreduce.h"
#include "comm/timeout_setting.h"

namespace troupe::comm {

namespace {

// The staging region of allreduce through shared memory: kSharedSlots chunks of
// kSharedChunkBytes, used in turn, so that a rank copies one chunk in (and an earlier one out)
// while the ranks' workers reduce another.
constexpr int kSharedSlots = 4;
constexpr size_t kSharedChunkBytes = size_t{1} << 20;

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

void Communicator::shared_memory_allreduce(const std::shared_ptr<LocalAllreduce>& local,
                                           void* data, size_t count, DataType type, ReduceOp op) {
  const size_t elem = element_size(type);
  const size_t per_chunk = kSharedChunkBytes / elem;
  const size_t chunks = (count + per_chunk - 1) / per_chunk;
  const LocalReduce how{op, 1.0, false};
  char* user = static_cast<char*>(data);
  char* region = local->data();

  // Chunk c goes through slot c % kSharedSlots. The workers' callbacks mark the chunks that
  // ended; they may run after this call has thrown, so the marks live in a block of their own.
  struct Ended {
    std::mutex mutex;
    std::condition_variable changed;
    std::vector<char> chunk;
    Status failure;
  };
  auto ended = std::make_shared<Ended>();
  ended->chunk.assign(chunks, 0);
  auto range = [&](size_t c) {
    const size_t first = c * per_chunk;
    return std::make_pair(first, std::min(count, first + per_chunk) - first);
  };
  // Waits until chunk c is reduced. LocalAllreduce fails an operation at its own deadline, naming
  // the ranks it waits for; this wait outlasts that.
  auto wait_for = [&](size_t c) {
    std::unique_lock<std::mutex> lock(ended->mutex);
    const auto deadline = std::chrono::steady_clock::now() + timeout_ + std::chrono::seconds(10);
    const bool in_time = ended->changed.wait_until(
        lock, deadline, [&] { return ended->chunk[c] != 0 || !ended->failure.ok(); });
    if (!ended->failure.ok())
      throw Error("allreduce through shared memory on rank " + std::to_string(rank()) +
                      " failed: " + ended->failure.message(),
                  ended->failure.peer());
    if (!in_time)
      throw Error("allreduce through shared memory on rank " + std::to_string(rank()) +
                  ": chunk " + std::to_string(c) + " of " + std::to_string(chunks) +
                  " did not end within " + std::to_string(timeout_.count()) + " ms" +
                  kTimeoutSetting);
  };
  auto copy_out = [&](size_t c) {
    auto [first, n] = range(c);
    std::memcpy(user + first * elem, region + (c % kSharedSlots) * kSharedChunkBytes, n * elem);
  };
  for (size_t c = 0; c < chunks; ++c) {
    if (c >= kSharedSlots) {  // the slot's previous chunk ends and is copied back first
      wait_for(c - kSharedSlots);
      copy_out(c - kSharedSlots);
    }
    auto [first, n] = range(c);
    const size_t offset = (c % kSharedSlots) * kSharedChunkBytes;
    std::memcpy(region + offset, user + first * elem, n * elem);
    local->allreduce(static_cast<int>(c % kSharedSlots), offset, n, type, how,
                     [ended, c](const Status& status) {
                       {
                         std::lock_guard<std::mutex> guard(ended->mutex);
                         if (status.ok()) ended->chunk[c] = 1;
                         else if (ended->failure.ok()) ended->failure = status;
                       }
                       ended->changed.notify_all();
                     });
  }
  for (size_t c = chunks > kSharedSlots ? chunks - kSharedSlots : 0; c < chunks; ++c) {
    wait_for(c);
    copy_out(c);
  }
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
