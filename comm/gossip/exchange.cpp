#include "comm/gossip/exchange.h"

#include <algorithm>
#include <map>

#include "comm/status.h"

namespace troupe::comm {

NeighborExchange::NeighborExchange(std::shared_ptr<Transport> transport, std::vector<Op> ops)
    : transport_(std::move(transport)), ops_(std::move(ops)), remaining_(ops_.size()) {}

std::shared_ptr<NeighborExchange> NeighborExchange::start(std::shared_ptr<Transport> transport,
                                                          Tag tag, const void* send, size_t bytes,
                                                          std::vector<int> send_to,
                                                          std::vector<int> recv_from,
                                                          std::vector<void*> recv_buffers) {
  if (recv_buffers.size() != recv_from.size())
    throw Error("gossip round: " + std::to_string(recv_buffers.size()) + " receive buffers for " +
                std::to_string(recv_from.size()) + " peers");
  const int me = transport->rank(), world = transport->world_size();
  auto check = [&](const std::vector<int>& peers, const char* list) {
    for (size_t i = 0; i < peers.size(); ++i) {
      if (peers[i] < 0 || peers[i] >= world || peers[i] == me)
        throw Error(std::string("gossip round: ") + list + " peer " + std::to_string(peers[i]) +
                    " of rank " + std::to_string(me) + ", expected another rank in [0, " +
                    std::to_string(world) + ")");
      if (std::count(peers.begin(), peers.end(), peers[i]) > 1)
        throw Error(std::string("gossip round: ") + list + " names rank " +
                    std::to_string(peers[i]) + " twice");
    }
  };
  check(send_to, "send_to");
  check(recv_from, "recv_from");
  std::vector<Op> ops;
  auto add = [&](int peer, bool is_send) {
    Op op;
    op.peer = peer;
    op.is_send = is_send;
    op.bytes = bytes;
    ops.push_back(std::move(op));
  };
  for (int p : send_to) add(p, true);
  for (int p : recv_from) add(p, false);
  std::shared_ptr<NeighborExchange> round(new NeighborExchange(transport, std::move(ops)));
  // Post after construction so that callbacks completing at once find the round whole.
  for (size_t i = 0; i < send_to.size(); ++i)
    transport->send(send_to[i], tag, send, bytes,
                    [round, i](const Status& s) { round->complete(i, s); });
  for (size_t i = 0; i < recv_from.size(); ++i) {
    size_t index = send_to.size() + i;
    transport->recv(recv_from[i], tag, recv_buffers[i], bytes,
                    [round, index](const Status& s) { round->complete(index, s); });
  }
  return round;
}

void NeighborExchange::complete(size_t index, const Status& status) {
  std::function<void()> done_fn;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Op& op = ops_[index];
    if (op.done) return;
    op.done = true;
    op.ok = status.ok();
    if (!status.ok()) op.error = status.message();
    if (--remaining_ == 0) done_fn = std::move(on_done_);
  }
  cv_.notify_all();
  if (done_fn) done_fn();
}

bool NeighborExchange::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return remaining_ == 0;
}

void NeighborExchange::on_done(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (remaining_ != 0) {
      on_done_ = std::move(fn);
      return;
    }
  }
  fn();
}

std::vector<int> NeighborExchange::pending_peers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int> peers;
  for (const auto& op : ops_)
    if (!op.done) peers.push_back(op.peer);
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

ExchangeOutcome NeighborExchange::outcome() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ExchangeOutcome out;
  std::map<int, std::string> failed;
  for (const auto& op : ops_) {
    if (!op.done) continue;
    if (!op.ok) {
      failed.emplace(op.peer, op.error);
    } else if (op.is_send) {
      out.bytes_sent += op.bytes;
    } else {
      out.bytes_received += op.bytes;
    }
  }
  for (const auto& op : ops_)
    if (!op.is_send && op.done && op.ok && !failed.count(op.peer)) out.received.push_back(op.peer);
  out.failed.assign(failed.begin(), failed.end());
  return out;
}

ExchangeOutcome NeighborExchange::wait(std::chrono::steady_clock::time_point deadline,
                                       const std::string& what) {
  const auto started = std::chrono::steady_clock::now();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait_until(lock, deadline, [&] { return remaining_ == 0; });
  }
  auto silent = pending_peers();
  if (!silent.empty()) {
    auto waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    auto transport = transport_.lock();
    for (int peer : silent)
      if (transport)
        transport->fail_peer(peer, what + ": no message from rank " + std::to_string(peer) +
                                       " after " + number_text(waited) + " s");
    // fail_peer ends the pending operations; their callbacks may still be on their way.
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, std::chrono::seconds(10), [&] { return remaining_ == 0; }))
      throw Error(what + ": operations with failed ranks did not end within 10 s");
  }
  return outcome();
}

void mix(float* out, const float* self, double self_weight, const std::vector<const float*>& others,
         const std::vector<double>& weights, size_t n) {
  constexpr size_t kBlock = 4096;  // 16 KiB per operand: the block stays in L1/L2 between passes
  const float ws = static_cast<float>(self_weight);
  for (size_t begin = 0; begin < n; begin += kBlock) {
    const size_t end = std::min(n, begin + kBlock);
    float* o = out + begin;  // may be self: same index only
    const float* s = self + begin;
    const size_t len = end - begin;
    for (size_t i = 0; i < len; ++i) o[i] = ws * s[i];
    for (size_t j = 0; j < others.size(); ++j) {
      const float w = static_cast<float>(weights[j]);
      const float* x = others[j] + begin;
      for (size_t i = 0; i < len; ++i) o[i] += w * x[i];
    }
  }
}

}  // namespace troupe::comm
