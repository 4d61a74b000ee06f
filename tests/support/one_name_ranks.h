#pragma once
// Test support: thread ranks that play several machines in one process under one host name.
#include <memory>
#include <vector>

#include "comm/transport/inproc/transport.h"
#include "tests/support/thread_ranks.h"

namespace troupe::test {

/// The options of `world` thread ranks of one in-process job (a fresh fabric and rendezvous port)
/// that all register under the host name "one-name", every rank on machine "machine-0" or, with
/// `two_machines`, the ranks from world / 2 on "machine-1".
inline std::vector<RuntimeOptions> one_name_ranks(int world, bool two_machines) {
  auto fabric = std::make_shared<comm::InprocFabric>(world);
  const int port = pick_free_port();
  std::vector<RuntimeOptions> options;
  for (int r = 0; r < world; ++r) {
    options.push_back(thread_rank(r, world, port, fabric));
    options.back().host = "one-name";
    options.back().machine = two_machines && r >= world / 2 ? "machine-1" : "machine-0";
  }
  return options;
}

}  // namespace troupe::test
