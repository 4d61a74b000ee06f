#pragma once
/// Env: where this process sits in a job (rank, world size, rendezvous address), read from the
/// variables that torchrun, mpirun (Open MPI) or Slurm set, so one program starts under any of
/// them.
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "comm/transport/link_shape.h"

namespace troupe {

/// Where this process sits in a job, and how to reach the rendezvous (rank 0's directory).
/// `source` says who described it: "torchrun" (also `troupe launch`), "mpirun", "slurm",
/// "default" (no launcher: a single process) or "explicit" (built by hand in code).
struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "default";
  /// Set under torchrun's default (static) rendezvous, TORCHELASTIC_USE_AGENT_STORE=True: the
  /// agent's c10d TCPStore already listens on master_port, so rank 0's directory listens on a
  /// free port and writes it there under this key ("troupe/directory/<TORCHELASTIC_RUN_ID>/
  /// <TORCHELASTIC_RESTART_COUNT>"); the other ranks read it (rank/tcp_store.h). Empty: the
  /// directory listens on master_port itself.
  std::string agent_store_key;
  /// The job's secret (TROUPE_JOB_SECRET): a rank proves it holds it before rank 0 registers it,
  /// and rank 0 proves it back (comm/wire/rendezvous_wire.h). `troupe launch` makes one for its
  /// ranks; under torchrun, Slurm or mpirun, export the same value to every rank. Empty: none,
  /// and the Runtime warns when its rendezvous listens beyond the loopback interface.
  std::string job_secret;
  /// The job's identity (TROUPE_JOB_ID; `troupe launch` gives one): bound into the rendezvous
  /// handshake, so two jobs that share a secret and a port refuse each other. Empty: none.
  std::string job_id;
  /// Where rank 0's rendezvous listens (TROUPE_BIND_ADDRESS, an IPv4 address such as 0.0.0.0);
  /// empty: MASTER_ADDR's address, so a job with MASTER_ADDR=127.0.0.1 is reachable from this
  /// host only.
  std::string bind_address;
  /// TLS for the control plane (TROUPE_TLS_CERT, TROUPE_TLS_KEY, TROUPE_TLS_CA: PEM files of this
  /// rank's certificate and key, and of the authority that signed every rank's): all three or
  /// none, the same choice on every rank.
  std::string tls_cert, tls_key, tls_ca;
};

/// The fewest characters TROUPE_JOB_SECRET may have.
constexpr size_t kMinJobSecretLength = 16;

/// The most ranks a job may have. A larger world size, from the environment or built by hand, is
/// refused by validate() before anything is allocated per rank.
constexpr int kMaxWorldSize = 65536;

/// The most ranks one host starts, as processes (`troupe launch`, a job file's processes mode) or
/// as threads of one process (a job file's threads mode).
constexpr int kMaxLocalRanks = 4096;

/// Throws comm::Error unless 1 <= world_size <= max, naming `what` (the variable, key or flag that
/// gave it), the value and the range: "job.world_size = 100000 is out of range (expected 1..4096,
/// the most ranks one host starts)".
void check_world_size(long long world_size, const std::string& what, int max = kMaxWorldSize);

/// Looks up one environment variable; returns nullptr when it is not set. A parameter so tests
/// can hand in a fake environment.
using GetEnv = std::function<const char*(const char*)>;

/// The process environment (std::getenv).
GetEnv default_getenv();

/// Reads torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and
/// TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT); else
/// Open MPI's OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE; else Slurm's SLURM_PROCID,
/// SLURM_NTASKS, SLURM_LOCALID (local size from SLURM_NTASKS_PER_NODE, else the entry for
/// SLURM_NODEID in SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE such as "2(x3),1", best
/// effort); else a single process. MASTER_ADDR/MASTER_PORT override for mpirun and Slurm too
/// (Slurm's default address: SLURM_LAUNCH_NODE_IPADDR when set). TROUPE_JOB_SECRET and
/// TROUPE_BIND_ADDRESS are read under every launcher.
/// A missing local rank defaults to the rank and a missing local size to the world size (one node).
/// Throws comm::Error naming the variable and its value when a value is malformed or out of range,
/// or when a launcher's variables are only partly set (RANK without WORLD_SIZE). Calls validate().
RankInfo rank_info_from_env(const GetEnv& getenv = default_getenv());

/// Throws comm::Error when world_size is not in 1..kMaxWorldSize, rank < 0, rank >= world_size,
/// local_rank or local_world_size out of range, master_port not in 1..65535, or master_addr empty.
void validate(const RankInfo& info);

/// Link emulation (comm/transport/link_emulation.h) from TROUPE_LINK, the shape of every link
/// (e.g. "1gbit,5ms"), and TROUPE_LINK_RANKS, ranks whose links to and from them have their own
/// shape (e.g. "3=100mbit,20ms", entries separated by ';'); `troupe launch --link/--link-rank`
/// sets them. None when both are unset. Throws comm::Error naming the variable and its value when
/// one is malformed or names a rank outside [0, world_size).
comm::LinkEmulation link_emulation_from_env(int world_size,
                                            const GetEnv& getenv = default_getenv());

/// The variables that give every rank of a `world_size` job the link emulation `all` (a shape for
/// every link; "" for none) and `ranks` (RANK=SHAPE entries): TROUPE_LINK and TROUPE_LINK_RANKS,
/// each only when given. Checks them as link_emulation_from_env will, so a bad value is reported
/// once, by the launcher.
std::vector<std::pair<std::string, std::string>> link_emulation_env(
    const std::string& all, const std::vector<std::string>& ranks, int world_size);

}  // namespace troupe
