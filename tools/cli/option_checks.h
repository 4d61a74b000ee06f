#pragma once
/// Option checks of troupe's command-line tools (troupe, the examples): CLI11 validators whose
/// messages name the flag, the value and what is allowed, where CLI11's own ranges print
/// "Value 0 not in range 0.000000 to 1.797e308" and let nan through; the byte sizes of
/// `troupe bench allreduce --bytes`; and the check that a size fits in the memory this host has.
///
///   app.add_option("--lr", lr, "Learning rate")->check(troupe::cli::number_above(0));
///   // troupe: --lr: nan is not a finite number (expected a number > 0)
///
/// Header-only: each tool compiles it with its own CLI11.
#include <CLI/CLI.hpp>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "comm/status.h"

namespace troupe::cli {

namespace detail {

inline std::string number_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

/// "a number > 0", "a number in [0, 1)", "a number >= 0".
inline std::string number_expected(double min, bool min_open, double max, bool max_open) {
  if (std::isinf(max))
    return std::string("a number ") + (min_open ? "> " : ">= ") + number_text(min);
  return "a number in " + std::string(min_open ? "(" : "[") + number_text(min) + ", " +
         number_text(max) + (max_open ? ")" : "]");
}

/// Empty when `input` is a finite number in the range, else why not ("nan is not a finite
/// number (expected a number > 0)"); CLI11 puts the flag in front.
inline std::string check_number(const std::string& input, double min, bool min_open, double max,
                                bool max_open) {
  const std::string expected = " (expected " + number_expected(min, min_open, max, max_open) + ")";
  char* end = nullptr;
  errno = 0;
  const double x = input.empty() ? 0 : std::strtod(input.c_str(), &end);
  if (input.empty() || end != input.c_str() + input.size() ||
      std::isspace(static_cast<unsigned char>(input[0])))
    return "'" + input + "' is not a number" + expected;
  if (!std::isfinite(x)) return input + " is not a finite number" + expected;
  if ((min_open ? x <= min : x < min) || (max_open ? x >= max : x > max))
    return input + " is out of range" + expected;
  return "";
}

}  // namespace detail

/// A finite number > min.
inline CLI::Validator number_above(double min) {
  return CLI::Validator(
      [=](std::string& input) {
        return detail::check_number(input, min, true, std::numeric_limits<double>::infinity(),
                                    false);
      },
      "NUMBER > " + detail::number_text(min));
}

/// A finite number > min and <= max (a duration, say, that must stay within a clock's range).
inline CLI::Validator number_above(double min, double max) {
  return CLI::Validator(
      [=](std::string& input) { return detail::check_number(input, min, true, max, false); },
      "NUMBER in " + detail::number_expected(min, true, max, false).substr(12));
}

/// A finite number >= min.
inline CLI::Validator number_at_least(double min) {
  return CLI::Validator(
      [=](std::string& input) {
        return detail::check_number(input, min, false, std::numeric_limits<double>::infinity(),
                                    false);
      },
      "NUMBER >= " + detail::number_text(min));
}

/// A finite number in [min, max], or [min, max) when max_open.
inline CLI::Validator number_in(double min, double max, bool max_open = false) {
  return CLI::Validator(
      [=](std::string& input) { return detail::check_number(input, min, false, max, max_open); },
      "NUMBER in " + detail::number_expected(min, false, max, max_open).substr(12));
}

/// An integer in [min, max], written in decimal digits with an optional sign.
inline CLI::Validator integer_in(long long min, long long max) {
  const std::string expected =
      max == std::numeric_limits<long long>::max() || max == std::numeric_limits<int>::max()
          ? "an integer >= " + std::to_string(min)
          : "an integer in " + std::to_string(min) + ".." + std::to_string(max);
  return CLI::Validator(
      [=](std::string& input) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long x = input.empty() ? 0 : std::strtoll(input.c_str(), &end, 10);
        if (input.empty() || end != input.c_str() + input.size() ||
            std::isspace(static_cast<unsigned char>(input[0])))
          return "'" + input + "' is not an integer (expected " + expected + ")";
        if (errno == ERANGE || x < min || x > max)
          return input + " is out of range (expected " + expected + ")";
        return "";
      },
      expected);
}

/// "1 GiB", "3 MiB", "4 KiB", "100 B" when exact, else "57.3 GiB".
inline std::string bytes_text(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int unit = 0;
  double value = static_cast<double>(bytes);
  while (value >= 1024 && unit < 6) {
    value /= 1024;
    ++unit;
  }
  char buf[32];
  if (value == std::floor(value))
    std::snprintf(buf, sizeof buf, "%.0f %s", value, units[unit]);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", value, units[unit]);
  return buf;
}

/// One size of `flag`: decimal digits and an optional unit B, KiB (K), MiB (M) or GiB (G), a
/// positive multiple of `element_size` bytes. Throws comm::Error naming the flag, the entry and
/// what was expected for a sign, a fraction, an unknown unit, zero, an overflow or a remainder.
inline uint64_t parse_byte_size(const std::string& text, size_t element_size,
                                const std::string& flag = "--bytes") {
  const std::string expected =
      " (expected a positive whole number of bytes with an optional "
      "unit B, KiB, MiB or GiB, e.g. 4KiB)";
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0) throw comm::Error(flag + ": size '" + text + "' is not a number" + expected);
  const std::string unit = text.substr(digits);
  uint64_t scale = 0;
  if (unit.empty() || unit == "B")
    scale = 1;
  else if (unit == "KiB" || unit == "K")
    scale = uint64_t{1} << 10;
  else if (unit == "MiB" || unit == "M")
    scale = uint64_t{1} << 20;
  else if (unit == "GiB" || unit == "G")
    scale = uint64_t{1} << 30;
  else
    throw comm::Error(flag + ": size '" + text + "' has unit '" + unit +
                      "' (expected B, KiB, MiB or GiB)");
  uint64_t value = 0;
  for (size_t i = 0; i < digits; ++i) {
    const uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - digit) / 10)
      throw comm::Error(flag + ": size '" + text + "' is too large" + expected);
    value = value * 10 + digit;
  }
  if (value > std::numeric_limits<uint64_t>::max() / scale)
    throw comm::Error(flag + ": size '" + text + "' is too large" + expected);
  const uint64_t bytes = value * scale;
  if (bytes == 0) throw comm::Error(flag + ": size '" + text + "' is zero" + expected);
  if (bytes % element_size != 0)
    throw comm::Error(flag + ": size '" + text + "' is not a whole number of " +
                      std::to_string(element_size) + "-byte elements (expected a multiple of " +
                      std::to_string(element_size) + " bytes, e.g. " +
                      std::to_string(bytes - bytes % element_size + element_size) + ")");
  return bytes;
}

/// A comma-separated list of parse_byte_size's sizes, e.g. "4KiB,1MiB,64MiB".
inline std::vector<size_t> parse_byte_sizes(const std::string& list, size_t element_size,
                                            const std::string& flag = "--bytes") {
  std::vector<size_t> sizes;
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    const std::string item = list.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    const uint64_t bytes = parse_byte_size(item, element_size, flag);
    if (bytes > std::numeric_limits<size_t>::max())
      throw comm::Error(flag + ": size '" + item + "' is too large for this machine");
    sizes.push_back(static_cast<size_t>(bytes));
  }
  if (sizes.empty()) throw comm::Error(flag + " '" + list + "' names no size");
  return sizes;
}

/// The memory this host can give without swapping (MemAvailable of /proc/meminfo), or nullopt
/// when it cannot be read.
inline std::optional<uint64_t> available_memory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (meminfo >> key >> kib) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

/// Throws comm::Error when `needed` bytes exceed `available`, naming `what` (the flag and what
/// the bytes are for) and both sizes; says nothing when `available` is unknown.
inline void check_memory(uint64_t needed, std::optional<uint64_t> available,
                         const std::string& what) {
  if (!available || needed <= *available) return;
  throw comm::Error(what + " needs at least " + bytes_text(needed) +
                    " of memory but this host has " + bytes_text(*available) +
                    " available (MemAvailable in /proc/meminfo)");
}

}  // namespace troupe::cli
