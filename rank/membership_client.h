#pragma once
/// MembershipClient: a rank's side of the elastic membership service (elastic/membership.h).
///
/// A reader thread receives what the service sends. A notice that a newer generation forms (or
/// that the job stops) is handed at once to `on_change`, on that thread, so the Runtime can fail
/// the collectives of the generation that ends; the rest waits for join() and exchange().
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "rank/membership_wire.h"

namespace troupe::elastic {

/// What the service assigned this rank in a generation.
struct Assignment {
  int generation = 0;
  int rank = 0;
  int world_size = 1;
  int source = 0;    // the rank whose state every member adopts
  int64_t step = 0;  // the step the job continues from
  int ranks = 0;     // the ranks of a whole world of the job (the launch's, spares not counted)
};

/// A generation's peer table: host and transport address by rank.
struct MemberTable {
  std::vector<std::string> hosts;
  std::vector<std::string> addresses;
};

class MembershipClient {
 public:
  /// `fd`: this rank's end of the service's socket (owned from now on). `on_change(generation,
  /// why)` runs on the reader thread for each notice of a generation newer than the one in force
  /// (generation -1: the job stops, or the service is gone).
  MembershipClient(int fd, std::function<void(int, const std::string&)> on_change);
  ~MembershipClient();
  MembershipClient(const MembershipClient&) = delete;
  MembershipClient& operator=(const MembershipClient&) = delete;

  /// Reports `step` completed steps (-1: no state) and waits for this rank's assignment. Throws
  /// comm::Error with the service's reason when the job stops, or naming the deadline. The wait
  /// outlasts the service's own deadlines for forming a generation (twice
  /// TROUPE_MEMBERSHIP_TIMEOUT_MS, the launcher's --membership-timeout, and a margin), whatever
  /// `deadline` says: a survivor never gives up on a generation the service is still forming.
  Assignment join(int64_t step, const std::string& host, Clock::time_point deadline);
  /// Sends this rank's transport address for `generation` and waits for its table; empty when a
  /// newer generation opened meanwhile (join again). Throws as join() does, and when the table
  /// does not hold one host and transport address per rank of the assignment, or an address
  /// that cannot be a UCX worker address of this build (a size out of 1..kMaxAddressBytes, or a
  /// header byte unlike this rank's own `address`): nothing a peer sent reaches UCX unchecked.
  std::optional<MemberTable> exchange(int generation, const std::string& address,
                                      Clock::time_point deadline);
  /// The generation in force (after its table arrived).
  int generation() const;
  /// Tells the service this rank ends cleanly (not a death).
  void leave();

 private:
  void read_loop();
  void send(const std::string& bytes);
  // Throws unless `table` holds the assignment's ranks, each with a plausible UCX address.
  void check_table(const MemberTable& table, int generation, const std::string& own) const;
  std::pair<Message, std::vector<std::string>> next(Clock::time_point deadline,
                                                    const std::string& waiting_for);

  int fd_;
  std::function<void(int, const std::string&)> on_change_;
  mutable std::mutex mutex_;
  std::condition_variable arrived_;
  std::deque<std::pair<Message, std::vector<std::string>>> queue_;
  std::string closed_;  // why the service's socket ended, once it did
  int in_force_ = 0;
  int assigned_world_ = -1;  // the world size of the last assignment
  // The service's deadline for one round of a generation (TROUPE_MEMBERSHIP_TIMEOUT_MS); 0: not
  // known (a launcher before it was passed), the callers' deadlines only.
  std::chrono::milliseconds service_round_{0};
  std::thread reader_;
};

}  // namespace troupe::elastic
