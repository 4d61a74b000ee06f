#pragma once
/// Launch: start N local processes of one program as the ranks of a job, the way torchrun does
/// (what `troupe launch -n N -- prog args` runs; with --nnodes M --node-rank I, one launch per
/// host starts that host's N of the job's M x N ranks), forward their output, and stop them all
/// when one fails (or, with stop_on_failure off, let the others run on).
#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace troupe {

/// What to start and how. Every rank runs `command` with the variables of rank_env() set; the
/// rest of the environment is the launcher's, plus `extra_env` (which cannot override the rank
/// variables), plus the thread variables of compute_threads() (rank/compute_threads.h) that
/// neither sets. With one node and no TROUPE_JOB_SECRET in the launcher's environment or
/// `extra_env`, every rank also gets one, 64 hex digits made for this launch, which its
/// rendezvous checks (rank/env.h); with several nodes, export the same one on every node.
/// Every rank gets the job's id as TROUPE_JOB_ID (`job_id`).
struct LaunchOptions {
  /// Ranks started on this host (torchrun's --nproc_per_node).
  int nprocs = 1;
  /// Hosts of the job (torchrun's --nnodes). Each runs one launch with the same nnodes, nprocs,
  /// master_addr and master_port, and its own node_rank.
  int nnodes = 1;
  /// This host's place among the nnodes, 0..nnodes-1 (torchrun's --node_rank): it starts the
  /// global ranks node_rank * nprocs + (0..nprocs-1). Node 0 holds rank 0, which the others meet.
  int node_rank = 0;
  /// Where rank 0 listens. Empty: 127.0.0.1 with one node; with more, node 0's host name or
  /// address must be given (every node names the same).
  std::string master_addr;
  /// 0: a free TCP port with one node; with more, kDefaultMasterPort (every node must agree).
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
  /// Elastic job (`troupe launch --elastic`): node 0's launcher hosts the membership service
  /// (elastic/membership.h) that every rank's Runtime forms its world with, a rank's death does
  /// not stop the others (the survivors re-form and go on), and a dead rank is started again in
  /// its slot while max_restarts allows. The launch succeeds when at least min_ranks ranks finish
  /// with status 0 and no generation lacked a quorum. With nnodes > 1 the service listens at
  /// master_addr:master_port and every other node's launcher relays its ranks to it
  /// (elastic/membership_link.h); such a launcher succeeds when the job did not stop, the
  /// service stayed reachable, and one of its ranks finished.
  bool elastic = false;
  /// The fewest ranks an elastic job trains with (`--min-ranks`), 1..nnodes * nprocs.
  int min_ranks = 1;
  /// Restarts of dead ranks in all (`--max-restarts`, per node's launcher), elastic jobs only. A
  /// restarted rank gets TROUPE_RESTART_COUNT (its slot's restarts so far); none is restarted
  /// once a rank of this node has finished with status 0 or the job stopped.
  int max_restarts = 0;
  /// How long a generation waits for its members at each round (`--membership-timeout`); with
  /// several nodes also how long node i > 0's launcher tries to reach node 0's service.
  double membership_timeout_sec = 30;
  /// Hot spares of an elastic job (`--spares K`, per node): K more processes of the program,
  /// started with the ranks in launch slots nprocs..nprocs+K-1 (with several nodes, node i's in
  /// slots nnodes * nprocs + i * K + k, after every node's ranks; RANK is the slot and WORLD_SIZE
  /// counts every slot), that
  /// go through their start-up (libraries, the actor system) and wait at the membership join as
  /// standby (TROUPE_ELASTIC_SPARE: the seconds a spare waits; timeout_sec, or a week without
  /// one). A generation that lost a rank takes a spare in its place at once, and the spare heals
  /// from a live peer with the others; the launcher then starts a new spare in the dead rank's
  /// slot (a restart, counted against this node's max_restarts; a dead rank is never restarted
  /// as a rank then). With several nodes a place is filled by a spare of the dead rank's node
  /// when one waits there, else by one of another node (elastic/membership.h). Spares still
  /// waiting when no rank of the job runs any more are stopped (SIGKILL: they hold no state; node
  /// 0 tells the other nodes) and are not counted as finished or failed.
  int spares = 0;
  /// The job's identity (`--job-id`, else TROUPE_JOB_ID in extra_env or the launcher's
  /// environment): 1..128 of [A-Za-z0-9._-], given to every rank as TROUPE_JOB_ID. The
  /// rendezvous and the elastic membership service admit only processes that prove both the
  /// job's secret and this id, so two jobs that share a secret (and a port) never cross-wire.
  /// Empty with one node: one made for this launch. Empty with several nodes: none (a launch per
  /// host cannot agree on one it makes), and the launcher warns; give every node the same.
  std::string job_id;
  /// Bind each launch slot to its own share of the launcher's CPUs (`--bind-cores`; what MPI
  /// launchers do by default, DeepSpeed's --bind_cores_to_rank): of the C cores the launcher may
  /// run on (its affinity), slot s of S (ranks and spares) gets cores s*k .. s*k+k-1 in that
  /// order, k = C / S, before it execs; a restarted rank gets its slot's again. A rank's trainer
  /// and its reduction threads then share only its own cores, and never take another rank's.
  /// More slots than cores is an error.
  bool bind_cores = false;
};

/// torchrun's MASTER_PORT when a job of several nodes names none.
constexpr int kDefaultMasterPort = 29500;

/// How a launch ended. Ranks are named by their global rank (RANK) in the output prefixes, the
/// message and failed_rank; with one node that is the local rank.
struct LaunchResult {
  /// 0 when every rank exited 0. Else the failed rank's status (128+signal when it was killed),
  /// 124 on timeout, 128+signal when the launcher itself got SIGINT/SIGTERM, 127 when the
  /// program was not found, 126 when it could not be executed.
  int exit_code = 0;
  /// The global rank of the first that failed (exited nonzero, was killed, or could not start);
  /// -1 when none.
  int failed_rank = -1;
  /// Per local rank (this host's): exit status, 128+signal, 127/126 when it could not start, -1
  /// if never started.
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
/// comm::Error on invalid options (nprocs not in 1..kMaxLocalRanks of rank/env.h, nnodes <
/// 1, node_rank not in 0..nnodes-1, nnodes x nprocs over kMaxWorldSize, no master_addr with
/// several nodes, empty command, negative times, port out of range; all checked before any rank
/// starts, each message naming the option, its --flag, the value and what was expected) and on
/// system errors (pipe, fork); failures of the ranks are reported in the result, not thrown.
/// Before the ranks start it writes to `err`, once, what compute_threads() says: the thread
/// variables it set for every rank, and a warning when ranks x threads exceed this host's cores.
LaunchResult launch(const LaunchOptions& options, std::ostream& out = std::cout,
                    std::ostream& err = std::cerr);

/// The variables that launch() gives local rank `local_rank` (0..nprocs-1) of `options`, as
/// torchrun names them: RANK (node_rank * nprocs + local_rank), WORLD_SIZE (nnodes * nprocs),
/// LOCAL_RANK, LOCAL_WORLD_SIZE (nprocs), GROUP_RANK (node_rank), GROUP_WORLD_SIZE (nnodes),
/// ROLE_RANK and ROLE_WORLD_SIZE (RANK and WORLD_SIZE: one role), MASTER_ADDR (127.0.0.1 when
/// empty) and MASTER_PORT (`port`). The options are checked as launch() checks them.
std::vector<std::pair<std::string, std::string>> rank_env(const LaunchOptions& options,
                                                          int local_rank, int port);

/// A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read it, close). Another
/// process may take it before it is used; fine for tests and single-host launches.
int pick_free_port();

}  // namespace troupe
