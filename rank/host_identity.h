#pragma once
/// Which ranks really share a host: the same kernel *and* the same /dev/shm, not merely the same
/// host name.
///
/// A host name is a label (one per UTS namespace; containers and network-namespace test beds give
/// ranks of one machine different names, and machines cloned from one image may share one). What
/// decides whether two ranks can use troupe's shared memory (comm/shm: POSIX shm objects under
/// /dev/shm, futexes in them) is whether a name opened by one under /dev/shm is the same object
/// for the other: same kernel (its boot id, a random 128-bit number drawn at every boot) and same
/// tmpfs instance and directory (the device and inode of /dev/shm as stat(2) reports them; a
/// container or mount namespace with its own /dev/shm has another device). Two ranks with equal
/// identities therefore see the same /dev/shm, and two with different ones do not — no probe file
/// is needed, and none is left behind. UCX decides the same for its own shared-memory transports
/// (boot id, and the IPC namespace for posix/sysv, the PID namespace for cma), per peer pair.
#include <string>
#include <vector>

#include "comm/collectives/communicator.h"

namespace troupe {

/// This process's machine identity: "boot <boot id> shm <device>:<inode>" from `boot_id_path`
/// and a stat of `shm_dir`. Without a readable boot id (no /proc) the host name stands in for it
/// ("name <host name> shm ..."); without /dev/shm, "shm none" (such ranks never share memory
/// through it). The paths are parameters for tests.
std::string machine_identity(const std::string& shm_dir = "/dev/shm",
                             const std::string& boot_id_path = "/proc/sys/kernel/random/boot_id");

/// Each rank's host as a small integer, in order of first appearance: ranks share an index when
/// they have the same host name and the same machine identity (by rank, as gathered). Hosts with
/// one name on different machines are different hosts (network-namespace beds, containers); ranks
/// of one machine that chose different names (RuntimeOptions::host, to pretend) stay apart.
std::vector<int> real_host_indices(const std::vector<std::string>& names,
                                   const std::vector<std::string>& identities);

/// How `rank` reaches each rank, by rank: "self", or "same host" / "other host (NAME)" and, where
/// `transports` (UcxTransport::peer_transports(); empty for other transports) names UCX's lanes,
/// the medium they use: "other host (h2), network: tcp/eth0", "same host, shared memory:
/// posix/memory sysv/memory cma/memory".
std::vector<std::string> describe_peer_paths(int rank, const std::vector<std::string>& names,
                                             const std::vector<int>& host_index,
                                             const std::vector<std::string>& transports);

/// A collective: every rank's machine identity, by rank (`mine` is this rank's; at most
/// kMaxIdentityBytes are compared).
std::vector<std::string> gather_identities(comm::Communicator& comm, const std::string& mine);

/// The longest identity gather_identities carries (longer ones are cut).
inline constexpr size_t kMaxIdentityBytes = 192;

}  // namespace troupe
