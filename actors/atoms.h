#pragma once
/// The message vocabulary of troupe's control plane (CAF 0.17 atoms, at most 10 characters).
#include <caf/atom.hpp>

namespace troupe::actors {

/// (register_atom, rank, world_size, host, transport_address, extra, worker): a rank joins the
/// directory; `extra` is opaque bytes handed to every rank (rank 0's NCCL unique id).
using register_atom = caf::atom_constant<caf::atom("register")>;
/// (table_atom, ok, error, hosts, addresses, extras): the directory's answer to register_atom.
using table_atom = caf::atom_constant<caf::atom("table")>;
/// (peer_down_atom, rank, reason, fatal): rank `rank` is gone; fatal when it died rather than left.
using peer_down_atom = caf::atom_constant<caf::atom("peer_down")>;
/// (leave_atom, rank): a rank shuts down cleanly.
using leave_atom = caf::atom_constant<caf::atom("leave")>;
/// (failed_atom, rank, reason): a rank gives up with an error; the directory tells every other
/// rank, as a death, naming the rank and the reason.
using failed_atom = caf::atom_constant<caf::atom("failed")>;
/// (deadline_atom): the directory's rendezvous deadline has passed.
using deadline_atom = caf::atom_constant<caf::atom("deadline")>;
/// (status_atom) -> std::vector<int>: ask a worker for the ranks it knows to be gone (a worker's
/// request only).
using status_atom = caf::atom_constant<caf::atom("status")>;
/// (fail_atom, reason): tell a peer link that its peer is gone.
using fail_atom = caf::atom_constant<caf::atom("fail")>;
/// (closed_atom): the connection a remote rank's stand-in (front_door.h) or a rank's link to the
/// directory (rendezvous.h) speaks through is gone; the actor ends, as a remote actor would.
using closed_atom = caf::atom_constant<caf::atom("closed")>;
/// (flush_atom) -> true: answered once everything sent to the actor before it has been handled.
using flush_atom = caf::atom_constant<caf::atom("flush")>;
/// (health_atom) -> (link_state_atom, peer, failure): ask a peer link whether its peer is alive.
using health_atom = caf::atom_constant<caf::atom("health")>;
/// (link_state_atom, peer, failure): a peer link's answer to health_atom; failure "" while alive.
using link_state_atom = caf::atom_constant<caf::atom("link_state")>;
/// (exchange_atom, EdgeRound): a gossip round over a peer link's edge (actors/peer_link.h).
using exchange_atom = caf::atom_constant<caf::atom("exchange")>;
/// (edge_done_atom, EdgeResult): a peer link's answer to exchange_atom, once the round's send and
/// receive on its edge have ended.
using edge_done_atom = caf::atom_constant<caf::atom("edge_done")>;
/// (listen_atom): a message-stream peer link posts the receive of its stream's next message.
using listen_atom = caf::atom_constant<caf::atom("listen")>;
/// (arrived_atom, StreamArrival): a peer link's answer to listen_atom, once the message came.
using arrived_atom = caf::atom_constant<caf::atom("arrived")>;
/// (post_atom, StreamMessage): a message-stream peer link sends the stream's next message.
using post_atom = caf::atom_constant<caf::atom("post")>;
/// (posted_atom, StreamSent): a peer link's answer to post_atom, once the send has ended.
using posted_atom = caf::atom_constant<caf::atom("posted")>;

}  // namespace troupe::actors

namespace troupe::actors {

/// (ready_atom, step, denominator): one parameter of a bucket has its gradient; the step's sum
/// over ranks is to be divided by `denominator` (1: a plain sum).
using ready_atom = caf::atom_constant<caf::atom("ready")>;
/// (launch_atom, step, denominator): start the bucket's reduction now, ready or not.
using launch_atom = caf::atom_constant<caf::atom("launch")>;
/// (run_atom, closure): work of a running collective, posted from a transport thread.
using run_atom = caf::atom_constant<caf::atom("run")>;
/// (bucket_done_atom, index, step, ok, error, peer): a bucket's reduction ended (bucket to
/// reducer; no answer).
using bucket_done_atom = caf::atom_constant<caf::atom("bdone")>;
/// (progress_atom) -> (bucket_state_atom, index, launched, ready, waiting): ask a bucket where it
/// stands (the reducer does at a stall).
using progress_atom = caf::atom_constant<caf::atom("progress")>;
/// (bucket_state_atom, index, launched, ready, waiting): a bucket's answer to progress_atom:
/// whether its reduction has started this step, how many ready messages it counted, and the ranks
/// the reduction waits for.
using bucket_state_atom = caf::atom_constant<caf::atom("bstate")>;
/// (await_atom, step, stall_ms) -> (step_done_atom, step, ok, error): wake me when every bucket of
/// the step is done. (await_atom, step, stall_ms, buckets): when those buckets of it are done (the
/// step stays open for later waits).
using await_atom = caf::atom_constant<caf::atom("await")>;
/// (step_done_atom, step, ok, error): the reducer's answer to await_atom: every bucket of `step`
/// is done (ok), or one failed or the step stalled (error says which and why).
using step_done_atom = caf::atom_constant<caf::atom("step_done")>;
/// (stall_atom): the reducer's stall timer has fired (a waiting step may have stalled).
using stall_atom = caf::atom_constant<caf::atom("stall")>;
/// (abort_atom, reason, peer): rank `peer` died (-1: the world ends); fail what is running (a
/// gossiper drops that neighbour).
using abort_atom = caf::atom_constant<caf::atom("abort")>;
/// (force_atom, ...): the failure grace has passed; fail what is still in flight.
using force_atom = caf::atom_constant<caf::atom("force")>;
/// (setup_atom, ...): configuration after spawn.
using setup_atom = caf::atom_constant<caf::atom("setup")>;

}  // namespace troupe::actors

namespace troupe::actors {

/// (start_atom): a background averager or gossiper starts (or resumes) its rounds.
using start_atom = caf::atom_constant<caf::atom("start")>;
/// (stop_atom) -> (stopped_atom, ok, error): end the background rounds together with the other
/// ranks; answered once they have ended.
using stop_atom = caf::atom_constant<caf::atom("stop")>;
/// (stopped_atom, ok, error): a background actor's answer to stop_atom; error says why the rounds
/// ended early when they did.
using stopped_atom = caf::atom_constant<caf::atom("stopped")>;
/// (tick_atom): the timer of a background averager or gossiper.
using tick_atom = caf::atom_constant<caf::atom("tick")>;
/// (round_atom, ok, error, bytes_sent, bytes_received): an averager's allreduce ended.
using round_atom = caf::atom_constant<caf::atom("round")>;

}  // namespace troupe::actors
