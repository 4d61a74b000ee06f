#include "rank/membership_wire.h"

#include <cstring>

#include "comm/status.h"

namespace troupe::elastic {

std::string encode(Message type, const std::vector<std::string>& fields) {
  std::string bytes(1, static_cast<char>(type));
  for (const auto& f : fields) {
    const uint32_t n = static_cast<uint32_t>(f.size());
    bytes.append(reinterpret_cast<const char*>(&n), sizeof n);
    bytes += f;
  }
  return bytes;
}

std::pair<Message, std::vector<std::string>> decode(const std::string& bytes,
                                                    const std::string& what) {
  if (bytes.empty() || bytes[0] < 1 || bytes[0] > static_cast<char>(Message::leave))
    throw comm::Error(what + ": a membership message of " + std::to_string(bytes.size()) +
                      " bytes with an unknown type (expected 1..7)");
  std::vector<std::string> fields;
  size_t at = 1;
  while (at < bytes.size()) {
    uint32_t n = 0;
    if (bytes.size() - at < sizeof n)
      throw comm::Error(what + ": a membership message ends inside a field length");
    std::memcpy(&n, bytes.data() + at, sizeof n);
    at += sizeof n;
    if (bytes.size() - at < n)
      throw comm::Error(what + ": a membership field of " + std::to_string(n) +
                        " bytes overruns its message");
    fields.emplace_back(bytes.data() + at, n);
    at += n;
  }
  return {static_cast<Message>(bytes[0]), std::move(fields)};
}

}  // namespace troupe::elastic
