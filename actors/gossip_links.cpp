#include "actors/gossip_links.h"

#include <algorithm>
#include <caf/all.hpp>

#include "actors/atoms.h"
#include "actors/handoff.h"

namespace troupe::actors {

namespace {

// How long links told at the deadline that their peer is dead may take to answer: failing a peer
// ends its operations at once, so this is only a backstop against a link that never answers.
constexpr std::chrono::seconds kFailGrace{10};

bool contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

}  // namespace

GossipLinks::GossipLinks(caf::actor_system& system, std::shared_ptr<comm::Transport> transport,
                         uint32_t key_prefix)
    : system_(system),
      transport_(std::move(transport)),
      key_prefix_(key_prefix),
      self_(std::make_unique<caf::scoped_actor>(system)) {}

GossipLinks::~GossipLinks() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [peer, link] : links_) (*self_)->send_exit(link, caf::exit_reason::user_shutdown);
}

void GossipLinks::add(EdgeSettings settings) {
  settings.key_prefix = key_prefix_;
  const int peer = settings.peer;
  std::lock_guard<std::mutex> lock(mutex_);
  if (links_.count(peer))
    throw comm::Error("gossip links of rank " + std::to_string(transport_->rank()) +
                      ": a second link to rank " + std::to_string(peer));
  links_.emplace(peer, spawn_gossip_link(system_, std::move(settings), transport_));
}

caf::actor GossipLinks::link(int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = links_.find(peer);
  if (it != links_.end()) return it->second;
  EdgeSettings settings;
  settings.peer = peer;
  settings.key_prefix = key_prefix_;
  return links_.emplace(peer, spawn_gossip_link(system_, std::move(settings), transport_))
      .first->second;
}

void GossipLinks::start(uint64_t round, const void* data, size_t bytes,
                        const std::vector<int>& send_to, const std::vector<int>& recv_from) {
  if (in_flight_)
    throw comm::Error("gossip round " + std::to_string(round) + " on rank " +
                      std::to_string(transport_->rank()) + ": round " + std::to_string(round_) +
                      " is still in flight (wait for it first)");
  std::vector<int> peers = send_to;
  for (int p : recv_from)
    if (!contains(peers, p)) peers.push_back(p);
  round_ = round;
  recv_from_ = recv_from;
  waiting_ = peers;
  in_flight_ = true;
  handoff_release();  // `data`, for the links (actors/handoff.h)
  for (int p : peers) {
    EdgeRound r;
    r.round = round;
    r.send = contains(send_to, p);
    r.receive = contains(recv_from, p);
    r.data = data;
    r.bytes = bytes;
    (*self_)->send(link(p), exchange_atom::value, r);
  }
}

RoundOutcome GossipLinks::wait(std::chrono::steady_clock::time_point deadline,
                               const std::string& what) {
  if (!in_flight_) throw comm::Error(what + ": no round in flight to wait for");
  const auto started = std::chrono::steady_clock::now();
  std::map<int, EdgeResult> answers;
  // Collects answers until every link has answered (true) or `until` (false).
  auto collect = [&](std::chrono::steady_clock::time_point until) {
    while (!waiting_.empty()) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= until) return false;
      (*self_)->receive(
          [&](edge_done_atom, const EdgeResult& r) {
            if (r.round != round_) return;  // a late answer to an earlier, abandoned round
            auto at = std::find(waiting_.begin(), waiting_.end(), r.peer);
            if (at == waiting_.end()) return;
            waiting_.erase(at);
            answers[r.peer] = r;
          },
          caf::after(until - now) >> [] {});
    }
    return true;
  };
  if (!collect(deadline)) {
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    for (int peer : waiting_)
      fail(peer, what + ": no message from rank " + std::to_string(peer) + " after " +
                     comm::number_text(waited) + " s");
    if (!collect(std::chrono::steady_clock::now() + kFailGrace)) {
      in_flight_ = false;
      throw comm::Error(what + ": the peer links to rank(s) " + rank_list(waiting_) +
                        " did not answer within " + std::to_string(kFailGrace.count()) +
                        " s of being failed");
    }
  }
  in_flight_ = false;
  handoff_acquire();  // what the links received
  RoundOutcome out;
  for (auto& [peer, r] : answers) {
    out.bytes_sent += r.bytes_sent;
    out.bytes_received += r.bytes_received;
    if (!r.ok) out.failed.emplace_back(peer, r.error);
  }
  for (int p : recv_from_) {
    const EdgeResult& r = answers.at(p);
    if (r.ok) {
      out.received.push_back(p);
      out.values.push_back(r.values);
    }
  }
  return out;
}

void GossipLinks::fail(int peer, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = links_.find(peer);
  if (it != links_.end()) caf::anon_send(it->second, fail_atom::value, reason);
}

}  // namespace troupe::actors
