#pragma once
/// The membership wire: the messages between a rank (rank/membership_client.h) and the elastic
/// job's membership service (elastic/membership.h, which says what each message means and when
/// it is sent). A message is a type byte, then fields, each a 32-bit length and its bytes.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace troupe::elastic {

using Clock = std::chrono::steady_clock;

/// The messages of the membership wire (first byte of each).
enum class Message : uint8_t {
  join = 1,
  reform = 2,
  assign = 3,
  address = 4,
  table = 5,
  stop = 6,
  leave = 7
};

/// The largest message either side sends (a table of every rank's UCX address).
inline constexpr size_t kMaxMessageBytes = 4u << 20;
/// The largest transport address a rank may register (a UCX worker address is a few hundred
/// bytes) and the longest host name.
inline constexpr size_t kMaxAddressBytes = 64 * 1024;
inline constexpr size_t kMaxHostBytes = 255;

/// The body of a message: the type, then fields (helpers shared by both sides).
std::string encode(Message type, const std::vector<std::string>& fields);
/// Splits a message into its type and fields; throws comm::Error naming `what` when malformed.
std::pair<Message, std::vector<std::string>> decode(const std::string& bytes,
                                                    const std::string& what);

}  // namespace troupe::elastic
