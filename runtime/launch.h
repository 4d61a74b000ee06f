#pragma once
/// Launch: start N local processes of one program as the ranks of a job, the way torchrun does
/// (what `troupe launch -n N -- prog args` runs), forward their output, and stop them all when one
/// fails.
#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace troupe {

/// What to start and how. Every rank runs `command` with RANK, WORLD_SIZE, LOCAL_RANK,
/// LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; the rest of the environment is the
/// launcher's, plus `extra_env` (which cannot override the six rank variables).
struct LaunchOptions {
  int nprocs = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                  ///< 0: pick a free TCP port
  std::vector<std::string> command;     ///< program and args; a program without '/' is looked up in PATH
  std::vector<std::pair<std::string, std::string>> extra_env;
  bool prefix_output = true;            ///< "[rank N] " before each line of stdout/stderr
  double timeout_sec = 0;               ///< 0: no limit; else stop all and fail after this long
  double grace_sec = 5;                 ///< SIGTERM -> SIGKILL delay when stopping the ranks
};

/// How a launch ended.
struct LaunchResult {
  /// 0 when every rank exited 0; else the failed rank's status (128+signal when killed), 124 on
  /// timeout, 128+signal when the launcher itself was interrupted, 127 when the program was not
  /// found, 126 when it could not be executed.
  int exit_code = 0;
  int failed_rank = -1;                 ///< first rank that failed; -1 when no rank did
  std::vector<int> rank_exit_codes;     ///< per rank: exit status, 128+signal, or -1 if never started
  std::string message;                  ///< e.g. "rank 2 exited with status 3; stopped ranks 0, 1, 3"
};

/// Starts options.nprocs processes (each in its own process group, stdin from /dev/null), forwards
/// their stdout and stderr line by line (prefixed when options.prefix_output) to `out` and `err`,
/// and waits for all of them. When one fails (nonzero status or a signal), on timeout, or when the
/// launcher gets SIGINT/SIGTERM, it stops the others' process groups with SIGTERM, then SIGKILL
/// after grace_sec, and reaps them. Every wait has a deadline. Throws comm::Error on invalid
/// options (nprocs < 1, empty command, negative times, port out of range); failures of the ranks
/// are reported in the result, not thrown. One launch at a time per process forwards signals.
LaunchResult launch(const LaunchOptions& options, std::ostream& out = std::cout,
                    std::ostream& err = std::cerr);

/// A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read it, close). Another
/// process may take it before it is used; fine for tests and single-host launches.
int pick_free_port();

}  // namespace troupe
