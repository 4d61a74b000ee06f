#pragma once
/// The settings of link emulation (comm/transport/link_emulation.h): the shape of a link (a rate
/// and a latency), their parsers, and a job's shapes per rank. Plain data, so that RuntimeOptions
/// and the environment readers can hold them without the transport that applies them.
#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace troupe::comm {

/// The shape of one directed link. Default: unlimited bandwidth, no latency (not shaped).
struct LinkShape {
  /// Bytes per second; 0 means unlimited.
  double bytes_per_sec = 0;
  /// Added to every message after its last byte has left.
  std::chrono::microseconds latency{0};
  /// True when the link is shaped at all.
  bool active() const { return bytes_per_sec > 0 || latency.count() > 0; }
};

/// Parses a shape: a rate, a latency, or both separated by a comma, e.g. "1gbit,5ms", "100mbit",
/// "10GB/s,200us", "5ms"; "none" (or "") is no shaping. Rates: bit, kbit, mbit, gbit (any case)
/// or B, KB, MB, GB (upper-case B), each optionally followed by "/s"; all decimal (1 KB = 1000 B,
/// 1 gbit = 10^9 bit). Latencies: us, ms, s. Throws comm::Error (comm/status.h) naming the text and
/// the expected form.
LinkShape parse_link_shape(const std::string& text);

/// Parses links to and from chosen ranks: entries RANK=SHAPE separated by ';', e.g.
/// "3=100mbit,20ms" or "1=10ms;3=100mbit". Throws comm::Error naming the text and the bad entry
/// (a rank that is not a non-negative integer, a bad shape, a rank named twice).
std::vector<std::pair<int, LinkShape>> parse_rank_links(const std::string& text);

/// The link emulation of a job: a shape for every link, and ranks whose links (to them and from
/// them) have a shape of their own — "one slow rank". Use it through RuntimeOptions::links or
/// the TROUPE_LINK / TROUPE_LINK_RANKS variables (rank/env.h).
struct LinkEmulation {
  LinkShape all;
  std::vector<std::pair<int, LinkShape>> ranks;

  bool active() const;
  /// The shapes of `rank`'s outgoing links, indexed by peer. A link to or from a rank of `ranks`
  /// has that rank's shape instead of `all` (between two such ranks: the slower rate and the
  /// longer latency); a rank's link to itself is never shaped. Throws comm::Error when `ranks`
  /// names a rank outside [0, world_size).
  std::vector<LinkShape> outgoing(int rank, int world_size) const;
};

}  // namespace troupe::comm
