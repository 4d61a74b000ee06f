#pragma once
// An elastic job of a rank program under troupe::launch (`troupe launch --elastic`), for the
// elastic process tests: what the launcher returned and what the ranks printed.
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "elastic/launch.h"

namespace troupe::test {

struct ElasticRun {
  LaunchResult result;
  std::string out, err;
  /// How many times `what` occurs in the ranks' standard output.
  size_t count(const std::string& what) const {
    size_t n = 0;
    for (size_t at = out.find(what); at != std::string::npos; at = out.find(what, at + 1)) ++n;
    return n;
  }
};

/// Launches `command` as an elastic job of `ranks` ranks (and `spares` spares) with
/// TROUPE_FAULT=`faults`, `extra_env`, and one BLAS thread per rank: a 20 s membership timeout, 120
/// s for the whole job. TROUPE_TEST_SHOW_OUTPUT=1 prints what the job said (timings for
/// docs/benchmarks.md).
inline ElasticRun launch_elastic_job(
    std::vector<std::string> command, int ranks, int min_ranks, int max_restarts,
    const std::string& faults, int spares = 0,
    std::vector<std::pair<std::string, std::string>> extra_env = {}) {
  LaunchOptions o;
  o.nprocs = ranks;
  o.spares = spares;
  o.elastic = true;
  o.min_ranks = min_ranks;
  o.max_restarts = max_restarts;
  o.membership_timeout_sec = 20;
  o.timeout_sec = 120;  // the whole job's deadline
  o.grace_sec = 2;
  o.command = std::move(command);
  o.extra_env = {{"TROUPE_FAULT", faults}, {"OMP_NUM_THREADS", "1"}};
  o.extra_env.insert(o.extra_env.end(), extra_env.begin(), extra_env.end());
  std::ostringstream out, err;
  ElasticRun run;
  run.result = launch(o, out, err);
  run.out = out.str();
  run.err = err.str();
  if (std::getenv("TROUPE_TEST_SHOW_OUTPUT")) MESSAGE(run.out << run.err << run.result.message);
  return run;
}

}  // namespace troupe::test
