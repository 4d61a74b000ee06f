#pragma once
/// Runtime: a rank of a troupe job — the actor system, the rendezvous, the transport and the
/// collectives, set up in one constructor.
///
/// ```cpp
/// troupe::Runtime rt;                      // rank from troupe launch / torchrun / mpirun / Slurm
/// rt.comm().allreduce(buf, n, troupe::comm::DataType::float32, troupe::comm::ReduceOp::avg);
/// ```
/// The constructor reads the rank environment (or takes RuntimeOptions::rank_info), starts CAF
/// with min(2, cores) scheduler threads unless told otherwise, creates the transport, registers
/// with the directory on rank 0 (which rank 0 publishes at MASTER_ADDR:MASTER_PORT), connects to
/// every peer and passes a barrier. Every step has a deadline; failures throw comm::Error with a
/// message naming what was expected. When a rank dies later (or fails: see fail()), every
/// survivor's pending and later communication fails with an error naming it; dead_ranks() lists
/// the ranks lost so far.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/collectives/communicator.h"
#include "comm/transport/link_shape.h"
#include "rank/env.h"

namespace troupe::comm {
class InprocFabric;      // comm/transport/inproc/transport.h: ranks as threads of one process
class NcclCommunicator;  // comm/transport/nccl/communicator.h, built with NCCL only
}  // namespace troupe::comm

namespace troupe {

namespace detail {
struct RuntimeAccess;  // rank/runtime_internal.h: the actor system, for troupe's own code
}  // namespace detail

/// How a Runtime starts. Defaults fit a process started by `troupe launch`, torchrun, mpirun or
/// srun.
struct RuntimeOptions {
  /// Where this rank sits; read from the environment when empty.
  std::optional<RankInfo> rank_info;
  /// CAF scheduler threads, 0..256; 0 means min(2, hardware threads).
  int scheduler_threads = 0;
  /// "ucx" (processes and hosts) or "inproc" (ranks as threads of one process; needs `fabric`).
  std::string transport = "ucx";
  /// The shared medium of an in-process job (transport "inproc"; comm/transport/inproc/transport.h,
  /// or run_thread_ranks in elastic/thread_ranks.h, which makes one).
  std::shared_ptr<comm::InprocFabric> fabric;
  /// Deadline for reaching rank 0 and for every rank to arrive.
  std::chrono::milliseconds rendezvous_timeout{30000};
  /// Deadline of each blocking collective, and of each step's reductions of a DistributedModule
  /// without DdpOptions::stall_timeout: 30 minutes, PyTorch's default for a process group. A rank
  /// that waits longer for the others (while one evaluates or saves alone) fails with an error
  /// that names this setting; set it higher for such programs, lower to learn of a hung peer
  /// sooner.
  std::chrono::milliseconds collective_timeout{std::chrono::minutes(30)};
  comm::CollectiveOptions collectives;
  /// The host name this rank registers with (what hosts() reports and hierarchical reductions
  /// group by); empty: $TROUPE_HOST_NAME, else gethostname(). Setting it lets ranks on one machine
  /// pretend to be on several hosts.
  std::string host;
  /// This rank's machine identity (rank/host_identity.h: boot id and /dev/shm), which decides
  /// with the host name which ranks share a host and memory; empty: measured. Setting it lets
  /// thread ranks of one process pretend to be on different machines under one host name.
  std::string machine;
  /// Link emulation: this rank's sends to each peer are delayed as if over a link of that
  /// bandwidth and latency (comm/transport/link_emulation.h; emulation, not a network model).
  /// Read from TROUPE_LINK and TROUPE_LINK_RANKS (rank/env.h) when empty; an inactive one
  /// leaves the transport as it is.
  std::optional<comm::LinkEmulation> links;
  /// Rank 0 publishes an NCCL unique id at the rendezvous when troupe is built with NCCL, this
  /// is on and it sees a CUDA device (it costs rank 0 one listening socket and thread of NCCL's
  /// bootstrap); every rank then may create the job's NCCL communicator with nccl(). Rank 0's
  /// value decides for the job.
  bool nccl = true;
  /// Fault injection (rank/fault.h), e.g. "kill:rank=2,step=100,phase=reduce"; empty: the
  /// plan in $TROUPE_FAULT, if any.
  std::string faults;
  /// Elastic membership (elastic/membership.h): this rank's end of the membership service's
  /// socket; -1: $TROUPE_ELASTIC_FD, which `troupe launch --elastic` sets (unset: not elastic).
  /// An elastic Runtime forms its world with the service instead of rank 0's directory, so the
  /// job outlives any rank, and reform() re-forms it after a rank dies or one joins. It needs the
  /// "ucx" transport and no link emulation.
  int membership_fd = -1;
};

/// The generation an elastic Runtime is in: which world it forms and whose state every member
/// adopts (elastic/elastic.h heals from it).
struct ElasticGeneration {
  /// 1, 2, ... (the first formation is 1).
  int number = 0;
  /// The rank holding the most completed steps: every member adopts its state.
  int source = 0;
  /// The steps the source has completed: where the job goes on.
  int64_t step = 0;
  /// The ranks of a whole world of the job: the launch's (`-n` x `--nnodes`, spares not
  /// counted), the same on every member of every generation. What a job fixes once by its world
  /// (a global batch) comes from this, not from the world a process first joins: a restarted rank
  /// or a spare may first join a world short of ranks.
  int ranks = 0;
};

class Runtime {
 public:
  Runtime();
  explicit Runtime(RuntimeOptions options);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int rank() const;
  int world_size() const;
  int local_rank() const;
  const RankInfo& rank_info() const;
  /// Host name of every rank, by rank (from the rendezvous).
  const std::vector<std::string>& hosts() const;
  /// Every rank's real host as a small integer, by rank: ranks share one when they have the same
  /// host name *and* the same kernel and /dev/shm (rank/host_identity.h), so only they can use
  /// shared memory with each other; hierarchical reductions group by it.
  const std::vector<int>& real_hosts() const;
  /// How this rank reaches each rank, by rank, as the start-up log line says: "same host, shared
  /// memory (posix/memory sysv/memory)", "other host, network (tcp/eth0)", "self" ...
  const std::vector<std::string>& peer_paths() const;

  std::shared_ptr<comm::Transport> transport();
  /// Blocking collectives over this job's transport.
  comm::Communicator& comm();
  /// Ranks reported gone (died or left) so far, sorted.
  std::vector<int> dead_ranks() const;

  /// Tells every other rank that this one fails, with `reason` (say, the exception's what()): their
  /// pending and later communication with it fails at once with an error naming this rank and the
  /// reason, as if it had died, instead of waiting for it until a deadline; this rank's own
  /// collectives fail from now on. Call it in the catch block of a trainer, then let the Runtime
  /// go. A Runtime destroyed by an exception (stack unwinding) announces a failure by itself,
  /// without the exception's text; one destroyed otherwise tells the others it left cleanly.
  /// Idempotent; never throws for the announcement (it waits at most 2 s for the directory).
  void fail(const std::string& reason);

  /// Called (on an actor thread) with (rank, reason) when a rank dies; at once if one already has.
  /// Returns an id for remove_failure_listener. Used by DistributedModule to fail its buckets.
  int add_failure_listener(std::function<void(int, const std::string&)> listener);
  void remove_failure_listener(int id);
  /// A number for a new module of this runtime: the lowest not taken by a live module
  /// (1..comm::tags::kMaxModules), so the same on every rank when every rank creates and destroys
  /// its modules in the same order. Throws comm::Error when kMaxModules are alive. A module gives
  /// it back with release_module_id when destroyed (rank/module_id.h does both).
  int next_module_id();
  void release_module_id(int id);

  /// Whether rank 0 published an NCCL unique id at the rendezvous (see RuntimeOptions::nccl) and
  /// the ranks of this host are no more than the CUDA devices it sees (NCCL refuses two ranks on
  /// one GPU; rank/device.h's gpus_for_nccl). The same answer on every rank where hosts are alike,
  /// so every rank takes the same path for its CUDA tensors (where they are not, the model check
  /// names the paths that differ).
  bool nccl_available() const;
  /// This rank's member of the job's NCCL communicator (all ranks) on CUDA device `device`,
  /// created from rank 0's unique id at the first call: collective, every rank calls it at the
  /// same point (a DistributedModule with CUDA parameters does so at construction), and it
  /// waits for all ranks up to the rendezvous timeout; operations then have the collective
  /// timeout. Later calls return the same communicator and must name the same device. A rank
  /// that dies aborts it. Throws comm::Error when troupe was built without NCCL, when rank 0
  /// published no id, or naming the device asked for against the one in use.
  std::shared_ptr<comm::NcclCommunicator> nccl(int device);

  /// Whether this rank belongs to an elastic job (RuntimeOptions::membership_fd).
  bool elastic() const;
  /// The launch slot of this rank (its RANK at launch), which stays its name across generations.
  int slot() const;
  /// The generation in force (number 0 when not elastic).
  ElasticGeneration generation() const;
  /// Elastic jobs: tears down this rank's transport and collectives and joins the next generation
  /// with `completed_steps` done, waiting (with the rendezvous deadline at each round) until the
  /// membership service closes it; rank(), world_size(), hosts() and comm() then describe the new
  /// world. Every wrapper of this Runtime (DistributedModule ...) must be destroyed first. Throws
  /// comm::Error when the job stops (no quorum: the message names the generation, its members and
  /// --min-ranks), or when the Runtime is not elastic.
  ElasticGeneration reform(int64_t completed_steps);

 private:
  friend struct detail::RuntimeAccess;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Each rank's host as a small integer (the index of its name among the distinct names, in order
/// of first appearance), for comm::CollectiveOptions::hosts. Runtime::real_hosts() is the
/// real grouping (names and machines); this one trusts the names.
std::vector<int> host_indices(const std::vector<std::string>& hosts);

}  // namespace troupe
