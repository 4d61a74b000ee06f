#pragma once
/// The settings of every bucket algorithm, in one table: the command line's
/// `--algorithm name:key=value,...` (parse_compression) and the job file's `[algorithm]` table
/// (tools/job_config.cpp) both walk it, so a key, its type, its range and its default are
/// written once. A setting's default is its field's default in the algorithm's struct
/// (comm/compression/algorithms.h), as `AlgorithmEntry::defaults` holds it.
#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "comm/compression/algorithms.h"

namespace troupe::comm {

enum class SettingType { boolean, integer, number };

/// A setting's value as a parser read it, before it is checked against the setting's range.
using SettingValue = std::variant<bool, int64_t, double>;

/// One key of one algorithm.
struct AlgorithmSetting {
  /// The key in both spellings: "error_feedback".
  std::string key;
  /// Older spellings still accepted (the command line's "ef"); messages use `key`.
  std::vector<std::string> aliases;
  SettingType type = SettingType::boolean;
  /// Integers: [min_integer, max_integer] (the field's type bounds the top).
  int64_t min_integer = 0;
  int64_t max_integer = 0;
  /// Numbers: finite, between low and high; an open end excludes its bound.
  double low = 0;
  double high = 0;
  bool low_open = false;
  bool high_open = false;
  /// Stores a checked value into the algorithm's struct.
  std::function<void(Compression&, const SettingValue&)> set;
  /// Reads the field back (defaults, tests, messages).
  std::function<SettingValue(const Compression&)> get;

  bool named(const std::string& name) const;
  /// What the setting accepts, for messages: "an integer >= 1", "a number in (0, 1]".
  std::string expected() const;
  /// "" when `value` is allowed; otherwise what was expected, as a message ends.
  std::string check(const SettingValue& value) const;
};

/// One algorithm name of the command line and the job file, and its settings.
struct AlgorithmEntry {
  /// "topk"; several names may share a struct (topk, randomk, blockk: Sparsification's modes).
  std::string name;
  /// The struct the name starts from, before any key is applied (its mode, its defaults).
  Compression defaults;
  std::vector<AlgorithmSetting> settings;

  /// The setting named `key` (or one of its aliases), or nullptr.
  const AlgorithmSetting* find(const std::string& key) const;
  /// "ratio, count, error_feedback, seed, momentum", or "none".
  std::string keys() const;
};

/// Every bucket algorithm, in the order messages list them.
const std::vector<AlgorithmEntry>& compression_algorithms();

/// The entry named `name`, or nullptr.
const AlgorithmEntry* find_compression_algorithm(const std::string& name);

/// "allreduce, fp16, ..., powersgd" (or with `last` as the final separator, e.g. " or ").
std::string compression_algorithm_names(const std::string& quote = "",
                                        const std::string& last = ", ");

/// The entry an algorithm struct was made from: the name a job file and the command line use
/// for it ("sign-vote" for SignCompression in majority_vote mode).
const AlgorithmEntry& compression_entry(const Compression& algorithm);

}  // namespace troupe::comm
