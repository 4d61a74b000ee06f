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

// The directory at host:port, through the middleman actor's connect request with a deadline:
// middleman::remote_actor waits without one, and a peer that accepts the TCP connection but never
// completes CAF's handshake (a process that is stopped, or not CAF at all) would hold it forever.
caf::expected<caf::actor> connect_directory(caf::actor_system& system,
                                            const RendezvousRequest& request,
                                            std::chrono::milliseconds timeout) {
  caf::expected<caf::actor> result{caf::actor{}};
  caf::scoped_actor self{system, true};
  self->request(system.middleman().actor_handle(), timeout, caf::connect_atom::value,
                request.master_addr, static_cast<uint16_t>(request.master_port))
      .receive(
          [&](const caf::node_id&, caf::strong_actor_ptr& found, std::set<std::string>&) {
            if (found)
              result = caf::actor_cast<caf::actor>(std::move(found));
            else
              result = caf::make_error(caf::sec::no_actor_published_at_port);
          },
          [&](caf::error& e) { result = std::move(e); });
  return result;
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
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
      auto found = connect_directory(system, request, std::max(left, std::chrono::milliseconds(1)));
      if (found) {
        directory = *found;
        break;
      }
      last_error = found.error() == caf::sec::request_timeout
                       ? "no CAF handshake in time: something accepts connections there but does "
                         "not answer, e.g. a stopped rank 0 or another program on that port"
                       : system.render(found.error());
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
  // The directory answers by its own deadline, which names the missing ranks; a little slack lets
  // that answer arrive when rank 0 started after this rank.
  constexpr auto slack = std::chrono::seconds(1);
  auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
  auto wait = std::max(remaining, std::chrono::milliseconds(0)) + slack;
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
                      std::to_string(request.rank) + ": " +
                      (e == caf::sec::request_timeout
                           ? "no peer table from the directory within " +
                                 std::to_string(request.timeout.count()) +
                                 " ms (+1 s): rank 0 does not answer (stopped?)"
                           : system.render(e));
          });
  if (!failure.empty()) throw comm::Error(failure);
  table.directory = directory;
  return table;
}

}  // namespace troupe::actors
