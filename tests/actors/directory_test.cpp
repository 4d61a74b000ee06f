// actors::Directory on its own: the message of a rendezvous whose deadline passes names the ranks
// that never arrived, and stays one short line for a world of 65,535 ranks.
#include <doctest/doctest.h>

#include <caf/all.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "actors/atoms.h"
#include "actors/directory.h"

using namespace troupe;

namespace {

/// Registers rank 0 of a `world`-rank job with a fresh directory whose deadline is 100 ms, and
/// returns the directory's refusal once the deadline has passed ("" when it accepted).
std::string lone_rank_zero(int world) {
  caf::actor_system_config config;
  caf::actor_system system{config};
  auto directory = actors::spawn_directory(system, world, std::chrono::milliseconds(100));
  auto worker = system.spawn([]() -> caf::behavior { return {[](int) {}}; });
  caf::scoped_actor self{system};
  std::string why = "no reply";
  self->request(directory, std::chrono::seconds(30), actors::register_atom::value, 0, world,
                std::string("host0"), std::string("address0"), std::string(), worker)
      .receive([&](actors::table_atom, bool ok, const std::string& error,
                   const std::vector<std::string>&, const std::vector<std::string>&,
                   const std::vector<std::string>&) { why = ok ? "" : error; },
               [&](caf::error& e) { why = "request failed: " + system.render(e); });
  self->send_exit(worker, caf::exit_reason::user_shutdown);
  self->send_exit(directory, caf::exit_reason::user_shutdown);
  return why;
}

}  // namespace

TEST_CASE("the ranks that never arrived are all named when they are few") {
  CHECK(lone_rank_zero(4) ==
        "rendezvous timed out after 100 ms: rank(s) 1, 2, 3 never arrived (world size 4)");
}

TEST_CASE(
    "a rendezvous of 65,535 ranks that only rank 0 reached names the first few and the count") {
  const std::string why = lone_rank_zero(65535);
  CHECK(why ==
        "rendezvous timed out after 100 ms: rank(s) 1, 2, 3, 4, 5, 6, 7, 8, ... (65534 in all) "
        "never arrived (world size 65535)");
  CHECK(why.size() < 200);
}
