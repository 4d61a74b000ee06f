#pragma once
/// LocalAllreduce: allreduce of buffers that the ranks of one host keep in shared memory, with
/// no transport and no copies in between.
///
/// Every rank owns a SharedSegment: a control block (flags) and a data region in which it keeps
/// the buffers to reduce (a DistributedModule's buckets), at the same offset on every rank; every
/// rank maps every other rank's segment. A reduction of slot s (a buffer) then goes:
///   1. allreduce() publishes "slot s ready, generation g" in this rank's control block (the
///      buffer holds this rank's contribution and stays untouched until the reduction ends);
///   2. this rank's worker thread waits until every rank has published generation g of slot s,
///      then reduces its share of the buffer (block `rank` of world_size blocks, cut at 64-byte
///      lines) straight from every rank's memory, and writes the result into every rank's buffer.
///      With two ranks whose contributions came more than 1 ms apart, the first reduces the whole
///      buffer and the later one none of it: the later one is still computing (its backward pass
///      lags), and its half would take a core from it on its critical path;
///   3. it publishes "slot s done, generation g"; the reduction ends, and its callback runs, once
///      every rank has published that.
/// Each rank reads every buffer's share once and writes it once per rank: a ring allreduce over
/// a shared-memory transport copies each byte into and out of the transport's queues as well.
/// All ranks end with the same bits: each share is summed in rank order by one rank.
///
/// Slots are independent: a rank may submit them in any order (buckets fill in different orders
/// on different ranks); every rank must submit each slot the same number of times. Waiting never
/// spins: a rank that publishes a flag rings its peers' doorbells (a futex in shared memory).
///
/// Failures: an operation that has not ended `timeout` after it was submitted fails, naming the
/// slot and the ranks it waits for, and so does everything after it; abort() (a rank died) fails
/// what is pending and everything later at once, but an operation whose every rank had written
/// its share still ends well (the rank that died may have finished it and gone on). Callbacks run
/// on the worker thread: they must be short and must not block.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport/transport.h"
#include "comm/types.h"

namespace troupe::comm {

class Communicator;
class SharedSegment;

/// How a LocalAllreduce combines the ranks' buffers.
struct LocalReduce {
  /// sum, avg (sum, then divide by the world size as comm::divide does), min or max.
  ReduceOp op = ReduceOp::sum;
  /// With op sum: the result times `scale` (an average by any denominator).
  double scale = 1.0;
  /// Multiply each rank's values by `scale` before summing, not the sum after (against overflow
  /// in narrow types; DdpOptions::divide_before).
  bool scale_before = false;

  /// A sum times `scale` over `world` ranks, as the reductions of comm/compression do it: a plain
  /// sum for scale 1, the scale before the sum with `before`, avg where scale is 1 / world, else
  /// the scale after the sum.
  static LocalReduce scaled(double scale, bool before, int world);
};

/// Where each rank's contribution to a buffer of LocalAllreduce::allreduce lies when it is not in
/// the buffer itself (a gradient left where autograd allocated it, in the rank's region): the
/// buffer cut into pieces, element ranges ascending and disjoint, the same on every rank; and in
/// every rank's data region, at byte `table`, one uint64 per piece: the byte offset, in that
/// rank's region, of its contribution to the piece (the piece's own place in the buffer where it
/// is there). A rank writes its table before allreduce() and leaves the table and its
/// contributions untouched until the reduction ends. The result is written into the buffer on
/// every rank, or with `in_place` over every rank's contributions (where its table says: a piece
/// whose entry is its place in the buffer gets it there, one kept elsewhere gets it there and its
/// place in the buffer is left alone); the buffer's elements outside every piece are left as they
/// are.
struct LocalSources {
  size_t table = 0;
  std::vector<size_t> first;  // each piece's first element of the buffer
  std::vector<size_t> count;  // and its length
  bool in_place = false;
};

class LocalAllreduce {
 public:
  /// Slots are 0 .. kMaxSlots-1.
  static constexpr int kMaxSlots = 4096;

  /// Collective over `comm`, whose ranks must all be on this host: rank 0 draws a name, every
  /// rank creates its segment with `data_bytes` of data, maps every other rank's, and unlinks its
  /// own name once all have mapped it (nothing stays in /dev/shm, even if a process dies later).
  /// `timeout` is each operation's deadline. Throws comm::Error naming the segment and the cause.
  static std::shared_ptr<LocalAllreduce> connect(Communicator& comm, size_t data_bytes,
                                                 std::chrono::milliseconds timeout);
  /// Fails what is still pending ("shut down") and stops the worker.
  ~LocalAllreduce();
  LocalAllreduce(const LocalAllreduce&) = delete;
  LocalAllreduce& operator=(const LocalAllreduce&) = delete;

  int rank() const;
  int world_size() const;
  /// This rank's data region: data_bytes() bytes, 4096-byte aligned, zero at first.
  char* data() const;
  size_t data_bytes() const;
  /// Keeps this rank's region mapped while it lives (after this LocalAllreduce is gone too): for
  /// memory of the region handed out beyond it (ddp/gradient_arena.h).
  std::shared_ptr<void> region_keeper() const;

  /// Reduces in place, on every rank, `count` elements of `type` at byte `offset` of the data
  /// region, as slot `slot`; `done` runs when every rank's buffer holds the result (or with a
  /// failure). Throws comm::Error for a slot outside 0..kMaxSlots-1, a range outside the region,
  /// an offset not aligned to the element, or a scale with an op other than sum; nothing is
  /// queued then. With `sources`, each rank's contribution is read from where its table says
  /// (LocalSources), not from the buffer; an entry of another rank's table outside its region or
  /// not aligned to the element fails the operation, naming the rank, the piece and the offset.
  void allreduce(int slot, size_t offset, size_t count, DataType type, const LocalReduce& how,
                 Callback done, std::shared_ptr<const LocalSources> sources = nullptr);

  /// Allreduces, in place, `count` elements of `type` at `data`: memory of this process, not the
  /// shared region. Runs on the calling thread (no worker, no callback), for
  /// Communicator::allreduce; every rank calls it with the same count, type and op. The region
  /// serves as data_bytes() / chunk_bytes staging slots (at least 2), taken in turn by chunks of
  /// the buffer; per chunk each rank
  ///   1. copies the shares the other ranks reduce into its slot (its own share stays put),
  ///   2. reduces its share from its own memory and the others' slots, in rank order, and writes
  ///      the result into its memory and into its own share of its slot,
  ///   3. copies the other ranks' results from their slots into its memory (one chunk behind).
  /// Each byte of the buffer is thus copied twice per rank at most and the ranks' results agree
  /// bit for bit. A rank waits for another's step (flags in the control blocks, monotonic chunk
  /// counts) by spinning for a few microseconds, then on a futex; each wait ends at `timeout` with
  /// comm::Error naming the ranks and the step, and at once after abort(). A failure breaks the
  /// LocalAllreduce (every later call fails): the ranks' counts no longer agree. Not for a
  /// LocalAllreduce whose region also holds slots of allreduce() above.
  void allreduce_private(void* data, size_t count, DataType type, ReduceOp op, size_t chunk_bytes);

  /// Fails every pending and later operation with `why` (from any thread; returns at once).
  void abort(const Status& why);

  /// The ranks whose flags the latest operation of `slot` still waits for; once this
  /// LocalAllreduce has failed, the ranks its failure names (those it timed out waiting for, or
  /// abort()'s peer); otherwise empty when none is pending.
  std::vector<int> waiting_on(int slot) const;

  /// Bytes this rank writes into (and reads from) other ranks' memory reducing `count` elements of
  /// `type`: its equal share times world_size - 1 (what it moves on average; with two ranks one
  /// of them may reduce a whole buffer, see step 2 above).
  size_t peer_bytes(size_t count, DataType type) const;

  /// Elements this rank's worker has reduced since connect (its shares of allreduce()).
  uint64_t elements_reduced() const;

  struct Impl;

 private:
  explicit LocalAllreduce(std::unique_ptr<Impl> impl);
  void check_sources(const std::string& call, const LocalSources& sources, size_t count,
                     DataType type) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::comm
