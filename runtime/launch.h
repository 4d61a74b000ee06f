#pragma once
/// Launch: start N local processes of one program as the ranks of a job, the way torchrun does
/// (what `troupe launch -n N -- prog args` runs), forward their output, and stop them all when one
/// fails (or, with stop_on_failure off, let the others run on).
#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace troupe {

/// What to start and how. Every rank runs `command` with RANK, WORLD_SIZE, LOCAL_RANK,
/// LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; the rest of the environment is the
/// launcher's, plus `extra_env` (which cannot override the six rank variables). Unless the
/// launcher's environment or `extra_env` has one, every rank also gets TROUPE_JOB_SECRET, 64 hex
/// digits made for this launch, which its rendezvous checks (runtime/env.h).
struct LaunchOptions {
  int nprocs = 1;
  std::string master_addr = "127.0.0.1";
  /// 0: pick a free TCP port.
  int master_port = 0;
  /// Program and arguments; a program without '/' is looked up in the launcher's PATH.
  std::vector<std::string> command;
  std::vector<std::pair<std::string, std::string>> extra_env;
  /// "[rank N] " before each line of stdout/stderr; false passes the bytes through unchanged.
  bool prefix_output = true;
  /// 0: no limit; else stop every rank and fail after this long.
  double timeout_sec = 0;
  /// SIGTERM -> SIGKILL delay when stopping the ranks.
  double grace_sec = 5;
  /// false: a failing rank is reported but the others run on (`troupe launch --keep-going`; what
  /// `troupe run` does for algorithms that tolerate a dead rank); the result's message then names
  /// every rank that failed and every one that ran on to status 0.
  bool stop_on_failure = true;
};

/// How a launch ended.
struct LaunchResult {
  /// 0 when every rank exited 0. Else the failed rank's status (128+signal when it was killed),
  /// 124 on timeout, 128+signal when the launcher itself got SIGINT/SIGTERM, 127 when the
  /// program was not found, 126 when it could not be executed.
  int exit_code = 0;
  /// The first rank that failed (exited nonzero, was killed, or could not start); -1 when none.
  int failed_rank = -1;
  /// Per rank: exit status, 128+signal, 127/126 when it could not start, -1 if never started.
  std::vector<int> rank_exit_codes;
  /// What happened, e.g. "rank 2 exited with status 3; stopped ranks 0, 1, 3".
  std::string message;
};

/// Starts options.nprocs processes (fork and exec; each in its own process group, stdin from
/// /dev/null, killed by the kernel if the launcher dies, so that a SIGKILLed launcher leaves no
/// rank running), forwards their stdout and stderr line by line (prefixed when
/// options.prefix_output; a last partial line is flushed at EOF) to `out` and `err`, and waits
/// for all of them. When one fails (nonzero status or a signal; see stop_on_failure), on timeout,
/// or when the launcher gets SIGINT/SIGTERM, it stops the others' process groups with SIGTERM, then
/// SIGKILL after grace_sec, and reaps them; a second SIGINT skips the grace period. Every wait has
/// a deadline. While it runs, the launcher's SIGINT/SIGTERM handlers are replaced (restored on
/// return; only the first of concurrent launches takes them). Call it from a thread that lives
/// until it returns: the ranks' death signal follows the thread that started them. Throws
/// comm::Error on invalid options (nprocs not in 1..kMaxLocalRanks of runtime/env.h, checked
/// before any rank starts; empty command or address, negative times, port out of range) and on
/// system errors (pipe, fork); failures of the ranks are reported in the result, not thrown.
LaunchResult launch(const LaunchOptions& options, std::ostream& out = std::cout,
                    std::ostream& err = std::cerr);

/// A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read it, close). Another
/// process may take it before it is used; fine for tests and single-host launches.
int pick_free_port();

}  // namespace troupe
