#pragma once
/// Membership of an elastic job: which ranks form the job now (a generation), decided by one
/// service that does not die with a rank.
///
/// `troupe launch --elastic` hosts the service (MembershipServer) in the launcher, which starts
/// every rank and sees each one end. A rank reaches it through a private socket the launcher gives
/// it at fork (TROUPE_ELASTIC_FD: one end of a SOCK_SEQPACKET socket pair, so only that process
/// holds it and no handshake is needed). One generation forms like this:
///
///   rank -> service  join      (steps completed, -1 without state; host name)
///   service -> rank  reform    (generation, why): sent to every other live rank when a
///                              generation opens (a rank died, or one joins), so that its
///                              collectives fail now instead of at their deadlines and it joins
///   service -> rank  assign    (generation, rank, world size, source rank, step, the ranks of
///                              a whole world: the launch's, spares not counted)
///   rank -> service  address   (generation, transport address)
///   service -> rank  table     (generation, hosts, addresses): the generation is in force
///   service -> rank  stop      (why): no quorum; the rank must end with that error
///   rank -> service  leave     the rank ends cleanly (its socket closing without it is a death)
///
/// A generation closes when every live member of the generation in force has joined (a restarted
/// rank joins when it is ready: it is not waited for), or at the deadline with those that did.
/// Its members get contiguous ranks in the order of their launch slots; the source is the member
/// with the most completed steps (the lowest slot among equals): every member adopts its state.
/// A rank that dies while the generation forms opens the next one (a reform to the others).
///
/// With several nodes (`troupe launch --elastic --nnodes M`), node 0's launcher hosts the service
/// and every other node's launcher relays its ranks' sockets to it over one TCP connection
/// (elastic/membership_link.h): a slot is then remote, its messages and its end arriving through
/// the link (attach_remote, on_message, on_closed) instead of a socket of this process.
///
/// A spare (a process the launcher started as standby, `troupe launch --spares K`) joins as soon
/// as it has started and waits there without opening a generation (unless the generation in
/// force is short of the launch's ranks): the next generation that forms takes it in while it
/// has fewer members than the launch's ranks, so a dead rank's place is taken at once by a
/// process already past its start-up. With several nodes each node's launcher starts its own
/// spares, and a place is filled from the node that has the most places empty (its own rank died:
/// the node's cores and devices were given to -n ranks, so its own spare takes the freed share),
/// else from any node (set_slot_nodes()).
#include <poll.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "rank/membership_wire.h"

namespace troupe::elastic {

/// One rank's report when a generation forms.
struct Report {
  int slot = 0;       // its launch slot (RANK at launch)
  int64_t step = -1;  // steps completed; -1: no state (a restarted rank)
};

/// A closed generation: its members by new rank, or why there is no quorum.
struct Generation {
  int number = 0;
  std::vector<int> slots;  // launch slot of each new rank
  int source = 0;          // the new rank whose state every member adopts
  int64_t step = 0;        // the step the job continues from (the source's)
  std::string error;       // not empty: no quorum, the members stop with this
};

/// Decides generation `number` from the reports received. `previous` holds the slots of the
/// generation before (the launched slots for the first); `ended` of them are known to have ended
/// (the launcher saw the process exit or its socket close), so cannot be training elsewhere. A
/// quorum is at least `min_ranks` members and, after the first generation, members holding state
/// that are more than half of the previous ranks that may still live: a side that cannot prove
/// it is the larger part (others went silent, not dead) never goes on by itself: no split brain.
Generation close_generation(int number, std::vector<Report> reports,
                            const std::vector<int>& previous, int ended, int min_ranks);

/// The service, driven by the launcher's poll loop (single-threaded): it owns the launcher's end
/// of each slot's socket.
class MembershipServer {
 public:
  /// `slots` launch slots; `min_ranks` the quorum floor; `deadline` how long a generation waits
  /// for its members at each of its two rounds. Messages to the user go to `log`. `members`
  /// (0: all the slots) of the slots form the first generation; the others hold spares, and no
  /// generation takes more members than that.
  MembershipServer(int slots, int min_ranks, std::chrono::milliseconds deadline, std::ostream& log,
                   int members = 0);
  ~MembershipServer();
  MembershipServer(const MembershipServer&) = delete;
  MembershipServer& operator=(const MembershipServer&) = delete;

  /// A fresh socket pair for `slot` (a rank about to start, or restart); returns the rank's end,
  /// close-on-exec: the child clears the flag and finds its number in TROUPE_ELASTIC_FD.
  /// `standby`: the process is a spare; its join waits for a generation that needs it.
  int attach(int slot, bool standby = false);
  /// Several nodes: what sends `bytes` to remote `slot` through `link` (the launcher's).
  using RemoteSend = std::function<void(int link, int slot, const std::string& bytes)>;
  void set_remote_send(RemoteSend send) { remote_send_ = std::move(send); }
  /// `slot`'s process (a new life of the slot) started on another node and is reached through
  /// `link`.
  void attach_remote(int slot, int link, bool standby = false);
  /// A message remote `slot` sent (what on_readable() reads from a local slot's socket).
  void on_message(int slot, const std::string& bytes);
  /// Remote `slot`'s socket on its node closed, its process ended, or its link was lost (`why`).
  void on_closed(int slot, const std::string& why);
  /// Whether `slot` has a live process (local or remote) that has not left.
  bool alive(int slot) const;
  /// Whether `slot`'s process is a spare that no generation has taken yet.
  bool standby(int slot) const;
  /// Whether a process that is not a waiting spare lives in any slot (local or remote) and is
  /// not expelled: when none does, the waiting spares and the expelled are not needed any more.
  bool rank_alive() const;
  /// Whether `slot`'s process was a member that did not join a generation by its deadline (a
  /// stopped process, or one behind a cut link): the generation formed without it and told it to
  /// stop. Its launcher ends it once the job is over, instead of waiting for it.
  bool expelled(int slot) const;
  /// Several nodes: the node of each slot (by slot; without it every slot is on one node). A
  /// generation short of the launch's ranks takes a spare from the node with the most of its
  /// ranks' places empty (the node of a dead rank), the lowest slot first; when that node has no
  /// spare waiting, from the next such node, and at last from any node.
  void set_slot_nodes(std::vector<int> nodes);
  /// Closes the rank's end in the launcher once the child has it.
  void started(int slot);
  /// The launcher's ends to poll, and the slot of each.
  void add_poll_fds(std::vector<pollfd>& fds, std::vector<int>& slots) const;
  /// Reads what `slot` sent (or learns that its socket closed).
  void on_readable(int slot);
  /// The launcher reaped `slot`'s process (`how`: "was killed by signal 9 (Killed)").
  void on_exit(int slot, const std::string& how);
  /// Acts on expired deadlines.
  void tick();
  /// When tick() must run next (max() when nothing waits).
  Clock::time_point next_deadline() const;
  /// A generation had no quorum: the job stops (the launcher restarts nobody).
  bool stopped() const { return stopped_; }
  const std::string& stop_reason() const { return stop_reason_; }
  /// Generations in force so far.
  int generations() const { return committed_number_; }

 private:
  struct Slot {
    int fd = -1;        // launcher's end (a local slot)
    int link = -1;      // the link that reaches it (a remote slot)
    int life = 0;       // processes started in this slot so far
    int child_fd = -1;  // rank's end until started()
    bool joined = false;
    bool left = false;      // said leave: ended cleanly
    bool standby = false;   // a spare not yet taken into a generation
    bool expelled = false;  // a member dropped for not joining in time
    Report report;
    std::string host;
    std::string address;
    bool has_address = false;
    std::string exit_note;  // how its process ended, when the launcher saw it first
    bool connected() const { return fd >= 0 || link >= 0; }
  };
  enum class Phase { idle, joining, addressing };

  void send(int slot, const std::string& bytes);
  // Acts on one message of `slot`; false when it ended the slot.
  bool handle(int slot, const std::string& bytes);
  void gone(int slot, const std::string& why);
  void open(const std::string& why);
  void maybe_close();
  void close();
  void fail_pending(const std::string& why);
  void commit();
  // Whether the generation in force has fewer members than the launch's ranks: a spare that
  // joins then opens a generation instead of waiting for a death.
  bool short_of_members() const;
  // Whether the forming generation waits for `slot`: a live member of the one in force that has
  // not joined.
  bool awaited(int slot) const;

  // The waiting spares that close() takes into the forming generation, beside `reports`.
  std::vector<int> spares_for(const std::vector<Report>& reports) const;

  RemoteSend remote_send_;
  std::vector<int> slot_nodes_;  // node by slot; empty: one node
  int min_ranks_;
  int members_;  // the most members a generation takes (the launch's ranks)
  std::chrono::milliseconds deadline_;
  std::ostream& log_;
  std::vector<Slot> slots_;
  Phase phase_ = Phase::idle;
  int number_ = 0;                   // the generation forming (or last formed)
  int committed_number_ = 0;         // the generation in force
  std::vector<int> committed_;       // its slots; before the first: every slot
  std::vector<int> committed_life_;  // the life of each member then
  Generation pending_;
  Clock::time_point deadline_at_ = Clock::time_point::max();
  Clock::time_point opened_at_{};
  bool stopped_ = false;
  std::string stop_reason_;
};

}  // namespace troupe::elastic
