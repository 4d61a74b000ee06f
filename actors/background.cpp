#include "actors/background.h"

#include <caf/all.hpp>

#include <algorithm>
#include <cstring>
#include <iostream>

#include "actors/execution_post.h"
#include "actors/peer_link.h"
#include "comm/collectives/schedule.h"
#include "comm/tags.h"

namespace troupe::actors {
namespace {

using averager_actor =
    background_actor::extend<caf::reacts_to<tick_atom, uint64_t>,
                             caf::reacts_to<run_atom, std::function<void()>>,
                             caf::reacts_to<round_atom, bool, std::string, uint64_t, uint64_t>,
                             caf::reacts_to<force_atom, std::string>>;
using gossiper_actor = background_actor::extend<caf::reacts_to<tick_atom, uint64_t>,
                                                caf::reacts_to<arrived_atom, StreamArrival>,
                                                caf::reacts_to<posted_atom, StreamSent>>;
using StopPromise = caf::typed_response_promise<stopped_atom, bool, std::string>;

// ---------------------------------------------------------------------------------------------
// averager

struct AveragerState {
  ModelAccess model;
  AveragerSettings settings;
  std::shared_ptr<comm::Transport> transport;
  std::shared_ptr<BackgroundStats> stats;
  std::vector<float> snapshot;
  uint64_t generation = 0;  // the snapshot's
  std::vector<float> work;  // the snapshot and, last, the stop flag: averaged together
  uint32_t round = 0;
  bool running = false;  // rounds are on
  bool in_round = false;
  bool stop_requested = false;
  uint64_t timer = 0;  // ticks of older start_atoms are ignored
  std::string error;
  std::vector<StopPromise> waiting_stop;
  std::shared_ptr<std::mutex> inline_lock;
  std::shared_ptr<comm::Execution> execution;
  static inline const char* name = "troupe.averager";
};
using Averager = averager_actor::stateful_pointer<AveragerState>;

void answer_stop(Averager self) {
  auto& st = self->state;
  for (auto& p : st.waiting_stop) p.deliver(stopped_atom::value, st.error.empty(), st.error);
  st.waiting_stop.clear();
}

void start_round(Averager self) {
  auto& st = self->state;
  st.in_round = true;
  const size_t n = st.model.count;
  st.generation = st.model.snapshot(st.snapshot.data());
  std::memcpy(st.work.data(), st.snapshot.data(), n * sizeof(float));
  st.work[n] = st.stop_requested ? 1.0f : 0.0f;
  const comm::Group group{st.transport->rank(), st.transport->world_size()};
  auto schedule = comm::allreduce_schedule(group, st.work.data(), n + 1, comm::DataType::float32,
                                           comm::ReduceOp::avg, st.settings.collectives);
  auto me = caf::actor_cast<averager_actor>(self);
  comm::Post post = ActorThread(me).execution_post(*st.transport, st.inline_lock);
  const uint32_t key = comm::tags::round_key(st.settings.key_prefix, st.round);
  auto execution = std::make_shared<comm::Execution>(st.transport, key, std::move(schedule), post);
  execution->on_done([me, raw = execution.get()](const comm::Status& status) {
    caf::anon_send(me, round_atom::value, status.ok(), status.message(),
                   static_cast<uint64_t>(raw->bytes_sent()),
                   static_cast<uint64_t>(raw->bytes_received()));
  });
  st.execution = execution;
  if (st.inline_lock) {
    std::lock_guard<std::mutex> guard(*st.inline_lock);
    execution->start();
  } else {
    execution->start();
  }
}

// Ends the rounds early for `error`, which BackgroundStats and the answer to stop_atom report.
void end_rounds(Averager self, std::string error) {
  auto& st = self->state;
  st.error = std::move(error);
  {
    std::lock_guard<std::mutex> lock(st.stats->mutex);
    st.stats->error = st.error;
  }
  st.running = false;
  answer_stop(self);
}

// Runs `fn` on the round's execution, under the transport's callback lock where it has one.
template <class Fn>
void with_execution(AveragerState& st, Fn&& fn) {
  if (st.inline_lock) {
    std::lock_guard<std::mutex> guard(*st.inline_lock);
    fn(*st.execution);
  } else {
    fn(*st.execution);
  }
}

// The round's allreduce ended: apply the average, then stop (the flag was raised on some rank)
// or wait for the next tick.
void round_ended(Averager self, bool ok, const std::string& error, uint64_t sent,
                 uint64_t received) {
  auto& st = self->state;
  st.in_round = false;
  st.execution.reset();
  ++st.round;
  st.stats->bytes_sent += sent;
  st.stats->bytes_received += received;
  if (!ok)
    return end_rounds(
        self, "asynchronous model average, round " + std::to_string(st.round - 1) + ": " + error);
  const size_t n = st.model.count;
  const bool stop = st.work[n] > 0;
  st.model.apply(st.work.data(), st.snapshot.data(), 1.0f, st.generation);
  ++st.stats->rounds;
  if (stop) {
    st.running = false;
    st.stop_requested = false;
    answer_stop(self);
  } else if (st.running) {
    self->delayed_send(self, st.settings.interval, tick_atom::value, ++st.timer);
  }
}

// Rank `peer` is gone: between rounds the rounds end now; a round in flight cannot complete
// without it, so nothing more is posted, and what still waits on live ranks fails after the
// grace (force_atom); round_atom then reports the reason.
void rank_lost(Averager self, const std::string& reason, int peer) {
  auto& st = self->state;
  if (!st.error.empty()) return;
  if (!st.in_round)
    return end_rounds(self, "asynchronous model average, before round " + std::to_string(st.round) +
                                ": " + reason);
  with_execution(st, [&](comm::Execution& e) { e.abort(comm::Status::failure(reason, peer)); });
  self->delayed_send(self, st.settings.failure_grace, force_atom::value, reason);
}

// The failure grace has passed: the peers the round still waits for are failed.
void fail_stragglers(Averager self, const std::string& reason) {
  auto& st = self->state;
  if (!st.execution) return;
  std::vector<int> waiting;
  with_execution(st, [&](comm::Execution& e) {
    if (!e.done()) waiting = e.waiting_on();
  });
  for (int p : waiting) st.transport->fail_peer(p, reason);
}

averager_actor::behavior_type averager_behavior(Averager self, ModelAccess model,
                                                AveragerSettings settings,
                                                std::shared_ptr<comm::Transport> transport,
                                                std::shared_ptr<BackgroundStats> stats) {
  auto& st = self->state;
  st.model = std::move(model);
  st.settings = settings;
  st.transport = std::move(transport);
  st.stats = std::move(stats);
  st.snapshot.resize(st.model.count);
  st.work.resize(st.model.count + 1);
  return {
      [self](start_atom) {
        auto& st = self->state;
        if (st.running || !st.error.empty()) return;
        st.running = true;
        st.stop_requested = false;
        self->delayed_send(self, st.settings.interval, tick_atom::value, ++st.timer);
      },
      [self](tick_atom, uint64_t timer) {
        auto& st = self->state;
        if (!st.running || st.in_round || timer != st.timer) return;
        start_round(self);
      },
      [](run_atom, std::function<void()>& fn) { fn(); },
      [self](round_atom, bool ok, const std::string& error, uint64_t sent, uint64_t received) {
        round_ended(self, ok, error, sent, received);
      },
      [self](abort_atom, const std::string& reason, int peer) { rank_lost(self, reason, peer); },
      [self](force_atom, const std::string& reason) { fail_stragglers(self, reason); },
      [self](stop_atom) -> caf::result<stopped_atom, bool, std::string> {
        auto& st = self->state;
        if (!st.running) return {stopped_atom::value, st.error.empty(), st.error};
        st.waiting_stop.push_back(self->make_response_promise<stopped_atom, bool, std::string>());
        st.stop_requested = true;
        if (!st.in_round) start_round(self);
        return caf::delegated<stopped_atom, bool, std::string>();
      },
  };
}

// ---------------------------------------------------------------------------------------------
// gossiper

enum class Kind : uint32_t { request = 1, reply = 2, bye = 3 };
constexpr size_t kHeader = 8;  // {kind, unused}: keeps the floats 4-byte aligned

struct Neighbour {
  int rank = -1;
  caf::actor link;  // the peer link of the edge: its message stream, sequence numbers, buffer
  bool alive = true;
  bool bye_received = false;
};

struct GossiperState {
  ModelAccess model;
  GossiperSettings settings;
  std::shared_ptr<comm::Transport> transport;
  std::shared_ptr<BackgroundStats> stats;
  std::vector<Neighbour> neighbours;
  size_t message_bytes = 0;
  bool started = false;
  bool stopping = false;
  bool byes_sent = false;
  bool finished = false;
  int outstanding = -1;     // index into neighbours of the exchange in flight
  int sends_in_flight = 0;  // a rank has finished only when its last bye has left
  std::vector<float> request_snapshot;
  uint64_t request_generation = 0;
  std::vector<float> scratch;
  uint64_t rng = 0;
  std::vector<StopPromise> waiting_stop;
  static inline const char* name = "troupe.gossiper";
};
using Gossiper = gossiper_actor::stateful_pointer<GossiperState>;

uint64_t next_random(uint64_t& state) {  // splitmix64
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void drop(Gossiper self, size_t index, const std::string& reason);
void maybe_finish(Gossiper self);

void post_receive(Gossiper self, size_t index) {
  auto& st = self->state;
  auto& nb = st.neighbours[index];
  // After its bye a neighbour sends nothing more but the reply to our request in flight.
  if (!nb.alive || (nb.bye_received && st.outstanding != static_cast<int>(index))) return;
  caf::send_as(caf::actor_cast<caf::actor>(self), nb.link, listen_atom::value);
}

// The index in st.neighbours of `rank`, or -1.
int index_of(const GossiperState& st, int rank) {
  for (size_t i = 0; i < st.neighbours.size(); ++i)
    if (st.neighbours[i].rank == rank) return static_cast<int>(i);
  return -1;
}

// Sends kind + payload (count floats, or nothing meaningful for bye) to neighbour `index`.
void send_message(Gossiper self, size_t index, Kind kind, const float* payload) {
  auto& st = self->state;
  auto& nb = st.neighbours[index];
  auto message = std::make_shared<std::vector<char>>(st.message_bytes, 0);
  const uint32_t k = static_cast<uint32_t>(kind);
  std::memcpy(message->data(), &k, sizeof(k));
  if (payload) std::memcpy(message->data() + kHeader, payload, st.model.count * sizeof(float));
  ++st.sends_in_flight;
  caf::send_as(caf::actor_cast<caf::actor>(self), nb.link, post_atom::value,
               StreamMessage{std::move(message)});
}

// x += (other - snapshot) / 2: the pairwise average. The two sides apply exact negatives of each
// other, so the sum of the models is kept.
void apply_half(GossiperState& st, const float* other, const float* snapshot, uint64_t generation) {
  st.model.apply(other, snapshot, 0.5f, generation);
  ++st.stats->rounds;
}

void send_byes(Gossiper self) {
  auto& st = self->state;
  if (st.byes_sent) return;
  st.byes_sent = true;
  for (size_t i = 0; i < st.neighbours.size(); ++i)
    if (st.neighbours[i].alive) send_message(self, i, Kind::bye, nullptr);
}

void maybe_finish(Gossiper self) {
  auto& st = self->state;
  if (!st.stopping || st.outstanding >= 0) return;
  send_byes(self);
  for (const auto& nb : st.neighbours)
    if (nb.alive && !nb.bye_received) return;
  // A send may still wait in a queue below (link emulation): it must leave before the rank goes.
  if (st.sends_in_flight > 0) return;
  st.finished = true;
  for (auto& p : st.waiting_stop) p.deliver(stopped_atom::value, true, std::string());
  st.waiting_stop.clear();
}

void drop(Gossiper self, size_t index, const std::string& reason) {
  auto& st = self->state;
  auto& nb = st.neighbours[index];
  if (!nb.alive) return;
  nb.alive = false;
  {
    std::lock_guard<std::mutex> lock(st.stats->mutex);
    st.stats->dropped.push_back(nb.rank);
  }
  std::cerr << "troupe: asynchronous gossip on rank " << st.transport->rank() << " dropped rank "
            << nb.rank << ": " << reason << "\n";
  if (st.outstanding == static_cast<int>(index)) st.outstanding = -1;
  maybe_finish(self);
}

void initiate(Gossiper self) {
  auto& st = self->state;
  std::vector<size_t> live;
  for (size_t i = 0; i < st.neighbours.size(); ++i)
    if (st.neighbours[i].alive && !st.neighbours[i].bye_received) live.push_back(i);
  if (live.empty()) return;
  const size_t index = live[next_random(st.rng) % live.size()];
  st.request_generation = st.model.snapshot(st.request_snapshot.data());
  send_message(self, index, Kind::request, st.request_snapshot.data());
  st.outstanding = static_cast<int>(index);
}

// A message from neighbour `arrival.peer` came: a request is answered with this rank's snapshot
// and half the difference applied; a reply to this rank's request applies the other half; a bye
// ends that neighbour's part in a stop.
void arrived(Gossiper self, const StreamArrival& arrival) {
  auto& st = self->state;
  const int at = index_of(st, arrival.peer);
  if (at < 0) return;
  const size_t index = static_cast<size_t>(at);
  auto& nb = st.neighbours[index];
  if (!nb.alive) return;
  if (!arrival.ok) return drop(self, index, arrival.error);
  uint32_t kind = 0;
  std::memcpy(&kind, arrival.data, sizeof(kind));
  // Valid until the next listen: the link's buffer.
  const float* payload = reinterpret_cast<const float*>(arrival.data + kHeader);
  switch (static_cast<Kind>(kind)) {
    case Kind::request: {
      const uint64_t generation = st.model.snapshot(st.scratch.data());
      send_message(self, index, Kind::reply, st.scratch.data());
      st.stats->bytes_received += st.message_bytes;
      apply_half(st, payload, st.scratch.data(), generation);
      break;
    }
    case Kind::reply:
      st.stats->bytes_received += st.message_bytes;
      if (st.outstanding == static_cast<int>(index)) {
        apply_half(st, payload, st.request_snapshot.data(), st.request_generation);
        st.outstanding = -1;
      }
      break;
    case Kind::bye:
      nb.bye_received = true;
      break;
    default:
      return drop(self, index, "message of unknown kind " + std::to_string(kind));
  }
  post_receive(self, index);
  maybe_finish(self);
}

// One peer link per neighbour, carrying the two message streams of the edge; the links end with
// the gossiper.
void link_neighbours(Gossiper self) {
  auto& st = self->state;
  for (int r : st.settings.neighbours) {
    Neighbour nb;
    nb.rank = r;
    EdgeSettings edge;
    edge.peer = r;
    edge.key_prefix = st.settings.key_prefix;
    edge.payload = EdgePayload::messages;
    edge.message_bytes = st.message_bytes;
    nb.link = spawn_gossip_link(self->system(), std::move(edge), st.transport);
    self->link_to(nb.link);
    st.neighbours.push_back(std::move(nb));
  }
}

gossiper_actor::behavior_type gossiper_behavior(Gossiper self, ModelAccess model,
                                                GossiperSettings settings,
                                                std::shared_ptr<comm::Transport> transport,
                                                std::shared_ptr<BackgroundStats> stats) {
  auto& st = self->state;
  st.model = std::move(model);
  st.settings = std::move(settings);
  st.transport = std::move(transport);
  st.stats = std::move(stats);
  st.message_bytes = kHeader + st.model.count * sizeof(float);
  st.rng =
      st.settings.seed ^ (0x5851f42d4c957f2dull * static_cast<uint64_t>(st.transport->rank() + 1));
  st.request_snapshot.resize(st.model.count);
  st.scratch.resize(st.model.count);
  link_neighbours(self);
  return {
      [self](start_atom) {
        auto& st = self->state;
        if (st.started && !st.finished) return;
        // First start, or a resume after every neighbour said bye: the streams go on from their
        // sequence numbers (a neighbour that resumed first has its request waiting for us).
        st.started = true;
        st.stopping = false;
        st.byes_sent = false;
        st.finished = false;
        for (auto& nb : st.neighbours) nb.bye_received = false;
        for (size_t i = 0; i < st.neighbours.size(); ++i) post_receive(self, i);
        self->send(self, tick_atom::value, uint64_t{0});
      },
      [self](tick_atom, uint64_t) {
        auto& st = self->state;
        if (st.stopping) return;
        if (st.outstanding < 0) initiate(self);
        self->delayed_send(self, std::max(st.settings.min_interval, std::chrono::milliseconds(1)),
                           tick_atom::value, uint64_t{0});
      },
      [self](arrived_atom, const StreamArrival& arrival) { arrived(self, arrival); },
      [self](posted_atom, const StreamSent& sent) {
        auto& st = self->state;
        const int at = index_of(st, sent.peer);
        if (sent.ok) {
          st.stats->bytes_sent += sent.bytes;
        } else if (at >= 0) {
          drop(self, static_cast<size_t>(at), sent.error);
        }
        --st.sends_in_flight;
        maybe_finish(self);
      },
      [self](abort_atom, const std::string& reason, int rank) {
        auto& st = self->state;
        for (size_t i = 0; i < st.neighbours.size(); ++i)
          if (st.neighbours[i].rank == rank) drop(self, i, reason);
      },
      [self](stop_atom) -> caf::result<stopped_atom, bool, std::string> {
        auto& st = self->state;
        if (st.finished || !st.started) return {stopped_atom::value, true, std::string()};
        st.waiting_stop.push_back(self->make_response_promise<stopped_atom, bool, std::string>());
        st.stopping = true;
        maybe_finish(self);
        return caf::delegated<stopped_atom, bool, std::string>();
      },
  };
}

}  // namespace

Background Background::averager(caf::actor_system& system, ModelAccess model,
                                AveragerSettings settings,
                                std::shared_ptr<comm::Transport> transport,
                                std::shared_ptr<BackgroundStats> stats) {
  return Background(system.spawn(averager_behavior, std::move(model), settings,
                                 std::move(transport), std::move(stats)));
}

Background Background::gossiper(caf::actor_system& system, ModelAccess model,
                                GossiperSettings settings,
                                std::shared_ptr<comm::Transport> transport,
                                std::shared_ptr<BackgroundStats> stats) {
  return Background(system.spawn(gossiper_behavior, std::move(model), std::move(settings),
                                 std::move(transport), std::move(stats)));
}

void Background::start() const { caf::anon_send(actor_, start_atom::value); }

void Background::lost(int rank, const std::string& reason) const {
  caf::anon_send(actor_, abort_atom::value, reason, rank);
}

BackgroundStop Background::stop(std::chrono::milliseconds timeout) const {
  BackgroundStop result;
  auto& system = actor_.home_system();
  caf::scoped_actor self{system};
  self->request(actor_, timeout, stop_atom::value)
      .receive(
          [&](stopped_atom, bool ok, const std::string& error) {
            result.answered = true;
            result.ok = ok;
            result.error = error;
          },
          [&](caf::error& e) {
            result.error = "no answer from the background actor within " +
                           std::to_string(timeout.count()) + " ms: " + system.render(e);
          });
  return result;
}

bool Background::exit_and_wait(std::chrono::milliseconds timeout) const {
  caf::scoped_actor self{actor_.home_system()};
  self->monitor(actor_);
  exit();
  bool gone = false;
  self->receive([&](const caf::down_msg&) { gone = true; }, caf::after(timeout) >> [] {});
  return gone;
}

void Background::exit() const {
  if (actor_) caf::anon_send_exit(actor_, caf::exit_reason::user_shutdown);
}

}  // namespace troupe::actors
