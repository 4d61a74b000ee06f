// PyTorch's own launcher in its default mode: `torchrun --nproc_per_node 2 --no_python prog`
// starts troupe ranks while its agent's TCPStore holds MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE);
// they meet through that store. Skipped where torchrun is not installed (scripts/setup puts the
// torch wheel in .venv).
#include <doctest/doctest.h>

#include <sstream>
#include <string>

#include "elastic/launch.h"
#include "tests/support/skip.h"
#include "tests/support/torchrun.h"

using namespace troupe;

TEST_CASE("torchrun in its default mode starts 2 troupe ranks that check every collective") {
  const std::string torchrun = test::torchrun();
  if (torchrun.empty()) {
    test::skip_case("no torchrun (scripts/setup installs the torch wheel in .venv)");
    return;
  }
  LaunchOptions o;
  o.nprocs = 1;  // torchrun itself, which starts the 2 ranks
  o.command = {torchrun,
               "--nproc_per_node",
               "2",
               "--master_port",
               std::to_string(pick_free_port()),
               "--no_python",
               TROUPE_TEST_RANK_BIN,
               "collectives"};
  o.timeout_sec = 240;
  o.prefix_output = false;
  o.extra_env = {{"UCX_TLS", "sm,self"}};
  std::ostringstream out, err;
  auto result = launch(o, out, err);
  const std::string log = out.str() + err.str();
  INFO(log);
  CHECK(result.exit_code == 0);
  CHECK(log.find("rank 0 of 2: every collective correct") != std::string::npos);
  CHECK(log.find("rank 1 of 2: every collective correct") != std::string::npos);
}
