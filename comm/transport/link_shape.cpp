#include "comm/transport/link_shape.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "comm/status.h"

namespace troupe::comm {

namespace {

constexpr const char* kShapeExpected =
    "a rate such as 1gbit, 100mbit or 10GB/s (units bit, kbit, mbit, gbit, B, KB, MB, GB per "
    "second, decimal), a latency such as 5ms, 200us or 1s, both separated by a comma, or none";
constexpr double kMaxLatencyUs = 60e6;  // a minute: anything longer is a typo, not a network

std::string trim(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(s[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(s[end - 1]))) --end;
  return s.substr(begin, end - begin);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::vector<std::string> split(const std::string& s, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t end = s.find(separator, start);
    parts.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return parts;
    start = end + 1;
  }
}

/// Bytes per second in one unit of a rate, or 0 when `unit` is not a rate.
double rate_unit(std::string unit) {
  if (unit.size() > 2 && unit.compare(unit.size() - 2, 2, "/s") == 0) unit.resize(unit.size() - 2);
  const std::string l = lower(unit);
  if (l == "bit") return 1.0 / 8;
  if (l == "kbit") return 1e3 / 8;
  if (l == "mbit") return 1e6 / 8;
  if (l == "gbit") return 1e9 / 8;
  // Bytes only with an upper-case B: "gb" could as well mean gigabits.
  if (unit == "B") return 1;
  if (unit == "KB" || unit == "kB") return 1e3;
  if (unit == "MB") return 1e6;
  if (unit == "GB") return 1e9;
  return 0;
}

/// Microseconds in one unit of a latency, or 0 when `unit` is not a latency.
double latency_unit(const std::string& unit) {
  if (unit == "us") return 1;
  if (unit == "ms") return 1e3;
  if (unit == "s") return 1e6;
  return 0;
}

/// Slower of two shapes, component by component (0 bandwidth means unlimited).
LinkShape slower(const LinkShape& a, const LinkShape& b) {
  LinkShape s;
  if (a.bytes_per_sec > 0 && b.bytes_per_sec > 0)
    s.bytes_per_sec = std::min(a.bytes_per_sec, b.bytes_per_sec);
  else
    s.bytes_per_sec = std::max(a.bytes_per_sec, b.bytes_per_sec);
  s.latency = std::max(a.latency, b.latency);
  return s;
}

}  // namespace

LinkShape parse_link_shape(const std::string& text) {
  const std::string whole = trim(text);
  LinkShape shape;
  if (whole.empty() || lower(whole) == "none") return shape;
  auto fail = [&](const std::string& problem) -> Error {
    return Error("link shape '" + text + "': " + problem + " (expected " + kShapeExpected + ")");
  };
  bool have_rate = false, have_latency = false;
  for (const std::string& raw : split(whole, ',')) {
    const std::string part = trim(raw);
    if (part.empty()) throw fail("an empty part");
    size_t i = 0;
    bool digits = false;
    while (i < part.size() && std::isdigit(static_cast<unsigned char>(part[i]))) ++i, digits = true;
    if (i < part.size() && part[i] == '.') {
      ++i;
      while (i < part.size() && std::isdigit(static_cast<unsigned char>(part[i])))
        ++i, digits = true;
    }
    if (!digits) throw fail("'" + part + "' does not start with a number");
    const double value = std::stod(part.substr(0, i));
    const std::string unit = trim(part.substr(i));
    if (unit.empty()) throw fail("'" + part + "' has no unit");
    if (double scale = rate_unit(unit); scale > 0) {
      if (have_rate) throw fail("two rates");
      if (!(value > 0)) throw fail("rate '" + part + "' is not positive");
      shape.bytes_per_sec = value * scale;
      have_rate = true;
    } else if (double us = latency_unit(unit); us > 0) {
      if (have_latency) throw fail("two latencies");
      if (value * us > kMaxLatencyUs) throw fail("latency '" + part + "' is over a minute");
      shape.latency = std::chrono::microseconds(std::llround(value * us));
      have_latency = true;
    } else {
      throw fail("'" + part + "' has unit '" + unit + "'");
    }
  }
  return shape;
}

std::vector<std::pair<int, LinkShape>> parse_rank_links(const std::string& text) {
  std::vector<std::pair<int, LinkShape>> links;
  for (const std::string& raw : split(text, ';')) {
    const std::string entry = trim(raw);
    if (entry.empty()) continue;
    auto fail = [&](const std::string& problem) -> Error {
      return Error("link ranks '" + text + "': entry '" + entry + "' " + problem +
                   " (expected RANK=SHAPE entries separated by ';', e.g. 3=100mbit,20ms)");
    };
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) throw fail("has no '='");
    const std::string rank_text = trim(entry.substr(0, eq));
    if (rank_text.empty() || rank_text.size() > 9 ||
        !std::all_of(rank_text.begin(), rank_text.end(),
                     [](unsigned char c) { return std::isdigit(c); }))
      throw fail("names rank '" + rank_text + "', not a non-negative integer");
    const int rank = std::stoi(rank_text);
    for (const auto& [r, s] : links)
      if (r == rank) throw fail("names rank " + rank_text + " a second time");
    try {
      links.emplace_back(rank, parse_link_shape(entry.substr(eq + 1)));
    } catch (const Error& e) {
      throw Error("link ranks '" + text + "': " + e.what());
    }
  }
  return links;
}

bool LinkEmulation::active() const {
  return all.active() || std::any_of(ranks.begin(), ranks.end(),
                                     [](const auto& entry) { return entry.second.active(); });
}

std::vector<LinkShape> LinkEmulation::outgoing(int rank, int world_size) const {
  std::vector<const LinkShape*> special(static_cast<size_t>(std::max(world_size, 0)), nullptr);
  for (const auto& [r, shape] : ranks) {
    if (r < 0 || r >= world_size)
      throw Error("link emulation names rank " + std::to_string(r) + " (expected a rank in [0, " +
                  std::to_string(world_size) + "))");
    special[static_cast<size_t>(r)] = &shape;
  }
  std::vector<LinkShape> shapes(special.size(), all);
  if (rank < 0 || rank >= world_size) return shapes;
  for (int peer = 0; peer < world_size; ++peer) {
    const LinkShape* mine = special[static_cast<size_t>(rank)];
    const LinkShape* theirs = special[static_cast<size_t>(peer)];
    LinkShape& s = shapes[static_cast<size_t>(peer)];
    if (peer == rank)
      s = LinkShape{};
    else if (mine && theirs)
      s = slower(*mine, *theirs);
    else if (mine || theirs)
      s = mine ? *mine : *theirs;
  }
  return shapes;
}

}  // namespace troupe::comm
