#include "actors/node.h"

#include <caf/all.hpp>

#include "actors/atoms.h"

namespace troupe::actors {

struct Node::Impl {
  caf::actor_system_config config;
  std::unique_ptr<caf::actor_system> system;
  caf::actor worker;
  caf::actor directory;  // on every rank: the directory (local on rank 0)
  bool owns_directory = false;
  std::unique_ptr<FrontDoor> door;                  // rank 0 of a world > 1
  std::shared_ptr<DirectoryConnection> connection;  // the other ranks

  // A request to the directory, answered with true; what it says, or a missing answer, is not
  // this rank's business any more (it is failing or leaving).
  template <class... Ts>
  void tell_directory(Ts&&... xs) {
    if (!directory || !worker) return;
    caf::scoped_actor self{*system};
    self->request(directory, std::chrono::seconds(2), std::forward<Ts>(xs)...)
        .receive([](bool) {}, [](caf::error&) {});
  }
};

Node::Node(int threads) : impl_(std::make_unique<Impl>()) {
  auto& config = impl_->config;
  config.set("scheduler.max-threads", threads);
  // CAF's workers poll for work (100 spins, then 500 sleeps of 50 us) before they wait on a
  // condition variable; on a 2-core machine that polling took ~4% of a core from training, so
  // they go straight to the condition variable (a new message wakes them at once).
  config.set("work-stealing.aggressive-poll-attempts", 0);
  config.set("work-stealing.moderate-poll-attempts", 0);
  config.set("work-stealing.relaxed-sleep-duration", caf::timespan{std::chrono::milliseconds(100)});
  impl_->system = std::make_unique<caf::actor_system>(config);
}

Node::~Node() {
  close();
  impl_->system.reset();
}

caf::actor_system& Node::system() { return *impl_->system; }

void Node::start_worker(int rank, std::shared_ptr<comm::Transport> transport,
                        PeerDownHandler on_peer_down) {
  impl_->worker = spawn_worker(*impl_->system, rank, std::move(transport), std::move(on_peer_down));
}

void Node::stop_worker() {
  if (impl_->worker) caf::anon_send_exit(impl_->worker, caf::exit_reason::user_shutdown);
  impl_->worker = nullptr;
}

bool Node::has_worker() const { return static_cast<bool>(impl_->worker); }

const FrontDoor& Node::publish(const RendezvousRequest& request) {
  auto published = publish_directory(*impl_->system, request);
  impl_->door = std::move(published.door);
  impl_->directory = published.directory;
  impl_->owns_directory = true;
  return *impl_->door;
}

PeerTable Node::rendezvous(const RendezvousRequest& request) {
  auto local = impl_->owns_directory ? impl_->directory : caf::actor{};
  auto table = actors::rendezvous(*impl_->system, request, impl_->worker, local);
  impl_->directory = table.directory;
  impl_->connection = table.connection;
  if (impl_->directory) watch_directory(impl_->worker, impl_->directory);
  return table;
}

bool Node::has_directory() const { return static_cast<bool>(impl_->directory); }

void Node::tell_failed(int rank, const std::string& reason) {
  impl_->tell_directory(failed_atom::value, rank, reason);
}

void Node::tell_leaving(int rank) { impl_->tell_directory(leave_atom::value, rank); }

void Node::close() {
  auto& m = *impl_;
  stop_worker();
  m.door.reset();  // sends what the directory told the others (this rank left) first
  m.connection.reset();
  if (m.owns_directory && m.directory)
    caf::anon_send_exit(m.directory, caf::exit_reason::user_shutdown);
  m.directory = nullptr;
  m.owns_directory = false;
}

std::string caf_version() {
  return std::to_string(CAF_MAJOR_VERSION) + "." + std::to_string(CAF_MINOR_VERSION) + "." +
         std::to_string(CAF_PATCH_VERSION);
}

}  // namespace troupe::actors
