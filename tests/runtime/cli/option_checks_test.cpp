// The option checks of troupe's tools: messages that name the flag, the value and what is
// allowed; byte sizes parsed strictly; and sizes refused when the host cannot hold them.
#include "tools/cli/option_checks.h"

#include <doctest/doctest.h>

#include <limits>
#include <string>
#include <vector>

using namespace troupe;

namespace {

/// Parses `args` for one option `flag` checked by `check`; returns CLI11's error ("" when none).
template <class T>
std::string parse_error(const std::string& flag, const CLI::Validator& check,
                        const std::string& value) {
  CLI::App app;
  T target{};
  app.add_option(flag, target)->check(check);
  std::vector<std::string> args = {value, flag};  // CLI11 reads them from the back
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return "";
}

std::string size_error(const std::string& list, std::optional<uint64_t> available = {}) {
  try {
    auto sizes = cli::parse_byte_sizes(list, sizeof(float));
    cli::check_memory(sizes[0] * 2, available, "--bytes " + list + " on 2 rank(s)");
  } catch (const comm::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a floating option names the flag, the value and the range for nan, infinity and 0") {
  auto lr = [](const std::string& v) {
    return parse_error<double>("--lr", cli::number_above(0), v);
  };
  CHECK(lr("nan") == "--lr: nan is not a finite number (expected a number > 0)");
  CHECK(lr("inf") == "--lr: inf is not a finite number (expected a number > 0)");
  CHECK(lr("0") == "--lr: 0 is out of range (expected a number > 0)");
  CHECK(lr("-1e-3") == "--lr: -1e-3 is out of range (expected a number > 0)");
  CHECK(lr("fast") == "--lr: 'fast' is not a number (expected a number > 0)");
  CHECK(lr("0.05") == "");
  auto momentum = [](const std::string& v) {
    return parse_error<double>("--momentum", cli::number_in(0, 1, true), v);
  };
  CHECK(momentum("1") == "--momentum: 1 is out of range (expected a number in [0, 1))");
  CHECK(momentum("0") == "");
  CHECK(parse_error<double>("--timeout", cli::number_at_least(0), "-5") ==
        "--timeout: -5 is out of range (expected a number >= 0)");
  auto timeout = [](const std::string& v) {
    return parse_error<double>("--collective-timeout", cli::number_above(0, 1e9), v);
  };
  CHECK(timeout("0") ==
        "--collective-timeout: 0 is out of range (expected a number in (0, 1e+09])");
  CHECK(timeout("1e10") ==
        "--collective-timeout: 1e10 is out of range (expected a number in (0, 1e+09])");
  CHECK(timeout("nan") ==
        "--collective-timeout: nan is not a finite number (expected a number in (0, 1e+09])");
  CHECK(timeout("1e9") == "");
  CHECK(timeout("0.001") == "");
}

TEST_CASE("an integer option names the flag, the value and the range, overflow included") {
  auto epochs = [](const std::string& v) {
    return parse_error<int>("--epochs", cli::integer_in(1, std::numeric_limits<int>::max()), v);
  };
  CHECK(epochs("0") == "--epochs: 0 is out of range (expected an integer >= 1)");
  CHECK(epochs("99999999999999999999") ==
        "--epochs: 99999999999999999999 is out of range (expected an integer >= 1)");
  CHECK(epochs("2.5") == "--epochs: '2.5' is not an integer (expected an integer >= 1)");
  CHECK(epochs("3") == "");
  CHECK(parse_error<int>("--nprocs", cli::integer_in(1, 4096), "100000") ==
        "--nprocs: 100000 is out of range (expected an integer in 1..4096)");
}

TEST_CASE("byte sizes are positive whole numbers of elements with a known unit") {
  CHECK(cli::parse_byte_sizes("4KiB,1MiB,8,2G", 4) ==
        std::vector<size_t>{4096, 1048576, 8, size_t{2} << 30});
  CHECK(size_error("-5") ==
        "--bytes: size '-5' is not a number (expected a positive whole number of bytes with an "
        "optional unit B, KiB, MiB or GiB, e.g. 4KiB)");
  CHECK(size_error("3") ==
        "--bytes: size '3' is not a whole number of 4-byte elements (expected a multiple of 4 "
        "bytes, e.g. 4)");
  CHECK(size_error("0KiB").find("--bytes: size '0KiB' is zero") == 0);
  CHECK(size_error("1.5KiB") ==
        "--bytes: size '1.5KiB' has unit '.5KiB' (expected B, KiB, MiB "
        "or GiB)");
  CHECK(size_error("99999999999999999999GiB").find("is too large") != std::string::npos);
  CHECK(size_error("17179869184GiB").find("is too large") != std::string::npos);  // 2^64 bytes
  CHECK(size_error(",").find("names no size") != std::string::npos);
}

TEST_CASE("a size the host cannot hold is refused naming it and the memory available") {
  const uint64_t gib = uint64_t{1} << 30;
  CHECK(size_error("1024GiB", 60 * gib) ==
        "--bytes 1024GiB on 2 rank(s) needs at least 2 TiB of memory but this host has 60 GiB "
        "available (MemAvailable in /proc/meminfo)");
  CHECK(size_error("1GiB", 60 * gib) == "");
  CHECK(size_error("1024GiB", std::nullopt) == "");  // unknown: not refused
  // This host's own figure: present and below 2^60 bytes, so 2^60 is refused here.
  const auto here = cli::available_memory();
  REQUIRE(here.has_value());
  CHECK(*here > 0);
  CHECK_THROWS_AS(cli::check_memory(uint64_t{1} << 60, here, "a test"), comm::Error);
  CHECK(cli::bytes_text(uint64_t{3} << 29) == "1.5 GiB");
}
