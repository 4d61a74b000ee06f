#include "actors/directory.h"

#include <caf/all.hpp>

#include <map>
#include <string>
#include <vector>

#include "actors/atoms.h"

namespace troupe::actors {

namespace {

struct Member {
  std::string host;
  std::string address;
  std::string extra;
  caf::actor worker;
  caf::response_promise reply;
  bool gone = false;
};

struct DirectoryState {
  int world_size = 0;
  std::map<int, Member> members;
  bool complete = false;
  std::string failure;  // set once the rendezvous has failed; later registrations get it too
  static inline const char* name = "troupe.directory";
};

using Directory = caf::stateful_actor<DirectoryState>;

/// "2, 5" or, past `shown` ranks, "3, 4, 5, ... (65532 in all)": a message for a job of 65,536
/// ranks stays one line.
std::string list(const std::vector<int>& ranks, size_t shown = 8) {
  std::string s;
  for (size_t i = 0; i < ranks.size() && i < shown; ++i)
    s += (s.empty() ? "" : ", ") + std::to_string(ranks[i]);
  if (ranks.size() > shown) s += ", ... (" + std::to_string(ranks.size()) + " in all)";
  return s;
}

void fail_all(Directory* self, const std::string& why) {
  self->state.failure = why;
  for (auto& [rank, m] : self->state.members)
    if (m.reply.pending())
      m.reply.deliver(table_atom::value, false, why, std::vector<std::string>{},
                      std::vector<std::string>{}, std::vector<std::string>{});
}

void tell_survivors(Directory* self, int rank, const std::string& why, bool fatal) {
  for (auto& [r, m] : self->state.members)
    if (r != rank && !m.gone) self->send(m.worker, peer_down_atom::value, rank, why, fatal);
}

using TableReply = caf::result<table_atom, bool, std::string, std::vector<std::string>,
                               std::vector<std::string>, std::vector<std::string>>;

/// A member's worker died: after the rendezvous its survivors hear of it; before, it is forgotten.
void on_down(Directory* self, const caf::down_msg& down) {
  for (auto& [rank, m] : self->state.members) {
    if (m.gone || m.worker.address() != down.source) continue;
    m.gone = true;
    if (self->state.complete) {
      tell_survivors(self, rank,
                     "rank " + std::to_string(rank) + " (on " + m.host +
                         ") died: its connection to the rendezvous was lost",
                     true);
    } else if (m.reply.pending()) {
      // Died while waiting: forget it, so that the deadline names it as missing.
      m.reply = caf::response_promise{};
    }
  }
}

/// Why rank `rank` of `world` ranks on `host` cannot register now; empty when it can.
std::string registration_error(const DirectoryState& st, int rank, int world,
                               const std::string& host) {
  if (!st.failure.empty()) return st.failure;
  if (st.complete)
    return "rank " + std::to_string(rank) + " registered after the rendezvous of all " +
           std::to_string(st.world_size) + " ranks had completed";
  if (world != st.world_size)
    return "world size mismatch: rank " + std::to_string(rank) + " on " + host +
           " has WORLD_SIZE=" + std::to_string(world) + ", but rank 0 started the job with " +
           std::to_string(st.world_size);
  if (rank < 0 || rank >= st.world_size)
    return "rank " + std::to_string(rank) + " on " + host + " is outside [0, " +
           std::to_string(st.world_size) + ")";
  if (auto it = st.members.find(rank); it != st.members.end() && !it->second.gone)
    return "duplicate rank: rank " + std::to_string(rank) + " registered twice (from " +
           it->second.host + " and from " + host + ")";
  return {};
}

/// Once every rank registered and none is gone: the table to each of them.
void complete_if_all_here(Directory* self) {
  auto& st = self->state;
  if (static_cast<int>(st.members.size()) != st.world_size) return;
  for (auto& [r, m] : st.members)
    if (m.gone) return;
  std::vector<std::string> hosts, addresses, extras;
  for (auto& [r, m] : st.members) {
    hosts.push_back(m.host);
    addresses.push_back(m.address);
    extras.push_back(m.extra);
  }
  st.complete = true;
  for (auto& [r, m] : st.members)
    m.reply.deliver(table_atom::value, true, std::string{}, hosts, addresses, extras);
}

TableReply register_rank(Directory* self, int rank, int world, const std::string& host,
                         const std::string& address, const std::string& extra,
                         const caf::actor& worker) {
  const std::string why = registration_error(self->state, rank, world, host);
  if (!why.empty()) {
    fail_all(self, why);
    return {table_atom::value,
            false,
            why,
            std::vector<std::string>{},
            std::vector<std::string>{},
            std::vector<std::string>{}};
  }
  self->monitor(worker);
  Member m{host, address, extra, worker, self->make_response_promise(), false};
  self->state.members[rank] = std::move(m);
  complete_if_all_here(self);
  return caf::delegated<table_atom, bool, std::string, std::vector<std::string>,
                        std::vector<std::string>, std::vector<std::string>>{};
}

/// The deadline: the ranks that never arrived fail the rendezvous.
void time_out(Directory* self, std::chrono::milliseconds deadline) {
  auto& st = self->state;
  if (st.complete || !st.failure.empty()) return;
  std::vector<int> missing;
  for (int r = 0; r < st.world_size; ++r) {
    auto it = st.members.find(r);
    if (it == st.members.end() || it->second.gone) missing.push_back(r);
  }
  fail_all(self, "rendezvous timed out after " + std::to_string(deadline.count()) +
                     " ms: rank(s) " + list(missing) + " never arrived (world size " +
                     std::to_string(st.world_size) + ")");
}

/// Rank `rank` failed or left: marks it gone and stops watching it; null when it was gone already.
const Member* take_out(Directory* self, int rank) {
  auto it = self->state.members.find(rank);
  if (it == self->state.members.end() || it->second.gone) return nullptr;
  it->second.gone = true;
  self->demonitor(it->second.worker);
  return &it->second;
}

caf::behavior directory(Directory* self, int world_size, std::chrono::milliseconds deadline) {
  self->state.world_size = world_size;
  self->delayed_send(self, deadline, deadline_atom::value);
  self->set_down_handler([self](const caf::down_msg& down) { on_down(self, down); });
  return {
      [self](register_atom, int rank, int world, const std::string& host,
             const std::string& address, const std::string& extra,
             const caf::actor& worker) -> TableReply {
        return register_rank(self, rank, world, host, address, extra, worker);
      },
      [self, deadline](deadline_atom) { time_out(self, deadline); },
      [self](failed_atom, int rank, const std::string& reason) {
        if (const Member* m = take_out(self, rank))
          tell_survivors(self, rank,
                         "rank " + std::to_string(rank) + " (on " + m->host + ") failed: " + reason,
                         true);
        return true;
      },
      [](flush_atom) { return true; },
      [self](leave_atom, int rank) {
        if (take_out(self, rank))
          tell_survivors(self, rank, "rank " + std::to_string(rank) + " left the job", false);
        return true;
      },
  };
}

}  // namespace

caf::actor spawn_directory(caf::actor_system& system, int world_size,
                           std::chrono::milliseconds deadline) {
  return system.spawn(directory, world_size, deadline);
}

}  // namespace troupe::actors
