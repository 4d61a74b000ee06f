// The bucket algorithms' settings: the command line's --algorithm string and the job file's
// [algorithm] table read the same table (comm/compression/settings.h) and give the same struct.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <variant>

#include "comm/compression/settings.h"
#include "comm/overloaded.h"
#include "comm/status.h"
#include "tools/job_config.h"

using namespace troupe;

namespace {

/// Every field of the two structs, compared by hand (not through the table under test).
bool same(const comm::Compression& a, const comm::Compression& b) {
  if (a.index() != b.index()) return false;
  return std::visit(
      Overloaded{
          [](const comm::GradientAllReduce&) { return true; },
          [&](const comm::HalfPrecision& x) {
            return x.bfloat16 == std::get<comm::HalfPrecision>(b).bfloat16;
          },
          [&](const comm::ByteGrad& x) { return x.block == std::get<comm::ByteGrad>(b).block; },
          [&](const comm::Int4Quantization& x) {
            return x.block == std::get<comm::Int4Quantization>(b).block;
          },
          [&](const comm::SignCompression& x) {
            const auto& y = std::get<comm::SignCompression>(b);
            return x.mode == y.mode && x.error_feedback == y.error_feedback;
          },
          [&](const comm::Sparsification& x) {
            const auto& y = std::get<comm::Sparsification>(b);
            return x.mode == y.mode && x.ratio == y.ratio && x.count == y.count &&
                   x.error_feedback == y.error_feedback && x.seed == y.seed &&
                   x.momentum == y.momentum;
          },
          [&](const comm::PowerSGD& x) {
            const auto& y = std::get<comm::PowerSGD>(b);
            return x.rank == y.rank && x.warm_start == y.warm_start &&
                   x.error_feedback == y.error_feedback &&
                   x.min_compression_rate == y.min_compression_rate &&
                   x.start_iter == y.start_iter && x.seed == y.seed;
          },
      },
      a);
}

/// A value of `s` other than its default and inside its range, as text both syntaxes read.
std::string other_value(const comm::AlgorithmSetting& s, const comm::Compression& defaults) {
  const comm::SettingValue now = s.get(defaults);
  switch (s.type) {
    case comm::SettingType::boolean:
      return std::get<bool>(now) ? "false" : "true";
    case comm::SettingType::integer:
      // + 4: even, as int4's block must be.
      return std::to_string(std::max(std::get<int64_t>(now), s.min_integer) + 4);
    case comm::SettingType::number:
      return std::get<double>(now) == 0.5 ? "0.25" : "0.5";
  }
  return "";
}

struct Outcome {
  comm::Compression algorithm;
  std::string error;  // the message, "" when it parsed
};

Outcome from_cli(const std::string& spec) {
  try {
    return {comm::parse_compression(spec), ""};
  } catch (const comm::Error& e) {
    return {comm::GradientAllReduce{}, e.what()};
  }
}

Outcome from_toml(const std::string& name, const std::string& settings) {
  try {
    const JobConfig job = parse_job_config("[job]\nworld_size = 2\n[algorithm]\nname = \"" + name +
                                           "\"\n" + settings);
    return {std::get<comm::Compression>(job.algorithm), ""};
  } catch (const comm::Error& e) {
    return {comm::GradientAllReduce{}, e.what()};
  }
}

/// The part of a validation message both parsers share: "PowerSGD.rank=..." onwards.
std::string validation_part(const std::string& message) {
  const auto at = message.find_first_of("ABCDEFGHIJKLMNOPQRSTUVWXYZ");
  return at == std::string::npos ? message : message.substr(at);
}

void check_same(const Outcome& cli, const Outcome& toml) {
  INFO("cli error: ", cli.error, "\ntoml error: ", toml.error);
  CHECK(cli.error.empty() == toml.error.empty());
  if (cli.error.empty() && toml.error.empty()) CHECK(same(cli.algorithm, toml.algorithm));
  if (!cli.error.empty() && !toml.error.empty())
    CHECK(validation_part(cli.error) == validation_part(toml.error));
}

}  // namespace

TEST_CASE("every algorithm name gives the same struct from the command line and a job file") {
  for (const auto& entry : comm::compression_algorithms()) {
    INFO("algorithm ", entry.name);
    const Outcome cli = from_cli(entry.name);
    const Outcome toml = from_toml(entry.name, "");
    check_same(cli, toml);
    CHECK(cli.error.empty());
    CHECK(same(cli.algorithm, entry.defaults));
    CHECK(job_algorithm_name(JobAlgorithm(toml.algorithm)) == entry.name);
  }
}

TEST_CASE("each setting, changed alone, gives the same struct from both spellings") {
  for (const auto& entry : comm::compression_algorithms()) {
    for (const auto& s : entry.settings) {
      const std::string value = other_value(s, entry.defaults);
      INFO("algorithm ", entry.name, ", ", s.key, " = ", value);
      const Outcome cli = from_cli(entry.name + ":" + s.key + "=" + value);
      const Outcome toml = from_toml(entry.name, s.key + " = " + value + "\n");
      check_same(cli, toml);
      if (cli.error.empty()) CHECK_FALSE(same(cli.algorithm, entry.defaults));
      for (const auto& alias : s.aliases) {
        INFO("alias ", alias);
        check_same(from_cli(entry.name + ":" + alias + "=" + value), toml);
        check_same(from_toml(entry.name, alias + " = " + value + "\n"), toml);
      }
    }
  }
}

TEST_CASE(
    "all settings but error feedback changed at once give the same struct from both spellings") {
  for (const auto& entry : comm::compression_algorithms()) {
    INFO("algorithm ", entry.name);
    std::string spec = entry.name, table;
    for (const auto& s : entry.settings) {
      // Turning error feedback off (or on, for majority vote) conflicts with momentum (or the
      // mode): validate() refuses it, as the case above checks.
      if (s.key == "error_feedback") continue;
      const std::string value = other_value(s, entry.defaults);
      spec += (spec == entry.name ? ":" : ",") + s.key + "=" + value;
      table += s.key + " = " + value + "\n";
    }
    const Outcome cli = from_cli(spec);
    CHECK_MESSAGE(cli.error.empty(), cli.error);
    check_same(cli, from_toml(entry.name, table));
  }
}

TEST_CASE("error_feedback is spelled the same on the command line and in a job file") {
  const auto cli =
      std::get<comm::PowerSGD>(comm::parse_compression("powersgd:error_feedback=false"));
  CHECK_FALSE(cli.error_feedback);
  const auto old = std::get<comm::Sparsification>(comm::parse_compression("topk:ef=0"));
  CHECK_FALSE(old.error_feedback);
}

TEST_CASE("an unknown or repeated key names the key, the algorithm and the keys allowed") {
  CHECK_THROWS_WITH(comm::parse_compression("topk:k=5"),
                    "--algorithm topk: unknown key 'k' (allowed for topk: ratio, count, "
                    "error_feedback, seed, momentum)");
  CHECK_THROWS_WITH(comm::parse_compression("fp16:ratio=1"),
                    "--algorithm fp16: unknown key 'ratio' (allowed for fp16: none)");
  CHECK_THROWS_WITH(comm::parse_compression("sign:ef=0,error_feedback=1"),
                    "--algorithm sign: 'error_feedback' is given twice");
  CHECK_THROWS_WITH(
      parse_job_config("[job]\nworld_size = 2\n[algorithm]\nname = \"topk\"\nk = 5\n", "job.toml"),
      "job.toml: unknown key algorithm.k (allowed for topk: name, ratio, count, "
      "error_feedback, seed, momentum)");
  CHECK_THROWS_WITH(
      parse_job_config("[job]\nworld_size = 2\n[algorithm]\nname = \"sign\"\nef = false\n"
                       "error_feedback = true\n",
                       "job.toml"),
      doctest::Contains("is given twice"));
}

TEST_CASE("a value out of range gets the same expectation from both spellings") {
  CHECK_THROWS_WITH(comm::parse_compression("topk:ratio=1.5"),
                    "--algorithm topk: ratio=1.5: expected a number in (0, 1]");
  CHECK_THROWS_WITH(
      parse_job_config("[job]\nworld_size = 2\n[algorithm]\nname = \"topk\"\nratio = 1.5\n",
                       "job.toml"),
      "job.toml: algorithm.ratio = 1.5: expected a number in (0, 1]");
  CHECK_THROWS_WITH(comm::parse_compression("powersgd:rank=0"),
                    "--algorithm powersgd: rank=0: expected an integer >= 1");
  CHECK_THROWS_WITH(comm::parse_compression("powersgd:start_iter=99999999999"),
                    "--algorithm powersgd: start_iter=99999999999: expected an integer in [0, "
                    "4294967295]");
  CHECK_THROWS_WITH(comm::parse_compression("powersgd:rank=two"),
                    "--algorithm powersgd: rank=two: expected an integer >= 1");
  CHECK_THROWS_WITH(comm::parse_compression("sign:ef=yes"),
                    "--algorithm sign: ef=yes: expected true, false, 1 or 0");
}
