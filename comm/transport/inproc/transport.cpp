#include "comm/transport/inproc/transport.h"

#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/reduce.h"

namespace troupe::comm {

namespace {

struct PendingSend {
  Tag tag;
  const void* data;
  size_t bytes;
  Callback done;
};

struct PendingRecv {
  Tag tag;
  void* data;
  size_t bytes;
  Callback done;
};

// Operations addressed to one rank from one source, waiting for their match.
struct Channel {
  std::deque<PendingSend> sends;
  std::deque<PendingRecv> recvs;
};

}  // namespace

struct InprocFabric::State {
  explicit State(int world) : world_size(world), mailboxes(static_cast<size_t>(world)) {
    for (auto& m : mailboxes) m.channels.resize(static_cast<size_t>(world));
  }
  struct Mailbox {
    std::mutex mutex;
    std::vector<Channel> channels;  // indexed by source rank
  };
  int world_size;
  std::vector<Mailbox> mailboxes;  // indexed by destination rank
  std::mutex dead_mutex;
  std::vector<std::string> dead_reason;  // per rank pair (a * world + b), set by fail_peer

  std::string dead_between(int a, int b) {
    std::lock_guard<std::mutex> lock(dead_mutex);
    if (dead_reason.empty()) return {};
    return dead_reason[static_cast<size_t>(a * world_size + b)];
  }
};

namespace {

void finish_match(const PendingSend& s, const PendingRecv& r, int src, int dst) {
  if (s.bytes != r.bytes) {
    std::string msg = "inproc: message from rank " + std::to_string(src) + " to rank " +
                      std::to_string(dst) + " with tag " + std::to_string(r.tag) + " has " +
                      std::to_string(s.bytes) + " bytes, but the receive expects " +
                      std::to_string(r.bytes);
    r.done(Status::failure(msg, src));
    s.done(Status::failure(msg, dst));
    return;
  }
  if (s.bytes) comm::copy(r.data, s.data, s.bytes);
  r.done(Status::success());
  s.done(Status::success());
}

class InprocTransport final : public Transport {
 public:
  InprocTransport(std::shared_ptr<InprocFabric::State> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return state_->world_size; }
  std::string name() const override { return "inproc"; }

  void send(int peer, Tag tag, const void* data, size_t bytes, Callback done) override {
    if (!check_peer(peer, done)) return;
    auto& box = state_->mailboxes[static_cast<size_t>(peer)];
    std::unique_lock<std::mutex> lock(box.mutex);
    auto& ch = box.channels[static_cast<size_t>(rank_)];
    std::string reason = failed(peer);
    if (!reason.empty()) {
      lock.unlock();
      done(Status::failure(reason, peer));
      return;
    }
    for (auto it = ch.recvs.begin(); it != ch.recvs.end(); ++it) {
      if (it->tag != tag) continue;
      PendingRecv r = std::move(*it);
      ch.recvs.erase(it);
      lock.unlock();
      finish_match(PendingSend{tag, data, bytes, std::move(done)}, r, rank_, peer);
      return;
    }
    ch.sends.push_back(PendingSend{tag, data, bytes, std::move(done)});
  }

  void recv(int peer, Tag tag, void* data, size_t bytes, Callback done) override {
    if (!check_peer(peer, done)) return;
    auto& box = state_->mailboxes[static_cast<size_t>(rank_)];
    std::unique_lock<std::mutex> lock(box.mutex);
    auto& ch = box.channels[static_cast<size_t>(peer)];
    std::string reason = failed(peer);
    if (!reason.empty()) {
      lock.unlock();
      done(Status::failure(reason, peer));
      return;
    }
    for (auto it = ch.sends.begin(); it != ch.sends.end(); ++it) {
      if (it->tag != tag) continue;
      PendingSend s = std::move(*it);
      ch.sends.erase(it);
      lock.unlock();
      finish_match(s, PendingRecv{tag, data, bytes, std::move(done)}, peer, rank_);
      return;
    }
    ch.recvs.push_back(PendingRecv{tag, data, bytes, std::move(done)});
  }

  void fail_peer(int peer, const std::string& reason) override {
    if (peer < 0 || peer >= world_size()) return;
    {
      std::lock_guard<std::mutex> lock(state_->dead_mutex);
      if (state_->dead_reason.empty())
        state_->dead_reason.resize(static_cast<size_t>(world_size() * world_size()));
      auto& slot = state_->dead_reason[static_cast<size_t>(rank_ * world_size() + peer)];
      if (slot.empty()) slot = reason.empty() ? "rank " + std::to_string(peer) + " failed" : reason;
    }
    // Fail what this rank posted with the peer: sends waiting in the peer's mailbox and receives
    // waiting in ours.
    std::vector<Callback> to_fail;
    {
      auto& box = state_->mailboxes[static_cast<size_t>(peer)];
      std::lock_guard<std::mutex> lock(box.mutex);
      auto& ch = box.channels[static_cast<size_t>(rank_)];
      for (auto& s : ch.sends) to_fail.push_back(std::move(s.done));
      ch.sends.clear();
    }
    {
      auto& box = state_->mailboxes[static_cast<size_t>(rank_)];
      std::lock_guard<std::mutex> lock(box.mutex);
      auto& ch = box.channels[static_cast<size_t>(peer)];
      for (auto& r : ch.recvs) to_fail.push_back(std::move(r.done));
      ch.recvs.clear();
    }
    std::string why = failed(peer);
    for (auto& cb : to_fail) cb(Status::failure(why, peer));
  }

 private:
  bool check_peer(int peer, const Callback& done) {
    if (peer >= 0 && peer < world_size()) return true;
    done(Status::failure("inproc: peer rank " + std::to_string(peer) + " is outside [0, " +
                         std::to_string(world_size()) + ")"));
    return false;
  }
  std::string failed(int peer) { return state_->dead_between(rank_, peer); }

  std::shared_ptr<InprocFabric::State> state_;
  int rank_;
};

}  // namespace

InprocFabric::InprocFabric(int world_size) {
  if (world_size < 1)
    throw Error("InprocFabric: world size " + std::to_string(world_size) + " is not >= 1");
  state_ = std::make_shared<State>(world_size);
}

InprocFabric::~InprocFabric() = default;

int InprocFabric::world_size() const { return state_->world_size; }

std::shared_ptr<Transport> InprocFabric::transport(int rank) {
  if (rank < 0 || rank >= state_->world_size)
    throw Error("InprocFabric: rank " + std::to_string(rank) + " is outside [0, " +
                std::to_string(state_->world_size) + ")");
  return std::make_shared<InprocTransport>(state_, rank);
}

}  // namespace troupe::comm
