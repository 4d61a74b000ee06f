#pragma once
/// The message vocabulary of troupe's control plane (CAF 0.17 atoms, at most 10 characters).
#include <caf/atom.hpp>

namespace troupe::actors {

/// (register_atom, rank, world_size, host, transport_address, worker): a rank joins the directory.
using register_atom = caf::atom_constant<caf::atom("register")>;
/// (table_atom, ok, error, hosts, addresses): the directory's answer to register_atom.
using table_atom = caf::atom_constant<caf::atom("table")>;
/// (peer_down_atom, rank, reason, fatal): rank `rank` is gone; fatal when it died rather than left.
using peer_down_atom = caf::atom_constant<caf::atom("peer_down")>;
/// (leave_atom, rank): a rank shuts down cleanly.
using leave_atom = caf::atom_constant<caf::atom("leave")>;
/// (deadline_atom): the directory's rendezvous deadline has passed.
using deadline_atom = caf::atom_constant<caf::atom("deadline")>;
/// (status_atom): ask a worker for the ranks it knows to be gone.
using status_atom = caf::atom_constant<caf::atom("status")>;
/// (fail_atom, reason): tell a peer link that its peer is gone.
using fail_atom = caf::atom_constant<caf::atom("fail")>;

}  // namespace troupe::actors
