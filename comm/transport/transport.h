#pragma once
/// Transport: tagged, zero-copy send and receive of byte ranges between the ranks of one job.
///
/// A transport moves bytes; it knows nothing of element types or algorithms. Every operation is
/// non-blocking: it is posted with a callback and completes later, exactly once, with a Status.
/// Buffers are never copied into an intermediate queue by the caller's side: the bytes stay in the
/// caller's buffer until the operation completes, so the buffer must stay valid until then.
///
/// Matching: a send to `peer` with tag T matches the receive posted on `peer` for (this rank, T).
/// Messages between the same pair under the same tag match in posting order. The sizes of a
/// matching send and receive must be equal; a mismatch fails the receive with a message naming
/// both sizes.
///
/// Threads: send/recv/fail_peer may be called from any thread. Callbacks run on a thread owned by
/// the transport (or on the thread that completed the match); they must be short and must not call
/// back into blocking APIs. Collectives marshal them to their own driver (see
/// collectives/driver.h).
///
/// Implementations: inproc/ (ranks as threads of one process) and ucx/ (processes and hosts).
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "comm/status.h"
#include "comm/tags.h"  // Tag, kTagBits: the layout of a tag

namespace troupe::comm {

/// Called once when an operation ends, successfully or not.
using Callback = std::function<void(const Status&)>;

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// "inproc", "ucx", ...
  virtual std::string name() const = 0;

  /// Sends `bytes` bytes at `data` to `peer` under `tag`. `data` must stay valid until `done`.
  virtual void send(int peer, Tag tag, const void* data, size_t bytes, Callback done) = 0;
  /// Receives exactly `bytes` bytes from `peer` under `tag` into `data`.
  virtual void recv(int peer, Tag tag, void* data, size_t bytes, Callback done) = 0;

  /// True when every callback runs on one thread owned by the transport, never inside send/recv.
  /// A driver may then do a collective's local work directly in the callbacks (BlockingDriver
  /// does), which saves a thread hand-off per step.
  virtual bool serial_callbacks() const { return false; }

  /// Declares `peer` dead: every pending operation with it fails with `reason`, and so does every
  /// later one. Called when the directory reports a lost rank, or when an operation times out.
  virtual void fail_peer(int peer, const std::string& reason) = 0;

  /// Asks that the messages of one module (`key_prefix`: tags::module_prefix(id)) go on reaching
  /// this rank after another rank dies in the middle of a send, for a module that goes on without
  /// its dead peers (gossip). Call it on every rank after the transport is connected and before
  /// the module's first message; it holds for the transport's life. Returns an empty string when
  /// that is so (always here: ranks that are threads of one process die together), otherwise why
  /// it cannot be, for a warning.
  virtual std::string survive_peer_loss(uint32_t key_prefix) {
    (void)key_prefix;
    return {};
  }

  /// True when probe() can ask a peer for a sign of life (UCX); false by default (inproc: ranks
  /// are threads of one process, nothing to cut between them).
  virtual bool can_probe() const { return false; }
  /// Asks `peer` for a sign of life, to tell after a timeout which peer cannot be reached (under
  /// the tags tags::kProbeTag and kProbeAnswerTag, which no other message may use):
  /// `done` gets success once the peer's transport answered (its process runs, and the link
  /// between the two carries messages both ways), a failure at once when it cannot ask (the peer
  /// was failed, or can_probe() is false). A probe nobody answers (a cut link, a stopped process)
  /// stays pending until fail_peer(peer) or the transport's end: the caller waits for it with
  /// its own deadline, and fails the peer when that passes.
  virtual void probe(int peer, Callback done) {
    done(Status::failure(name() + " transport cannot probe its peers", peer));
  }
};

}  // namespace troupe::comm
