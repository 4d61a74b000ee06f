#pragma once
/// The collectives, each a Schedule builder written once against the Transport interface.
///
/// A builder returns the Schedule of one rank; run it with an Execution (schedule.h) on a driver.
/// Communicator (communicator.h) wraps them as blocking calls. Buffers are the caller's and must
/// stay valid until the execution ends. Element counts may be 0 and need not divide the world size.
/// docs/algorithms.md gives each algorithm's steps and bytes on the wire.
#include <cstddef>
#include <functional>
#include <vector>

#include "comm/collectives/schedule.h"
#include "comm/types.h"

namespace troupe::comm {

/// The ring's chunk when every rank shares one host: chosen with `troupe bench allreduce` on 2
/// cores over shared memory.
constexpr size_t kChunkBytesOneHost = 512 << 10;
/// The ring's chunk when the ranks span several hosts. Over TCP, UCX's progress thread wakes for
/// every message and each wake waits for a CPU slice on a busy machine; 512 KiB chunks made
/// 2 x 96 ring steps for 64 MiB over 4 hosts and reached ~60% of gloo at 1 Gbit/s, 8 MiB chunks
/// 0.86-1.00 of it (docs/benchmarks-archive.md, "Where the gap comes from").
constexpr size_t kChunkBytesAcrossHosts = 8 << 20;

/// Tuning of the collectives; the defaults were chosen with `troupe bench allreduce` on 2 cores.
struct CollectiveOptions {
  /// At or below this many bytes, allreduce uses recursive doubling and broadcast a binomial tree
  /// (latency-optimal); above, ring reduce-scatter + allgather and scatter + allgather.
  size_t small_bytes = 64 * 1024;
  /// Ring collectives cut each rank's block into chunks of about this size, run as parallel lanes.
  /// 0 (the default): chosen by the job's layout, see for_layout() below; a collective that runs
  /// with 0 uses kChunkBytesOneHost. Any other value is used as it is, whatever the layout.
  size_t chunk_bytes = 0;
  /// At most this many lanes (chunks in flight) per collective.
  int max_lanes = 2;
  /// When every rank of the job is on one host (and the Runtime emulates no links), allreduce
  /// above small_bytes goes through shared memory (Communicator::use_shared_memory) instead of
  /// the transport. Off: through the transport, as across hosts.
  bool shared_memory = true;
  /// The host of each rank (any integers). When set, the gradient buckets of GradientAllReduce
  /// reduce hierarchically (hierarchical_allreduce_stages); empty: flat.
  std::vector<int> hosts;
};

/// `options` with its layout-dependent defaults filled in for a job whose rank r is on real host
/// `real_hosts[r]` (any integers; Runtime::real_hosts()): chunk_bytes 0 becomes
/// kChunkBytesAcrossHosts when the ranks span two or more hosts, else kChunkBytesOneHost. A value
/// the user set stays as it is.
CollectiveOptions for_layout(CollectiveOptions options, const std::vector<int>& real_hosts);

/// Which rank this schedule is for.
struct Group {
  int rank;
  int world_size;
};

/// data := op over all ranks of data (in place). Chooses by size between the two below.
Schedule allreduce_schedule(Group g, void* data, size_t count, DataType type, ReduceOp op,
                            const CollectiveOptions& options);
/// Hierarchical allreduce for jobs spread over hosts: `host_of[r]` is the host (any integer) of
/// rank r. Three stages, each a Schedule of its own (run them as schedule.h's stages, each under
/// its own key): (1) every rank of a host sends its buffer to the host's leader (its lowest rank),
/// which reduces them; (2) the leaders allreduce among themselves (allreduce_schedule over the
/// leaders); (3) each leader sends the result to the other ranks of its host. Bytes across hosts:
/// those of an allreduce among H leaders instead of among W ranks. avg divides by the world size at
/// the end. Throws comm::Error when host_of does not have world_size entries.
std::vector<std::function<Schedule()>> hierarchical_allreduce_stages(
    Group g, const std::vector<int>& host_of, void* data, size_t count, DataType type, ReduceOp op,
    const CollectiveOptions& options);

/// Ring reduce-scatter then ring allgather, pipelined in lanes: bandwidth-optimal,
/// 2(W-1)/W * bytes sent per rank.
Schedule ring_allreduce_schedule(Group g, void* data, size_t count, DataType type, ReduceOp op,
                                 const CollectiveOptions& options);
/// Recursive doubling (with a fold for world sizes that are not powers of two): latency-optimal,
/// ceil(log2 W) rounds of the whole buffer.
Schedule recursive_doubling_allreduce_schedule(Group g, void* data, size_t count, DataType type,
                                               ReduceOp op);

/// out := block `rank` of (op over all ranks of in), where `in` has `count` elements split into
/// world_size balanced blocks (block_range below). `out` holds block_range(rank).size elements.
Schedule reduce_scatter_schedule(Group g, const void* in, void* out, size_t count, DataType type,
                                 ReduceOp op, const CollectiveOptions& options);

/// out := concatenation over ranks of each rank's `in` of counts[rank] elements. `in` may point
/// into `out` at this rank's displacement (in place).
Schedule allgatherv_schedule(Group g, const void* in, void* out, const std::vector<size_t>& counts,
                             DataType type, const CollectiveOptions& options);
/// allgatherv with the same count on every rank.
Schedule allgather_schedule(Group g, const void* in, void* out, size_t count_per_rank,
                            DataType type, const CollectiveOptions& options);

/// out block j := block `rank` of rank j's in; blocks of count_per_rank elements.
Schedule alltoall_schedule(Group g, const void* in, void* out, size_t count_per_rank,
                           DataType type);

/// data := root's data on every rank.
Schedule broadcast_schedule(Group g, void* data, size_t count, DataType type, int root,
                            const CollectiveOptions& options);

/// Ends only when every rank has entered it (dissemination: ceil(log2 W) rounds of 1 byte).
Schedule barrier_schedule(Group g);

/// [begin, end) of block `index` when `count` elements are split into `parts` balanced blocks.
struct Range {
  size_t begin;
  size_t end;
  size_t size() const { return end - begin; }
};
inline Range block_range(size_t count, int parts, int index) {
  const size_t p = static_cast<size_t>(parts), i = static_cast<size_t>(index);
  return Range{count * i / p, count * (i + 1) / p};
}

}  // namespace troupe::comm
