#include "actors/rendezvous.h"

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <thread>

#include "actors/atoms.h"
#include "actors/directory.h"

namespace troupe::actors {

namespace {
std::string where(const RendezvousRequest& r) {
  return r.master_addr + ":" + std::to_string(r.master_port);
}
}  // namespace

caf::actor publish_directory(caf::actor_system& system, const RendezvousRequest& request,
                             int* bound_port) {
  auto directory = spawn_directory(system, request.world_size, request.timeout);
  auto port = system.middleman().publish(directory, static_cast<uint16_t>(request.master_port),
                                         nullptr, true);
  if (!port) {
    caf::anon_send_exit(directory, caf::exit_reason::user_shutdown);
    throw comm::Error("rank 0 cannot publish the rendezvous on port " +
                      std::to_string(request.master_port) + ": " + system.render(port.error()));
  }
  if (bound_port) *bound_port = *port;
  return directory;
}

PeerTable rendezvous(caf::actor_system& system, const RendezvousRequest& request,
                     const caf::actor& worker, caf::actor directory) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + request.timeout;
  if (!directory) {
    std::string last_error;
    auto backoff = std::chrono::milliseconds(20);
    while (true) {
      auto found =
          system.middleman().remote_actor(request.master_addr,
                                          static_cast<uint16_t>(request.master_port));
      if (found) {
        directory = *found;
        break;
      }
      last_error = system.render(found.error());
      const auto now = clock::now();
      if (now >= deadline)
        throw comm::Error("rank " + std::to_string(request.rank) +
                          " cannot reach the rendezvous at " + where(request) + " within " +
                          std::to_string(request.timeout.count()) + " ms (last error: " +
                          last_error + ")");
      // Rank 0 may not be up yet: retry, slowly growing the pause.
      std::this_thread::sleep_for(std::min<clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
    }
  }
  // The directory answers by its own deadline; give the message some slack beyond it.
  auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
  auto wait = std::max(remaining, std::chrono::milliseconds(0)) + std::chrono::seconds(5);
  PeerTable table;
  std::string failure;
  caf::scoped_actor self{system};
  self->request(directory, wait, register_atom::value, request.rank, request.world_size,
                request.host, request.address, request.extra, worker)
      .receive(
          [&](table_atom, bool ok, const std::string& error, const std::vector<std::string>& hosts,
              const std::vector<std::string>& addresses, const std::vector<std::string>& extras) {
            if (!ok) failure = error;
            table.hosts = hosts;
            table.addresses = addresses;
            table.extras = extras;
          },
          [&](caf::error& e) {
            failure = "rendezvous at " + where(request) + " failed for rank " +
                      std::to_string(request.rank) + ": " + system.render(e);
          });
  if (!failure.empty()) throw comm::Error(failure);
  table.directory = directory;
  return table;
}

}  // namespace troupe::actors
