#include "comm/transport/link_emulation.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <condition_variable>
#include <iterator>
#include <mutex>
#include <thread>

namespace troupe::comm {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kShapeExpected =
    "a rate such as 1gbit, 100mbit or 10GB/s (units bit, kbit, mbit, gbit, B, KB, MB, GB per "
    "second, decimal), a latency such as 5ms, 200us or 1s, both separated by a comma, or none";
constexpr double kMaxLatencyUs = 60e6;  // a minute: anything longer is a typo, not a network

std::string trim(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(s[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(s[end - 1]))) --end;
  return s.substr(begin, end - begin);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::vector<std::string> split(const std::string& s, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t end = s.find(separator, start);
    parts.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return parts;
    start = end + 1;
  }
}

/// Bytes per second in one unit of a rate, or 0 when `unit` is not a rate.
double rate_unit(std::string unit) {
  if (unit.size() > 2 && unit.compare(unit.size() - 2, 2, "/s") == 0) unit.resize(unit.size() - 2);
  const std::string l = lower(unit);
  if (l == "bit") return 1.0 / 8;
  if (l == "kbit") return 1e3 / 8;
  if (l == "mbit") return 1e6 / 8;
  if (l == "gbit") return 1e9 / 8;
  // Bytes only with an upper-case B: "gb" could as well mean gigabits.
  if (unit == "B") return 1;
  if (unit == "KB" || unit == "kB") return 1e3;
  if (unit == "MB") return 1e6;
  if (unit == "GB") return 1e9;
  return 0;
}

/// Microseconds in one unit of a latency, or 0 when `unit` is not a latency.
double latency_unit(const std::string& unit) {
  if (unit == "us") return 1;
  if (unit == "ms") return 1e3;
  if (unit == "s") return 1e6;
  return 0;
}

/// Slower of two shapes, component by component (0 bandwidth means unlimited).
LinkShape slower(const LinkShape& a, const LinkShape& b) {
  LinkShape s;
  if (a.bytes_per_sec > 0 && b.bytes_per_sec > 0)
    s.bytes_per_sec = std::min(a.bytes_per_sec, b.bytes_per_sec);
  else
    s.bytes_per_sec = std::max(a.bytes_per_sec, b.bytes_per_sec);
  s.latency = std::max(a.latency, b.latency);
  return s;
}

}  // namespace

LinkShape parse_link_shape(const std::string& text) {
  const std::string whole = trim(text);
  LinkShape shape;
  if (whole.empty() || lower(whole) == "none") return shape;
  auto fail = [&](const std::string& problem) -> Error {
    return Error("link shape '" + text + "': " + problem + " (expected " + kShapeExpected + ")");
  };
  bool have_rate = false, have_latency = false;
  for (const std::string& raw : split(whole, ',')) {
    const std::string part = trim(raw);
    if (part.empty()) throw fail("an empty part");
    size_t i = 0;
    bool digits = false;
    while (i < part.size() && std::isdigit(static_cast<unsigned char>(part[i]))) ++i, digits = true;
    if (i < part.size() && part[i] == '.') {
      ++i;
      while (i < part.size() && std::isdigit(static_cast<unsigned char>(part[i])))
        ++i, digits = true;
    }
    if (!digits) throw fail("'" + part + "' does not start with a number");
    const double value = std::stod(part.substr(0, i));
    const std::string unit = trim(part.substr(i));
    if (unit.empty()) throw fail("'" + part + "' has no unit");
    if (double scale = rate_unit(unit); scale > 0) {
      if (have_rate) throw fail("two rates");
      if (!(value > 0)) throw fail("rate '" + part + "' is not positive");
      shape.bytes_per_sec = value * scale;
      have_rate = true;
    } else if (double us = latency_unit(unit); us > 0) {
      if (have_latency) throw fail("two latencies");
      if (value * us > kMaxLatencyUs) throw fail("latency '" + part + "' is over a minute");
      shape.latency = std::chrono::microseconds(std::llround(value * us));
      have_latency = true;
    } else {
      throw fail("'" + part + "' has unit '" + unit + "'");
    }
  }
  return shape;
}

std::vector<std::pair<int, LinkShape>> parse_rank_links(const std::string& text) {
  std::vector<std::pair<int, LinkShape>> links;
  for (const std::string& raw : split(text, ';')) {
    const std::string entry = trim(raw);
    if (entry.empty()) continue;
    auto fail = [&](const std::string& problem) -> Error {
      return Error("link ranks '" + text + "': entry '" + entry + "' " + problem +
                   " (expected RANK=SHAPE entries separated by ';', e.g. 3=100mbit,20ms)");
    };
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) throw fail("has no '='");
    const std::string rank_text = trim(entry.substr(0, eq));
    if (rank_text.empty() || rank_text.size() > 9 ||
        !std::all_of(rank_text.begin(), rank_text.end(),
                     [](unsigned char c) { return std::isdigit(c); }))
      throw fail("names rank '" + rank_text + "', not a non-negative integer");
    const int rank = std::stoi(rank_text);
    for (const auto& [r, s] : links)
      if (r == rank) throw fail("names rank " + rank_text + " a second time");
    try {
      links.emplace_back(rank, parse_link_shape(entry.substr(eq + 1)));
    } catch (const Error& e) {
      throw Error("link ranks '" + text + "': " + e.what());
    }
  }
  return links;
}

bool LinkEmulation::active() const {
  return all.active() || std::any_of(ranks.begin(), ranks.end(),
                                     [](const auto& entry) { return entry.second.active(); });
}

std::vector<LinkShape> LinkEmulation::outgoing(int rank, int world_size) const {
  std::vector<const LinkShape*> special(static_cast<size_t>(std::max(world_size, 0)), nullptr);
  for (const auto& [r, shape] : ranks) {
    if (r < 0 || r >= world_size)
      throw Error("link emulation names rank " + std::to_string(r) + " (expected a rank in [0, " +
                  std::to_string(world_size) + "))");
    special[static_cast<size_t>(r)] = &shape;
  }
  std::vector<LinkShape> shapes(special.size(), all);
  if (rank < 0 || rank >= world_size) return shapes;
  for (int peer = 0; peer < world_size; ++peer) {
    const LinkShape* mine = special[static_cast<size_t>(rank)];
    const LinkShape* theirs = special[static_cast<size_t>(peer)];
    LinkShape& s = shapes[static_cast<size_t>(peer)];
    if (peer == rank)
      s = LinkShape{};
    else if (mine && theirs)
      s = slower(*mine, *theirs);
    else if (mine || theirs)
      s = mine ? *mine : *theirs;
  }
  return shapes;
}

// ---------------------------------------------------------------------------------------------

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
