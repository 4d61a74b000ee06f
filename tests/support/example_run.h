#pragma once
// Test support: an example program (fashion_mnist, char_lm) launched as `nprocs` local processes
// with troupe launch's library call, its output and each rank's exit code.
#include <sstream>
#include <string>
#include <vector>

#include "elastic/launch.h"

namespace troupe::test {

struct ExampleRun {
  std::string log;  // stdout, then stderr
  std::vector<int> exit_codes;
};

/// Runs `command` on `nprocs` ranks over shared memory, within `timeout_sec`.
inline ExampleRun run_example(int nprocs, std::vector<std::string> command,
                              double timeout_sec = 280) {
  LaunchOptions o;
  o.nprocs = nprocs;
  o.command = std::move(command);
  o.timeout_sec = timeout_sec;
  o.extra_env = {{"UCX_TLS", "sm,self"}};
  std::ostringstream out, err;
  auto result = launch(o, out, err);
  return {out.str() + err.str(), result.rank_exit_codes};
}

}  // namespace troupe::test
