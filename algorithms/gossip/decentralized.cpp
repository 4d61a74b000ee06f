#include "algorithms/gossip/decentralized.h"

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <variant>

#include "actors/gossip_links.h"
#include "actors/node.h"
#include "algorithms/gossip/flat_model.h"
#include "algorithms/gossip/nccl_gossip.h"
#include "comm/codecs/minmax.h"
#include "comm/gossip/exchange.h"
#include "comm/reduce.h"
#include "ddp/wrapped_modules.h"
#include "rank/model_check.h"
#include "rank/module_id.h"
#include "rank/runtime_internal.h"

namespace troupe {

namespace {

std::string exchange_name(Decentralized::Exchange e) {
  return e == Decentralized::Exchange::overlap ? "overlap" : "after_step";
}

}  // namespace

struct DecentralizedModule::Impl {
  Runtime& rt;
  ModuleId id;  // given back last, once the links that use its keys are gone
  std::variant<Decentralized, LowPrecisionDecentralized> algorithm;
  GossipOptions options;
  comm::Topology topology;
  WrappedModule wrapped;  // refuses a second wrapper of the module while this one lives
  gossip::FlatModel flat;
  std::shared_ptr<comm::Transport> transport;
  uint32_t key_prefix;
  int listener = -1;
  int rank;

  uint64_t steps = 0;
  uint64_t rounds = 0;  // gossip rounds started
  bool finished = false;

  // "cpu", "cuda via nccl" or "cuda via host staging"; on the NCCL path, the rounds.
  std::string path;
  std::unique_ptr<gossip::NcclGossip> nccl;

  // Over the transport: one peer link per neighbour (actors/peer_link.h), which carries the
  // rounds over its edge and keeps the edge's state (the neighbour's last weights; Choco-SGD's
  // public copy of the neighbour). Rounds are messages to the links; the trainer waits only where
  // it needs what they brought.
  std::unique_ptr<actors::GossipLinks> links;
  comm::RoundPeers peers;
  uint64_t round_index = 0;
  std::vector<char> send_buffer;  // this rank's message of the round in flight

  // Choco-SGD: the public copy of this rank's own weights (the neighbours' are in the links), and
  // scratch.
  std::vector<float> own_copy;
  std::vector<float> scratch;
  // Choco-SGD: each neighbour's public copy as its link returned it in the last round (valid
  // until the next round starts): what save_state records of the neighbours.
  std::map<int, const float*> neighbour_copies;

  mutable std::mutex stats_mutex;
  CommStats totals;
  std::set<int> dead;

  Impl(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
       std::variant<Decentralized, LowPrecisionDecentralized> algo, GossipOptions opts,
       const comm::TopologySpec& spec, const std::string& what)
      : rt(runtime),
        id(runtime),
        algorithm(std::move(algo)),
        options(opts),
        topology(spec, runtime.world_size()),
        wrapped(module.get(), "DecentralizedModule"),
        flat(runtime, std::move(module), what, opts.broadcast_parameters),
        transport(runtime.transport()),
        key_prefix(id.key_prefix()),
        rank(runtime.rank()) {
    const bool dpsgd = std::holds_alternative<Decentralized>(algorithm);
    if (!flat.on_cuda()) {
      path = "cpu";
      start_links(what);
      return;
    }
    const bool over_nccl = dpsgd && runtime.nccl_available() && !options.stage_through_host;
    path = over_nccl ? "cuda via nccl" : "cuda via host staging";
    // Every rank must take the same path: NCCL's rounds and the transport's never meet.
    check_same_on_every_rank(runtime.comm(), what + " gossips on " + path + "\n");
    if (over_nccl) {
      nccl = std::make_unique<gossip::NcclGossip>(runtime, flat.device(), options.timeout);
    } else {
      start_links(what);
    }
  }

  // The transport path: this module's messages must outlive a neighbour that dies mid-send
  // (registered before the links send anything), then the links.
  void start_links(const std::string& what) {
    gossip::survive_peer_loss(rt, key_prefix, what);
    links = std::make_unique<actors::GossipLinks>(detail::node(rt).system(), transport, key_prefix);
  }

  std::string name() const {
    if (auto* d = std::get_if<Decentralized>(&algorithm))
      return "decentralized(" + topology.describe() + ", " + exchange_name(d->exchange) +
             (d->communication_interval > 1
                  ? ", every " + std::to_string(d->communication_interval) + " steps"
                  : std::string()) +
             ")";
    const auto& l = std::get<LowPrecisionDecentralized>(algorithm);
    return "low_precision_decentralized(" + topology.describe() + ", gamma " +
           comm::number_text(l.gamma) + ")";
  }

  std::vector<int> dead_ranks() const {
    std::lock_guard<std::mutex> lock(stats_mutex);
    return std::vector<int>(dead.begin(), dead.end());
  }

  // Whether `peer` ever exchanges with this rank (every rank may, in a time-varying topology).
  bool is_peer(int peer) const {
    if (topology.time_varying()) return peer != rank;
    auto p = topology.round(rank, 0);
    return std::count(p.recv_from.begin(), p.recv_from.end(), peer) ||
           std::count(p.send_to.begin(), p.send_to.end(), peer);
  }

  void mark_dead(int peer, const std::string& reason) {
    std::lock_guard<std::mutex> lock(stats_mutex);
    if (!dead.insert(peer).second || !is_peer(peer)) return;
    if (links) links->fail(peer, reason);
    if (nccl) {  // NCCL cannot drop a peer: the rounds fail instead of waiting for their deadline
      nccl->abort("rank " + std::to_string(peer) + " died: " + reason);
      return;
    }
    totals.dropped_peers.push_back(peer);
    std::cerr << "troupe: " << name() << " on rank " << rank << " dropped rank " << peer << ": "
              << reason << "\n";
  }

  std::string round_name() const { return name() + " round " + std::to_string(round_index); }

  // The next round's index and peers (without the dead ones).
  void next_round() {
    round_index = rounds++;
    peers = topology.round(rank, round_index, dead_ranks());
  }

  bool round_in_flight() const {
    return (links && links->in_flight()) || (nccl && nccl->in_flight());
  }

  // Hands the next round to the peer links with `bytes` of send_buffer; returns at once.
  void start_round(size_t bytes) {
    next_round();
    links->start(round_index, send_buffer.data(), bytes, peers.send_to, peers.recv_from);
  }

  // Waits for the round in flight. Returns the peers whose values to use (from their links), each
  // with its weight, and this rank's own weight, renormalised over the peers that are still alive.
  struct Mixing {
    double self_weight = 1;
    std::vector<int> peers;
    std::vector<const float*> values;
    std::vector<double> weights;
  };
  Mixing finish_round() {
    auto started = std::chrono::steady_clock::now();
    auto outcome = links->wait(started + options.timeout, round_name());
    count_round(started, outcome.bytes_sent, outcome.bytes_received);
    for (auto& [peer, reason] : outcome.failed) mark_dead(peer, reason);
    auto live = topology.round(rank, round_index, dead_ranks());
    Mixing m;
    m.self_weight = live.self_weight;
    // Every peer still alive has delivered: a peer whose send or receive failed is dead now.
    for (size_t i = 0; i < live.recv_from.size(); ++i) {
      auto at = std::find(outcome.received.begin(), outcome.received.end(), live.recv_from[i]);
      if (at == outcome.received.end())
        throw comm::Error(round_name() + ": rank " + std::to_string(live.recv_from[i]) +
                          " is alive but its peer link brought nothing");
      m.peers.push_back(live.recv_from[i]);
      m.values.push_back(outcome.values[static_cast<size_t>(at - outcome.received.begin())]);
      m.weights.push_back(live.recv_weights[i]);
    }
    return m;
  }

  void count_round(std::chrono::steady_clock::time_point started, size_t sent, size_t received) {
    std::lock_guard<std::mutex> lock(stats_mutex);
    totals.bytes_sent += sent;
    totals.last_step_bytes_sent += sent;
    totals.bytes_received += received;
    totals.comm_wait_sec +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }

  // D-PSGD: posts the next round with this rank's weights as they are now.
  void send_weights() {
    if (nccl) {
      next_round();
      nccl->start(flat.tensor(), peers.send_to, peers.recv_from, round_name());
      return;
    }
    const size_t bytes = flat.count() * sizeof(float);
    send_buffer.resize(bytes);
    flat.pull();
    comm::copy(send_buffer.data(), flat.host(), bytes);
    start_round(bytes);
  }

  // D-PSGD: waits for the round in flight, then x := sum_j W_ij x_j with the weights it brought
  // (this rank's own as it sent them).
  void mix_received() {
    if (nccl) {
      mix_on_device();
      return;
    }
    const Mixing m = finish_round();
    std::lock_guard<std::mutex> lock(flat.mutex());
    comm::mix(flat.host(), reinterpret_cast<const float*>(send_buffer.data()), m.self_weight,
              m.values, m.weights, flat.count());
    flat.push();
  }

  void wait_nccl_round() {
    const auto started = std::chrono::steady_clock::now();
    const auto outcome = nccl->wait(started + options.timeout);
    count_round(started, outcome.bytes_sent, outcome.bytes_received);
  }

  // The NCCL path's mix, on the device (torch's current stream, after the round has completed).
  void mix_on_device() {
    wait_nccl_round();
    torch::NoGradGuard no_grad;
    std::lock_guard<std::mutex> lock(flat.mutex());
    torch::Tensor x = flat.tensor();  // a handle on the model's weights
    x.copy_(nccl->sent()).mul_(static_cast<float>(peers.self_weight));
    for (size_t i = 0; i < peers.recv_from.size(); ++i)
      x.add_(nccl->received(i), static_cast<float>(peers.recv_weights[i]));
  }

  // Waits for the round in flight without using what it brought (finish()).
  void drain_round() {
    if (nccl) {
      wait_nccl_round();
    } else {
      finish_round();
    }
  }

  void locked_step(torch::optim::Optimizer& optimizer) {
    std::lock_guard<std::mutex> lock(flat.mutex());
    optimizer.step();
  }

  // Parameters the user replaced since the last step (torch::load, set_data) go back into the flat
  // buffer, with their new values. Returns whether there were any.
  bool reattach() {
    std::lock_guard<std::mutex> lock(flat.mutex());
    return flat.reattach();
  }

  void step_dpsgd(const Decentralized& d, torch::optim::Optimizer& optimizer, bool replaced) {
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      totals.last_step_bytes_sent = 0;
    }
    const bool communicate =
        !finished && steps % static_cast<uint64_t>(d.communication_interval) == 0;
    if (d.exchange == Decentralized::Exchange::overlap) {
      // The weights of this step left after the previous one; mix them, then apply the gradient
      // computed at this rank's own weights. Weights replaced since then (a checkpoint loaded)
      // are not what the round carried: the round is waited for and its mix skipped on this rank.
      if (communicate && round_in_flight()) {
        if (replaced) {
          drain_round();
        } else {
          mix_received();
        }
      }
      locked_step(optimizer);
      ++steps;
      if (!finished && steps % static_cast<uint64_t>(d.communication_interval) == 0) send_weights();
    } else {
      locked_step(optimizer);
      if (communicate) {
        send_weights();
        mix_received();
      }
      ++steps;
    }
  }

  void step_choco(const LowPrecisionDecentralized& l, torch::optim::Optimizer& optimizer) {
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      totals.last_step_bytes_sent = 0;
    }
    locked_step(optimizer);
    ++steps;
    if (finished) return;
    const size_t n = flat.count(), block = static_cast<size_t>(l.block);
    flat.pull();  // a CUDA model: its host mirror, pushed back after the update
    const float* x = flat.host();
    for (size_t i = 0; i < n; ++i) scratch[i] = x[i] - own_copy[i];
    send_buffer.resize(comm::minmax_bytes(comm::MinMaxBits::eight, n, block));
    comm::minmax_encode(comm::MinMaxBits::eight, scratch.data(), n, block,
                        reinterpret_cast<uint8_t*>(send_buffer.data()));
    // The links send q_i and add each neighbour's q_j to their public copy of it while this
    // thread adds q_i to its own: x_hat_i += q_i.
    start_round(send_buffer.size());
    comm::minmax_decode_add(comm::MinMaxBits::eight,
                            reinterpret_cast<const uint8_t*>(send_buffer.data()), n, block,
                            own_copy.data());
    auto m = finish_round();
    for (size_t j = 0; j < m.peers.size(); ++j) neighbour_copies[m.peers[j]] = m.values[j];
    // x += gamma * sum_j W_ij (x_hat_j - x_hat_i), over the live neighbours.
    std::lock_guard<std::mutex> lock(flat.mutex());
    float* out = flat.host();
    for (size_t j = 0; j < m.peers.size(); ++j) {
      const float w = static_cast<float>(l.gamma * m.weights[j]);
      const float* xj = m.values[j];
      const float* xi = own_copy.data();
      for (size_t i = 0; i < n; ++i) out[i] += w * (xj[i] - xi[i]);
    }
    flat.push();
  }
};

namespace {

void check_interval(const Decentralized& d) {
  if (d.communication_interval < 1)
    throw comm::Error("Decentralized.communication_interval = " +
                      std::to_string(d.communication_interval) + ": expected an integer >= 1");
}

void check_low_precision(const LowPrecisionDecentralized& l) {
  if (!(l.gamma > 0 && l.gamma <= 1))
    throw comm::Error("LowPrecisionDecentralized.gamma = " + comm::number_text(l.gamma) +
                      ": expected a number in (0, 1]");
  if (l.block < 1)
    throw comm::Error("LowPrecisionDecentralized.block = " + std::to_string(l.block) +
                      ": expected an integer >= 1");
}

}  // namespace

DecentralizedModule::DecentralizedModule(Runtime& runtime, ModelRef model, Decentralized algorithm,
                                         GossipOptions options) {
  check_interval(algorithm);
  comm::Topology topology(algorithm.topology, runtime.world_size());
  if (!topology.doubly_stochastic())
    throw comm::Error("decentralized SGD needs a doubly stochastic mixing matrix; " +
                      topology.describe() +
                      " is not (uniform weights on an irregular graph): use mixing = metropolis");
  impl_ = std::make_unique<Impl>(runtime, model.get("DecentralizedModule"), algorithm, options,
                                 algorithm.topology, "decentralized");
  if (algorithm.exchange == Decentralized::Exchange::overlap) impl_->send_weights();
  Impl* impl = impl_.get();
  impl_->listener = runtime.add_failure_listener(
      [impl](int rank, const std::string& reason) { impl->mark_dead(rank, reason); });
}

DecentralizedModule::DecentralizedModule(Runtime& runtime, ModelRef model,
                                         LowPrecisionDecentralized algorithm,
                                         GossipOptions options) {
  check_low_precision(algorithm);
  comm::Topology topology(algorithm.topology, runtime.world_size());
  if (!topology.undirected() || topology.time_varying())
    throw comm::Error(
        "low-precision decentralized SGD keeps copies of its neighbours' weights: "
        "it needs a static undirected topology, not " +
        topology.describe());
  impl_ = std::make_unique<Impl>(runtime, model.get("DecentralizedModule"), algorithm, options,
                                 algorithm.topology, "low_precision_decentralized");
  auto& m = *impl_;
  const size_t n = m.flat.count();
  // Every rank starts from rank 0's weights, so every copy starts there too. Ranks that keep
  // their own weights (an elastic re-form) know nothing of each other's: every copy starts at
  // zero, Choco-SGD's own start (x_hat_0 = 0, Koloskova et al. 2019), the same on every rank.
  if (options.broadcast_parameters) {
    m.flat.pull();
    m.own_copy.assign(m.flat.host(), m.flat.host() + n);
  } else {
    m.own_copy.assign(n, 0.0f);
  }
  m.scratch.resize(n);
  for (int p : m.topology.round(m.rank, 0).recv_from) {
    actors::EdgeSettings edge;
    edge.peer = p;
    edge.payload = actors::EdgePayload::minmax8_difference;
    edge.public_copy = m.own_copy;
    edge.block = static_cast<size_t>(algorithm.block);
    m.links->add(std::move(edge));
  }
  Impl* impl = impl_.get();
  impl_->listener = runtime.add_failure_listener(
      [impl](int rank, const std::string& reason) { impl->mark_dead(rank, reason); });
}

DecentralizedModule::~DecentralizedModule() {
  try {
    finish();
  } catch (const std::exception& e) {
    std::cerr << "troupe: " << impl_->name() << ": " << e.what() << "\n";
  }
  impl_->rt.remove_failure_listener(impl_->listener);
}

void DecentralizedModule::step(torch::optim::Optimizer& optimizer) {
  auto& m = *impl_;
  const bool replaced = m.reattach();
  if (auto* d = std::get_if<Decentralized>(&m.algorithm)) {
    m.step_dpsgd(*d, optimizer, replaced);
  } else {
    m.step_choco(std::get<LowPrecisionDecentralized>(m.algorithm), optimizer);
  }
  std::lock_guard<std::mutex> lock(m.stats_mutex);
  m.totals.steps = m.steps;
}

void DecentralizedModule::finish() {
  auto& m = *impl_;
  if (m.finished) return;
  m.finished = true;
  if (m.round_in_flight()) m.drain_round();  // the weights sent after the last step: unused
}

void DecentralizedModule::save_state(comm::StateWriter& out) const {
  const auto& m = *impl_;
  if (m.nccl)
    throw comm::Error(m.name() +
                      ": save_state on the \"cuda via nccl\" gossip path (expected "
                      "GossipOptions::stage_through_host for a checkpoint)");
  out.string(m.name());
  out.value(m.steps);
  out.value(m.rounds);
  const bool in_flight = m.round_in_flight();
  out.value<uint8_t>(in_flight ? 1 : 0);
  if (in_flight) out.vector(m.send_buffer);  // D-PSGD overlap: the weights that left
  if (std::holds_alternative<LowPrecisionDecentralized>(m.algorithm)) {
    out.vector(m.own_copy);
    const auto neighbours = m.topology.round(m.rank, 0).recv_from;
    out.value<uint64_t>(neighbours.size());
    for (int p : neighbours) {
      out.value<int32_t>(p);
      // Before the first round every copy is the common start, which own_copy still is.
      auto at = m.neighbour_copies.find(p);
      const float* copy = at != m.neighbour_copies.end() ? at->second : m.own_copy.data();
      out.bytes(copy, m.own_copy.size() * sizeof(float));
    }
  }
}

void DecentralizedModule::load_state(comm::StateReader& in) {
  auto& m = *impl_;
  if (m.nccl)
    throw comm::Error(m.name() +
                      ": load_state on the \"cuda via nccl\" gossip path (expected "
                      "GossipOptions::stage_through_host for a checkpoint)");
  const auto saved = in.string();
  if (saved != m.name()) in.fail("saved under " + saved + ", this module runs " + m.name());
  const auto steps = in.value<uint64_t>();
  const auto rounds = in.value<uint64_t>();
  const bool in_flight = in.value<uint8_t>() != 0;
  std::vector<char> sent;
  if (in_flight) sent = in.vector<char>(m.flat.count() * sizeof(float), "the weights in flight");
  const bool choco = std::holds_alternative<LowPrecisionDecentralized>(m.algorithm);
  std::vector<float> own;
  std::vector<std::pair<int, std::vector<float>>> copies;
  if (choco) {
    own = in.vector<float>(m.flat.count(), "the public copy of this rank");
    const auto neighbours = m.topology.round(m.rank, 0).recv_from;
    const auto count = in.value<uint64_t>();
    if (count != neighbours.size())
      in.fail(std::to_string(count) + " neighbours saved, this topology gives rank " +
              std::to_string(m.rank) + " " + std::to_string(neighbours.size()));
    for (int p : neighbours) {
      const auto peer = in.value<int32_t>();
      if (peer != p)
        in.fail("a public copy of rank " + std::to_string(peer) + " where rank " +
                std::to_string(p) + "'s was expected");
      std::vector<float> copy(m.flat.count());
      in.bytes(copy.data(), copy.size() * sizeof(float));
      copies.emplace_back(p, std::move(copy));
    }
  }
  if (in_flight && rounds == 0) in.fail("a round in flight, but no round was started");
  // The fresh module's own round (D-PSGD overlap posts one at construction; every rank drains
  // it here, at the same point).
  if (m.round_in_flight()) m.drain_round();
  m.steps = steps;
  m.rounds = in_flight ? rounds - 1 : rounds;
  if (choco) {
    // The neighbours' copies live in the links: new links start from the saved ones.
    m.own_copy = std::move(own);
    m.neighbour_copies.clear();
    m.links = std::make_unique<actors::GossipLinks>(detail::node(m.rt).system(), m.transport,
                                                    m.key_prefix);
    const auto& l = std::get<LowPrecisionDecentralized>(m.algorithm);
    for (auto& [p, copy] : copies) {
      actors::EdgeSettings edge;
      edge.peer = p;
      edge.payload = actors::EdgePayload::minmax8_difference;
      edge.public_copy = std::move(copy);
      edge.block = static_cast<size_t>(l.block);
      m.links->add(std::move(edge));
    }
  }
  if (in_flight) {
    m.send_buffer = std::move(sent);
    m.start_round(m.send_buffer.size());
  }
  std::lock_guard<std::mutex> lock(m.stats_mutex);
  m.totals.steps = m.steps;
}

std::string DecentralizedModule::algorithm_name() const { return impl_->name(); }

std::string DecentralizedModule::gossip_path() const { return impl_->path; }

CommStats DecentralizedModule::stats() const {
  std::lock_guard<std::mutex> lock(impl_->stats_mutex);
  return impl_->totals;
}

}  // namespace troupe
