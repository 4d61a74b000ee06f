#pragma once
/// InprocTransport: the Transport between ranks that are threads of one process.
///
/// An InprocFabric holds one mailbox per rank; each rank's transport posts into it. A send and a
/// receive meet in the receiver's mailbox; whichever arrives second copies the bytes once, from the
/// sender's buffer straight into the receiver's buffer, and completes both. Nothing is buffered in
/// between, so a send completes only when its receive has been posted (rendezvous semantics).
#include <memory>
#include <string>

#include "comm/transport/transport.h"

namespace troupe::comm {

/// The shared medium of an in-process job: create one, then one transport per rank.
class InprocFabric {
 public:
  explicit InprocFabric(int world_size);
  ~InprocFabric();
  int world_size() const;
  /// The transport of `rank`; valid while the fabric lives. Throws for a rank outside [0, world).
  std::shared_ptr<Transport> transport(int rank);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace troupe::comm
