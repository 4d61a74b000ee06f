#include "comm/shm/local_allreduce.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <list>
#include <mutex>
#include <new>
#include <random>
#include <thread>

#include "comm/collectives/communicator.h"
#include "comm/reduce.h"
#include "comm/shm/segment.h"
#include "comm/timeout_setting.h"

namespace troupe::comm {
namespace {

using Clock = std::chrono::steady_clock;
using Flag = std::atomic<uint32_t>;
static_assert(Flag::is_always_lock_free, "flags in shared memory must be lock-free atomics");

constexpr uint64_t kMagic = 0x7472'6f75'7065'6c61ULL;  // "troupela"
constexpr size_t kLine = 64;
constexpr size_t kPage = 4096;
// A share is reduced in blocks of this many bytes (they stay in L1 between the passes).
constexpr size_t kBlockBytes = 16384;
// The longest a worker sleeps before it looks at its deadlines again.
constexpr auto kWakeSlice = std::chrono::milliseconds(50);
// With two ranks, contributions this far apart make the first rank reduce the whole buffer (see
// Impl::share_for).
constexpr auto kSkew = std::chrono::milliseconds(1);
// How long allreduce_private spins on another rank's flag before it sleeps on a futex: about what
// a rank of a busy pair takes to copy or reduce a few blocks, far below a scheduler tick.
constexpr auto kSpin = std::chrono::microseconds(20);

// The start of every rank's segment. Flags count generations: ready[s] = g once this rank's
// contribution to the g-th reduction of slot s is in place; done[s] = g once this rank has
// written its share of it into every rank's buffer. `bell` is rung (incremented, futex-woken)
// whenever anyone publishes a flag this rank may be waiting for.
struct Control {
  uint64_t magic;
  uint32_t rank;
  uint32_t world;
  uint64_t data_bytes;
  alignas(kLine) Flag bell;
  alignas(kLine) Flag ready[LocalAllreduce::kMaxSlots];
  alignas(kLine) Flag done[LocalAllreduce::kMaxSlots];
  // When this rank published ready[s], in steady_clock nanoseconds (CLOCK_MONOTONIC: one clock for
  // every process of the host); written before ready[s], so that whoever has seen the flag reads
  // the time of that generation.
  alignas(kLine) std::atomic<int64_t> ready_at[LocalAllreduce::kMaxSlots];
  // allreduce_private: the chunks this rank has staged, reduced and taken since connect (the
  // count, mod 2^32), and the bell its waits sleep on, rung only while `sleepers` is not 0.
  alignas(kLine) Flag staged;
  alignas(kLine) Flag reduced;
  alignas(kLine) Flag taken;
  alignas(kLine) Flag private_bell;
  alignas(kLine) Flag sleepers;
};

constexpr size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
constexpr size_t kControlBytes = round_up(sizeof(Control), kPage);

void futex_wake_all(Flag* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Sleeps while *word == seen, at most `limit`.
void futex_wait(Flag* word, uint32_t seen, std::chrono::nanoseconds limit) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(limit.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(limit.count() % 1000000000);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void ring(Control* c) {
  c->bell.fetch_add(1, std::memory_order_release);
  futex_wake_all(&c->bell);
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

struct Pending {
  int slot = 0;
  uint32_t generation = 0;
  size_t offset = 0;
  size_t count = 0;
  DataType type = DataType::float32;
  LocalReduce how;
  Callback done;
  std::shared_ptr<const LocalSources> sources;  // null: every rank's contribution is the buffer
  Clock::time_point deadline;
  bool reduced = false;  // this rank's share is written (done[slot] published)
};

// The elements [lo, hi) of a count-element buffer that `rank` of `world` reduces: equal shares
// cut at cache lines, so that no two ranks write the same line.
struct Share {
  size_t lo;
  size_t hi;
};
Share share_of(size_t count, DataType type, int rank, int world) {
  const size_t per_line = std::max<size_t>(1, kLine / element_size(type));
  const size_t w = static_cast<size_t>(world);
  const size_t share = round_up((count + w - 1) / w, per_line);
  const size_t lo = std::min(count, share * static_cast<size_t>(rank));
  return Share{lo, std::min(count, lo + share)};
}

// One block of `n` elements reduced into `acc` from every rank's copy, in rank order
// (`source(k)`: rank k's first element of the block), then divided for an average or scaled
// after the sum (by `factor`, when not 1): reduce_share and allreduce_private both go through it.
template <typename Source>
void reduce_block(char* acc, const Source& source, size_t n, DataType type, ReduceOp op,
                  size_t world, double factor = 1.0) {
  comm::reduce(acc, source(0), source(1), n, type, op);
  for (size_t k = 2; k < world; ++k) comm::reduce(acc, acc, source(k), n, type, op);
  if (op == ReduceOp::avg)
    divide(acc, n, type, static_cast<int>(world));
  else if (factor != 1.0)
    scale(acc, n, type, factor);
}

}  // namespace

LocalReduce LocalReduce::scaled(double scale, bool before, int world) {
  if (scale == 1.0) return LocalReduce{};
  if (before) return LocalReduce{ReduceOp::sum, scale, true};
  if (std::abs(scale * world - 1.0) < 1e-12) return LocalReduce{ReduceOp::avg, 1.0, false};
  return LocalReduce{ReduceOp::sum, scale, false};
}

struct LocalAllreduce::Impl {
  int rank = 0;
  int world = 1;
  size_t data_bytes = 0;
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<SharedSegment> own;
  std::vector<std::shared_ptr<SharedSegment>> segments;  // by rank, own included
  std::vector<Control*> control;                         // by rank
  std::vector<char*> data;                               // by rank

  mutable std::mutex mutex;
  std::vector<uint32_t> generation = std::vector<uint32_t>(kMaxSlots, 0);  // submitted per slot
  std::list<Pending> pending;  // submission order (a list: `work` below survives erasing others)
  Status broken;               // set once: every pending and later operation fails with it
  std::atomic<bool> failed{false};  // broken is set (read without the lock)
  bool stop = false;
  std::vector<char> scratch;                                           // the worker's: two blocks
  std::vector<char> private_scratch = std::vector<char>(kBlockBytes);  // allreduce_private's
  uint64_t private_chunks = 0;  // chunks of allreduce_private so far (the same on every rank)
  std::thread worker;

  Control* mine() const { return control[static_cast<size_t>(rank)]; }
  void ring_all() {
    for (auto* c : control) ring(c);
  }
  void run();
  std::vector<int> missing(bool done_flags, int slot, uint32_t g) const {
    std::vector<int> out;
    for (int k = 0; k < world; ++k) {
      const Control* c = control[static_cast<size_t>(k)];
      const Flag& f = done_flags ? c->done[slot] : c->ready[slot];
      if (static_cast<int32_t>(f.load(std::memory_order_acquire) - g) < 0) out.push_back(k);
    }
    return out;
  }
  // This rank's share of `op`, or why it cannot be reduced (a peer's table of sources names memory
  // outside its region); nothing is written then.
  std::string reduce_share(const Pending& op);
  // Elements [0, n) of one stretch of a share: rank k's contribution at src[k], its result to
  // dst[k].
  void reduce_stretch(const Pending& op, size_t n);
  std::vector<const char*> src;  // the worker's, for reduce_stretch
  std::vector<char*> dst;
  Share share_for(const Pending& op) const;
  std::atomic<uint64_t> elements_reduced{0};

  // Under `mutex`. `waiting`: the ranks whose absence caused it (what waiting_on reports from
  // then on, when the operations that waited for them are gone).
  void fail(Status why, std::vector<int> waiting = {}) {
    if (broken.ok()) {
      if (waiting.empty() && why.peer() >= 0) waiting.push_back(why.peer());
      broken = std::move(why);
      broken_waiting = std::move(waiting);
    }
    failed.store(true, std::memory_order_release);
  }
  std::vector<int> broken_waiting;
  [[noreturn]] void throw_broken() const {
    std::lock_guard<std::mutex> lock(mutex);
    throw Error("allreduce through shared memory on rank " + std::to_string(rank) +
                    " failed: " + broken.message(),
                broken.peer());
  }
  // allreduce_private's flags: set this rank's count, ring the peers that sleep on theirs.
  void publish(Flag Control::*count, uint32_t value);
  // Until every other rank's count has reached `want`; `what` and `chunk` name the step.
  void await_peers(Flag Control::*count, uint32_t want, const char* what, size_t chunk,
                   size_t chunks);
};

namespace {
bool reached(const Control* c, Flag Control::*count, uint32_t want) {
  return static_cast<int32_t>((c->*count).load(std::memory_order_acquire) - want) >= 0;
}
}  // namespace

void LocalAllreduce::Impl::publish(Flag Control::*count, uint32_t value) {
  (mine()->*count).store(value, std::memory_order_release);
  // Against a peer that checks its condition and goes to sleep in between: its increment of
  // `sleepers` and our store are ordered one way or the other (see await_peers).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (int k = 0; k < world; ++k) {
    Control* c = control[static_cast<size_t>(k)];
    if (k == rank || c->sleepers.load(std::memory_order_relaxed) == 0) continue;
    c->private_bell.fetch_add(1, std::memory_order_release);
    futex_wake_all(&c->private_bell);
  }
}

void LocalAllreduce::Impl::await_peers(Flag Control::*count, uint32_t want, const char* what,
                                       size_t chunk, size_t chunks) {
  auto all_there = [&] {
    for (int k = 0; k < world; ++k)
      if (k != rank && !reached(control[static_cast<size_t>(k)], count, want)) return false;
    return true;
  };
  if (all_there()) return;
  const auto start = Clock::now();
  for (unsigned i = 1;; ++i) {  // the peer is usually a few microseconds away
    if (all_there()) return;
    if (failed.load(std::memory_order_acquire)) throw_broken();
    _mm_pause();
    if (i % 64 == 0 && Clock::now() - start > kSpin) break;
  }
  const auto deadline = start + timeout;
  Control* me = mine();
  for (;;) {
    const uint32_t seen = me->private_bell.load(std::memory_order_acquire);
    me->sleepers.fetch_add(1, std::memory_order_seq_cst);
    // Not redundant beside the seq_cst increment: the loads of all_there() are acquire, outside
    // the seq_cst order, and only a fence here pairs with publish()'s to forbid that both sides
    // miss each other (this rank reads the old flags while the publisher reads sleepers == 0).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const bool there = all_there();
    const auto now = Clock::now();
    if (!there && !failed.load(std::memory_order_acquire) && now < deadline)
      futex_wait(&me->private_bell, seen,
                 std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::min<Clock::duration>(deadline - now, kWakeSlice)));
    me->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (there || all_there()) return;
    if (failed.load(std::memory_order_acquire)) throw_broken();
    if (Clock::now() >= deadline) {
      std::vector<int> late;
      for (int k = 0; k < world; ++k)
        if (k != rank && !reached(control[static_cast<size_t>(k)], count, want)) late.push_back(k);
      const std::string text =
          "allreduce through shared memory on rank " + std::to_string(rank) + ": ranks " +
          ranks_text(late) + " did not " + what + " chunk " + std::to_string(chunk + 1) + " of " +
          std::to_string(chunks) + " within " + std::to_string(timeout.count()) +
          " ms (a rank that died or stalls, or ranks that called allreduce with different sizes)" +
          kTimeoutSetting;
      {
        std::lock_guard<std::mutex> lock(mutex);
        fail(Status::failure(text, late.empty() ? -1 : late.front()), late);
      }
      throw Error(text, late.empty() ? -1 : late.front());
    }
  }
}

// The elements of `op` this rank reduces: its equal share, except with two ranks whose
// contributions came more than kSkew apart. Then the first reduces all of it and the later one
// nothing: the later rank is the one still computing (a backward pass that lags the other's), and
// its half would run on its critical path, taking a core from its trainer, while the first rank
// is ahead of it (idle, or with time to spare). Both ranks read the same two times, written
// before the ready flags both have seen, so they agree; each element is still summed in rank
// order by one rank, so the bits do not depend on the split.
Share LocalAllreduce::Impl::share_for(const Pending& op) const {
  if (world != 2) return share_of(op.count, op.type, rank, world);
  const int64_t mine_at =
      control[static_cast<size_t>(rank)]->ready_at[op.slot].load(std::memory_order_relaxed);
  const int64_t other_at =
      control[static_cast<size_t>(1 - rank)]->ready_at[op.slot].load(std::memory_order_relaxed);
  const int64_t skew = std::chrono::duration_cast<std::chrono::nanoseconds>(kSkew).count();
  if (other_at - mine_at > skew) return Share{0, op.count};  // this rank came first
  if (mine_at - other_at > skew) return Share{op.count, op.count};
  return share_of(op.count, op.type, rank, world);
}

std::string LocalAllreduce::Impl::reduce_share(const Pending& op) {
  const size_t elem = element_size(op.type);
  const auto [lo, hi] = share_for(op);
  const size_t w = static_cast<size_t>(world);
  src.resize(w);
  dst.resize(w);
  if (!op.sources) {
    elements_reduced.fetch_add(hi - lo, std::memory_order_relaxed);
    for (size_t k = 0; k < w; ++k) src[k] = dst[k] = data[k] + op.offset + lo * elem;
    reduce_stretch(op, hi - lo);
    return {};
  }
  const auto& pieces = *op.sources;
  // The pieces that meet [lo, hi): from the last one starting at or before lo.
  size_t first = static_cast<size_t>(
      std::upper_bound(pieces.first.begin(), pieces.first.end(), lo) - pieces.first.begin());
  first = first == 0 ? 0 : first - 1;
  size_t last = first;
  while (last < pieces.first.size() && pieces.first[last] < hi) ++last;
  // Every rank's entries for them, checked before anything is written.
  for (size_t k = 0; k < w; ++k) {
    const auto* table = reinterpret_cast<const uint64_t*>(data[k] + pieces.table);
    for (size_t i = first; i < last; ++i) {
      const uint64_t at = table[i];
      if (at % elem != 0 || at > data_bytes || pieces.count[i] > (data_bytes - at) / elem)
        return "rank " + std::to_string(k) + "'s source of piece " + std::to_string(i) + " (" +
               std::to_string(pieces.count[i]) + " " + to_string(op.type) + " elements at byte " +
               std::to_string(at) + ") lies outside its data region of " +
               std::to_string(data_bytes) + " bytes or off the element size";
    }
  }
  for (size_t i = first; i < last; ++i) {
    const size_t a = std::max(lo, pieces.first[i]);
    const size_t b = std::min(hi, pieces.first[i] + pieces.count[i]);
    if (a >= b) continue;
    elements_reduced.fetch_add(b - a, std::memory_order_relaxed);
    for (size_t k = 0; k < w; ++k) {
      const auto* table = reinterpret_cast<const uint64_t*>(data[k] + pieces.table);
      char* source = data[k] + table[i] + (a - pieces.first[i]) * elem;
      src[k] = source;
      dst[k] = pieces.in_place ? source : data[k] + op.offset + a * elem;
    }
    reduce_stretch(op, b - a);
  }
  return {};
}

void LocalAllreduce::Impl::reduce_stretch(const Pending& op, size_t n) {
  const size_t elem = element_size(op.type);
  const size_t block = kBlockBytes / elem;
  char* acc = scratch.data();
  char* tmp = scratch.data() + kBlockBytes;
  const bool scaled = op.how.op == ReduceOp::sum && op.how.scale != 1.0;
  // Two ranks: one pass, both contributions read once and both results written once (shares start
  // at the same offset on both ranks, cut at cache lines, so that the stores are aligned alike;
  // allreduce_private's user buffers are not, and go through the blocks below).
  if (world == 2 && !scaled) {
    comm::reduce_to_two(dst[0], dst[1], src[0], src[1], n, op.type, op.how.op, world);
    return;
  }
  for (size_t i = 0; i < n; i += block) {
    const size_t m = std::min(block, n - i);
    const size_t at = i * elem;
    if (scaled && op.how.scale_before) {
      comm::copy(acc, src[0] + at, m * elem);
      scale(acc, m, op.type, op.how.scale);
      for (size_t k = 1; k < src.size(); ++k) {
        comm::copy(tmp, src[k] + at, m * elem);
        scale(tmp, m, op.type, op.how.scale);
        comm::reduce(acc, acc, tmp, m, op.type, ReduceOp::sum);
      }
    } else {
      auto from = [&](size_t k) -> const char* { return src[k] + at; };
      reduce_block(acc, from, m, op.type, op.how.op, src.size(), scaled ? op.how.scale : 1.0);
    }
    for (char* out : dst) comm::copy(out + at, acc, m * elem);
  }
}

void LocalAllreduce::Impl::run() {
  for (;;) {
    const uint32_t seen = mine()->bell.load(std::memory_order_acquire);
    std::vector<std::pair<Callback, Status>> finished;
    Pending* work = nullptr;
    Clock::time_point next_deadline = Clock::now() + kWakeSlice;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (stop && broken.ok()) fail(Status::failure("LocalAllreduce: shut down"));
      const auto now = Clock::now();
      for (auto it = pending.begin(); it != pending.end();) {
        Pending& op = *it;
        // Every rank has written its share: the result is in place, whatever failed since (a
        // rank that died after its share, or that left once it saw the end, as this one may not
        // have yet).
        if (op.reduced && missing(true, op.slot, op.generation).empty()) {
          finished.emplace_back(std::move(op.done), Status::success());
          it = pending.erase(it);
          continue;
        }
        if (broken.ok() && now >= op.deadline) {
          const auto waiting = missing(op.reduced, op.slot, op.generation);
          fail(Status::failure(
                   "a reduction through shared memory timed out: ranks " + ranks_text(waiting) +
                       (op.reduced ? " did not finish their shares" : " did not contribute") +
                       " within " + std::to_string(timeout.count()) + " ms (LocalAllreduce slot " +
                       std::to_string(op.slot) + ", generation " + std::to_string(op.generation) +
                       ")" + kTimeoutSetting,
                   waiting.empty() ? -1 : waiting.front()),
               waiting);
        }
        if (!broken.ok()) {
          finished.emplace_back(std::move(op.done), broken);
          it = pending.erase(it);
          continue;
        }
        if (!op.reduced && !work && missing(false, op.slot, op.generation).empty()) work = &op;
        next_deadline = std::min(next_deadline, op.deadline);
        ++it;
      }
      if (stop && pending.empty() && finished.empty()) return;
    }
    for (auto& f : finished) f.first(f.second);
    if (work) {
      // Safe without the lock: only this thread erases from `pending`, and list elements stay
      // where they are while others are added or erased.
      const std::string error = reduce_share(*work);
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (error.empty()) {
          work->reduced = true;
          mine()->done[work->slot].store(work->generation, std::memory_order_release);
        } else {
          fail(Status::failure("a reduction through shared memory (LocalAllreduce slot " +
                               std::to_string(work->slot) + ") cannot read its sources: " + error));
        }
      }
      ring_all();
      continue;
    }
    if (!finished.empty()) continue;
    const auto wait =
        std::max(next_deadline - Clock::now(), Clock::duration(std::chrono::microseconds(100)));
    futex_wait(&mine()->bell, seen, std::chrono::duration_cast<std::chrono::nanoseconds>(wait));
  }
}

std::shared_ptr<LocalAllreduce> LocalAllreduce::connect(Communicator& comm, size_t data_bytes,
                                                        std::chrono::milliseconds timeout) {
  if (data_bytes == 0) throw Error("LocalAllreduce: data_bytes 0 (expected > 0)");
  if (timeout.count() <= 0)
    throw Error("LocalAllreduce: timeout " + std::to_string(timeout.count()) +
                " ms (expected > 0)");
  auto impl = std::make_unique<Impl>();
  impl->rank = comm.rank();
  impl->world = comm.world_size();
  impl->data_bytes = round_up(data_bytes, kPage);
  impl->timeout = timeout;
  const size_t bytes = kControlBytes + impl->data_bytes;

  // Rank 0's random token names this job's segments: "/troupe-<token>-<rank>".
  int64_t token = 0;
  if (impl->rank == 0) {
    std::random_device device;
    token = static_cast<int64_t>((static_cast<uint64_t>(device()) << 32 | device()) >> 1);
  }
  comm.broadcast(&token, 1, DataType::int64, 0);
  auto name_of = [token](int k) {
    char text[64];
    std::snprintf(text, sizeof text, "/troupe-%016llx-%d", static_cast<unsigned long long>(token),
                  k);
    return std::string(text);
  };
  // Every rank learns whether all succeeded (a rank that failed alone would leave the others
  // waiting for its segment); then the first error is the one thrown.
  auto agree = [&comm](const std::string& error, const std::string& what) {
    int32_t failed = error.empty() ? 0 : 1;
    comm.allreduce(&failed, 1, DataType::int32, ReduceOp::max);
    if (!error.empty()) throw Error(error);
    if (failed) throw Error("LocalAllreduce: another rank could not " + what);
  };

  std::string error;
  try {
    impl->own = SharedSegment::create(name_of(impl->rank), bytes);
    auto* c = new (impl->own->data()) Control();
    c->magic = kMagic;
    c->rank = static_cast<uint32_t>(impl->rank);
    c->world = static_cast<uint32_t>(impl->world);
    c->data_bytes = impl->data_bytes;
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree(error, "create its shared segment");
  try {
    for (int k = 0; k < impl->world; ++k) {
      auto segment = k == impl->rank ? impl->own : SharedSegment::open(name_of(k), bytes);
      auto* c = reinterpret_cast<Control*>(segment->data());
      if (c->magic != kMagic || c->rank != static_cast<uint32_t>(k) ||
          c->world != static_cast<uint32_t>(impl->world) || c->data_bytes != impl->data_bytes)
        throw Error("shared segment '" + segment->name() + "' holds rank " +
                    std::to_string(c->rank) + " of world " + std::to_string(c->world) + " with " +
                    std::to_string(c->data_bytes) + " data bytes (expected rank " +
                    std::to_string(k) + " of world " + std::to_string(impl->world) + " with " +
                    std::to_string(impl->data_bytes) + ")");
      impl->segments.push_back(segment);
      impl->control.push_back(c);
      impl->data.push_back(segment->data() + kControlBytes);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree(error, "map the other ranks' shared segments");
  impl->own->unlink();  // every rank has mapped it
  impl->scratch.resize(2 * kBlockBytes);
  auto* raw = impl.get();
  impl->worker = std::thread([raw] { raw->run(); });
  return std::shared_ptr<LocalAllreduce>(new LocalAllreduce(std::move(impl)));
}

LocalAllreduce::LocalAllreduce(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

LocalAllreduce::~LocalAllreduce() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stop = true;
  }
  ring(impl_->mine());
  impl_->worker.join();
}

int LocalAllreduce::rank() const { return impl_->rank; }
int LocalAllreduce::world_size() const { return impl_->world; }
char* LocalAllreduce::data() const { return impl_->data[static_cast<size_t>(impl_->rank)]; }
size_t LocalAllreduce::data_bytes() const { return impl_->data_bytes; }
std::shared_ptr<void> LocalAllreduce::region_keeper() const { return impl_->own; }

void LocalAllreduce::allreduce(int slot, size_t offset, size_t count, DataType type,
                               const LocalReduce& how, Callback done,
                               std::shared_ptr<const LocalSources> sources) {
  const std::string call = "LocalAllreduce::allreduce(slot " + std::to_string(slot) + ")";
  if (slot < 0 || slot >= kMaxSlots)
    throw Error(call + ": slot outside 0.." + std::to_string(kMaxSlots - 1));
  const size_t elem = element_size(type);
  if (offset % elem != 0)
    throw Error(call + ": offset " + std::to_string(offset) + " is not a multiple of the " +
                to_string(type) + " element size " + std::to_string(elem));
  if (offset > impl_->data_bytes || count > (impl_->data_bytes - offset) / elem)
    throw Error(call + ": " + std::to_string(count) + " " + to_string(type) + " elements at byte " +
                std::to_string(offset) + " end past the data region of " +
                std::to_string(impl_->data_bytes) + " bytes");
  if (how.scale != 1.0 && how.op != ReduceOp::sum)
    throw Error(call + ": scale " + number_text(how.scale) + " with op " + to_string(how.op) +
                " (expected op sum)");
  if (!done) throw Error(call + ": no callback");
  if (sources) check_sources(call, *sources, count, type);
  Pending op{slot,
             0,
             offset,
             count,
             type,
             how,
             std::move(done),
             std::move(sources),
             Clock::now() + impl_->timeout};
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    op.generation = ++impl_->generation[static_cast<size_t>(slot)];
    if (impl_->world == 1 || count == 0) {
      // Nothing to combine, but the flags still count the generation for the other ranks.
      op.reduced = true;
      impl_->mine()->done[slot].store(op.generation, std::memory_order_release);
    }
    impl_->mine()->ready_at[slot].store(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
            .count(),
        std::memory_order_relaxed);
    impl_->mine()->ready[slot].store(op.generation, std::memory_order_release);
    impl_->pending.push_back(std::move(op));
  }
  impl_->ring_all();
}

void LocalAllreduce::check_sources(const std::string& call, const LocalSources& sources,
                                   size_t count, DataType type) const {
  const size_t elem = element_size(type);
  const size_t n = sources.first.size();
  if (sources.count.size() != n)
    throw Error(call + ": sources with " + std::to_string(n) + " first elements and " +
                std::to_string(sources.count.size()) + " counts (expected one of each per piece)");
  if (sources.table % sizeof(uint64_t) != 0 || sources.table > impl_->data_bytes ||
      n > (impl_->data_bytes - sources.table) / sizeof(uint64_t))
    throw Error(call + ": the sources' table of " + std::to_string(n) + " entries at byte " +
                std::to_string(sources.table) +
                " is not 8-byte aligned inside the data region of " +
                std::to_string(impl_->data_bytes) + " bytes");
  const auto* table = reinterpret_cast<const uint64_t*>(data() + sources.table);
  size_t end = 0;
  for (size_t i = 0; i < n; ++i) {
    if (sources.first[i] < end || sources.count[i] > count ||
        sources.first[i] > count - sources.count[i])
      throw Error(call + ": piece " + std::to_string(i) + " (" + std::to_string(sources.count[i]) +
                  " elements from " + std::to_string(sources.first[i]) +
                  ") overlaps the one before it or ends past the buffer's " +
                  std::to_string(count) + " elements (expected ascending, disjoint pieces)");
    end = sources.first[i] + sources.count[i];
    if (table[i] % elem != 0 || table[i] > impl_->data_bytes ||
        sources.count[i] > (impl_->data_bytes - table[i]) / elem)
      throw Error(call + ": piece " + std::to_string(i) + "'s source at byte " +
                  std::to_string(table[i]) + " (" + std::to_string(sources.count[i]) + " " +
                  to_string(type) +
                  " elements) is off the element size or ends past the data "
                  "region of " +
                  std::to_string(impl_->data_bytes) + " bytes");
  }
}

void LocalAllreduce::abort(const Status& why) {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->fail(why.ok() ? Status::failure("LocalAllreduce: aborted") : why);
  }
  ring(impl_->mine());
  impl_->mine()->private_bell.fetch_add(1, std::memory_order_release);
  futex_wake_all(&impl_->mine()->private_bell);
}

std::vector<int> LocalAllreduce::waiting_on(int slot) const {
  if (slot < 0 || slot >= kMaxSlots) return {};
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (auto it = impl_->pending.rbegin(); it != impl_->pending.rend(); ++it)
    if (it->slot == slot) return impl_->missing(it->reduced, slot, it->generation);
  // Failed: the operations (this slot's among them) ended without the ranks the failure names. A
  // stall report that asks just after the deadline removed them must still name those ranks.
  if (!impl_->broken.ok()) return impl_->broken_waiting;
  return {};
}

void LocalAllreduce::allreduce_private(void* data, size_t count, DataType type, ReduceOp op,
                                       size_t chunk_bytes) {
  auto& m = *impl_;
  const size_t elem = element_size(type);
  const size_t slots = chunk_bytes == 0 ? 0 : m.data_bytes / chunk_bytes;
  if (chunk_bytes % kLine != 0 || chunk_bytes < elem || slots < 2)
    throw Error("LocalAllreduce::allreduce_private: chunk_bytes " + std::to_string(chunk_bytes) +
                " (expected a multiple of " + std::to_string(kLine) + " of which the region of " +
                std::to_string(m.data_bytes) + " bytes holds at least 2)");
  if (m.failed.load(std::memory_order_acquire)) m.throw_broken();
  if (count == 0 || m.world == 1) return;
  const size_t per_chunk = chunk_bytes / elem;
  const size_t chunks = (count + per_chunk - 1) / per_chunk;
  const uint64_t base = m.private_chunks;
  m.private_chunks += chunks;
  char* user = static_cast<char*>(data);
  const size_t world = static_cast<size_t>(m.world);
  const size_t me = static_cast<size_t>(m.rank);
  auto slot_of = [&](size_t k, size_t c) { return m.data[k] + (base + c) % slots * chunk_bytes; };
  auto first_of = [&](size_t c) { return c * per_chunk; };
  auto size_of = [&](size_t c) { return std::min(count - c * per_chunk, per_chunk); };
  auto flag = [&](size_t c) { return static_cast<uint32_t>(base + c + 1); };

  // 1. The shares the other ranks reduce, into this rank's slot, once the slot's previous chunk
  //    has been taken by every rank.
  auto stage = [&](size_t c) {
    m.await_peers(&Control::taken, static_cast<uint32_t>(flag(c) - slots), "take", c, chunks);
    const size_t n = size_of(c);
    char* slot = slot_of(me, c);
    for (size_t k = 0; k < world; ++k) {
      if (k == me) continue;
      const auto [lo, hi] = share_of(n, type, static_cast<int>(k), m.world);
      comm::copy(slot + lo * elem, user + (first_of(c) + lo) * elem, (hi - lo) * elem);
    }
    m.publish(&Control::staged, flag(c));
  };
  // 2. This rank's share, in rank order, block by block through L1, into its own memory and its
  //    slot's share (where the others take it from).
  auto reduce_own = [&](size_t c) {
    m.await_peers(&Control::staged, flag(c), "stage", c, chunks);
    const size_t n = size_of(c);
    const auto [lo, hi] = share_of(n, type, m.rank, m.world);
    const size_t block = kBlockBytes / elem;
    char* acc = m.private_scratch.data();
    char* own = user + first_of(c) * elem;
    for (size_t i = lo; i < hi; i += block) {
      const size_t b = std::min(block, hi - i);
      auto from = [&](size_t k) -> const char* {
        return k == me ? own + i * elem : slot_of(k, c) + i * elem;
      };
      reduce_block(acc, from, b, type, op, world);
      comm::copy(own + i * elem, acc, b * elem);
      comm::copy(slot_of(me, c) + i * elem, acc, b * elem);
    }
    m.publish(&Control::reduced, flag(c));
  };
  // 3. The other ranks' results out of their slots.
  auto take = [&](size_t c) {
    m.await_peers(&Control::reduced, flag(c), "reduce its share of", c, chunks);
    const size_t n = size_of(c);
    for (size_t k = 0; k < world; ++k) {
      if (k == me) continue;
      const auto [lo, hi] = share_of(n, type, static_cast<int>(k), m.world);
      comm::copy(user + (first_of(c) + lo) * elem, slot_of(k, c) + lo * elem, (hi - lo) * elem);
    }
    m.publish(&Control::taken, flag(c));
  };
  // Taking lags a chunk behind, so that the others' reductions of it have run meanwhile.
  for (size_t c = 0; c < chunks; ++c) {
    stage(c);
    if (c > 0) take(c - 1);
    reduce_own(c);
  }
  take(chunks - 1);
}

uint64_t LocalAllreduce::elements_reduced() const {
  return impl_->elements_reduced.load(std::memory_order_relaxed);
}

size_t LocalAllreduce::peer_bytes(size_t count, DataType type) const {
  const auto [lo, hi] = share_of(count, type, impl_->rank, impl_->world);
  return (hi - lo) * element_size(type) * static_cast<size_t>(impl_->world - 1);
}

}  // namespace troupe::comm
