#include "comm/transport/link_emulation.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <iterator>
#include <mutex>
#include <thread>

namespace troupe::comm {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

struct EmulatedTransport::Impl {
  struct Delayed {
    Clock::time_point due;
    uint64_t seq;  // posting order: equal arrival times keep it
    int peer;
    Tag tag;
    const void* data;
    size_t bytes;
    Callback done;
  };
  // For std::push_heap and friends: the front is the earliest.
  static bool later(const Delayed& a, const Delayed& b) {
    return a.due != b.due ? a.due > b.due : a.seq > b.seq;
  }

  std::shared_ptr<Transport> inner;
  std::vector<LinkShape> shapes;
  std::mutex mutex;  // guards everything below
  std::condition_variable wake;
  std::vector<Delayed> queue;              // a heap ordered by `later`
  std::vector<Clock::time_point> free_at;  // per peer: when the wire is free again
  std::vector<std::string> failed;         // per peer: the fail_peer reason
  uint64_t next_seq = 0;
  bool stopping = false;
  std::thread timer;

  // Issues every delayed send when it is due; waits on `wake` until the earliest deadline.
  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    std::vector<Delayed> due;
    while (!stopping) {
      if (queue.empty()) {
        wake.wait(lock);
        continue;
      }
      const auto now = Clock::now();
      // A copy: wait_until reads it again after waking, when `queue` may have been reallocated.
      const Clock::time_point next = queue.front().due;
      if (next > now) {
        wake.wait_until(lock, next);
        continue;
      }
      while (!queue.empty() && queue.front().due <= now) {
        std::pop_heap(queue.begin(), queue.end(), later);
        due.push_back(std::move(queue.back()));
        queue.pop_back();
      }
      lock.unlock();
      for (Delayed& d : due) inner->send(d.peer, d.tag, d.data, d.bytes, std::move(d.done));
      due.clear();
      lock.lock();
    }
  }
};

EmulatedTransport::EmulatedTransport(std::shared_ptr<Transport> inner,
                                     std::vector<LinkShape> shapes)
    : impl_(std::make_shared<Impl>()) {
  if (!inner) throw Error("EmulatedTransport: no inner transport");
  if (static_cast<int>(shapes.size()) != inner->world_size())
    throw Error("EmulatedTransport: " + std::to_string(shapes.size()) +
                " link shapes, expected one per rank (" + std::to_string(inner->world_size()) +
                ")");
  for (size_t p = 0; p < shapes.size(); ++p)
    if (!(shapes[p].bytes_per_sec >= 0) || !std::isfinite(shapes[p].bytes_per_sec) ||
        shapes[p].latency.count() < 0)
      throw Error("EmulatedTransport: the link to rank " + std::to_string(p) + " has " +
                  std::to_string(shapes[p].bytes_per_sec) + " bytes/s and " +
                  std::to_string(shapes[p].latency.count()) +
                  " us latency (expected a finite rate >= 0, 0 = unlimited, and a latency >= 0)");
  impl_->inner = std::move(inner);
  impl_->shapes = std::move(shapes);
  impl_->free_at.assign(impl_->shapes.size(), Clock::time_point{});
  impl_->failed.resize(impl_->shapes.size());
  impl_->timer = std::thread([impl = impl_] { impl->run(); });
}

EmulatedTransport::~EmulatedTransport() {
  std::vector<Impl::Delayed> pending;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stopping = true;
    pending.swap(impl_->queue);
  }
  impl_->wake.notify_all();
  // The last owner may let go inside a callback on the timer thread itself: it cannot join
  // itself, so it leaves the loop on its own (it keeps the Impl alive until then).
  if (impl_->timer.get_id() == std::this_thread::get_id())
    impl_->timer.detach();
  else
    impl_->timer.join();
  std::sort(pending.begin(), pending.end(),
            [](const Impl::Delayed& a, const Impl::Delayed& b) { return a.seq < b.seq; });
  for (auto& d : pending) d.done(Status::failure("transport shut down", d.peer));
}

const std::shared_ptr<Transport>& EmulatedTransport::inner() const { return impl_->inner; }
int EmulatedTransport::rank() const { return impl_->inner->rank(); }
int EmulatedTransport::world_size() const { return impl_->inner->world_size(); }
std::string EmulatedTransport::name() const { return impl_->inner->name() + "+emulated"; }

void EmulatedTransport::send(int peer, Tag tag, const void* data, size_t bytes, Callback done) {
  Impl& m = *impl_;
  if (peer < 0 || peer >= static_cast<int>(m.shapes.size()) ||
      !m.shapes[static_cast<size_t>(peer)].active()) {
    m.inner->send(peer, tag, data, bytes, std::move(done));  // unshaped, or inner's error
    return;
  }
  const LinkShape& shape = m.shapes[static_cast<size_t>(peer)];
  std::unique_lock<std::mutex> lock(m.mutex);
  if (!m.failed[static_cast<size_t>(peer)].empty()) {
    lock.unlock();
    m.inner->send(peer, tag, data, bytes, std::move(done));  // the inner fails it at once
    return;
  }
  const auto now = Clock::now();
  auto& free_at = m.free_at[static_cast<size_t>(peer)];
  const auto start = std::max(now, free_at);
  Clock::duration wire{0};
  if (shape.bytes_per_sec > 0)
    wire = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / shape.bytes_per_sec));
  free_at = start + wire;
  const auto due = free_at + shape.latency;
  const bool earliest = m.queue.empty() || due < m.queue.front().due;
  m.queue.push_back(Impl::Delayed{due, m.next_seq++, peer, tag, data, bytes, std::move(done)});
  std::push_heap(m.queue.begin(), m.queue.end(), Impl::later);
  // Under the lock: once it is released, the send may complete and its callback drop the last
  // reference to this transport.
  if (earliest) m.wake.notify_one();
}

void EmulatedTransport::recv(int peer, Tag tag, void* data, size_t bytes, Callback done) {
  impl_->inner->recv(peer, tag, data, bytes, std::move(done));
}

std::string EmulatedTransport::survive_peer_loss(uint32_t key_prefix) {
  return impl_->inner->survive_peer_loss(key_prefix);
}

bool EmulatedTransport::can_probe() const { return impl_->inner->can_probe(); }

void EmulatedTransport::probe(int peer, Callback done) {
  impl_->inner->probe(peer, std::move(done));
}

void EmulatedTransport::fail_peer(int peer, const std::string& reason) {
  Impl& m = *impl_;
  if (peer < 0 || peer >= static_cast<int>(m.shapes.size())) {
    m.inner->fail_peer(peer, reason);  // the inner decides what a bad rank means
    return;
  }
  std::vector<Impl::Delayed> dropped;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    std::string& slot = m.failed[static_cast<size_t>(peer)];
    if (slot.empty()) slot = reason.empty() ? "rank " + std::to_string(peer) + " failed" : reason;
    why = slot;
    auto keep = std::partition(m.queue.begin(), m.queue.end(),
                               [peer](const Impl::Delayed& d) { return d.peer != peer; });
    std::move(keep, m.queue.end(), std::back_inserter(dropped));
    m.queue.erase(keep, m.queue.end());
    std::make_heap(m.queue.begin(), m.queue.end(), Impl::later);
  }
  std::sort(dropped.begin(), dropped.end(),
            [](const Impl::Delayed& a, const Impl::Delayed& b) { return a.seq < b.seq; });
  m.inner->fail_peer(peer, reason);
  for (auto& d : dropped) d.done(Status::failure(why, peer));
}

}  // namespace troupe::comm
