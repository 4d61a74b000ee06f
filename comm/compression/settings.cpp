#include "comm/compression/settings.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "comm/status.h"

namespace troupe::comm {

namespace {

/// A setting stored in field `field` of struct S; its type follows the field's.
template <class S, class T>
AlgorithmSetting field_setting(std::string key, T S::*field) {
  AlgorithmSetting s;
  s.key = std::move(key);
  if constexpr (std::is_same_v<T, bool>) {
    s.type = SettingType::boolean;
  } else if constexpr (std::is_integral_v<T>) {
    s.type = SettingType::integer;
    s.min_integer = 0;
    s.max_integer = static_cast<uint64_t>(std::numeric_limits<T>::max()) >
                            static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                        ? std::numeric_limits<int64_t>::max()
                        : static_cast<int64_t>(std::numeric_limits<T>::max());
  } else {
    static_assert(std::is_floating_point_v<T>, "a setting is a bool, an integer or a number");
    s.type = SettingType::number;
    s.low = -std::numeric_limits<double>::infinity();
    s.high = std::numeric_limits<double>::infinity();
  }
  s.set = [field](Compression& c, const SettingValue& v) {
    auto& target = std::get<S>(c).*field;
    std::visit([&](auto x) { target = static_cast<T>(x); }, v);
  };
  s.get = [field](const Compression& c) -> SettingValue {
    const T x = std::get<S>(c).*field;
    if constexpr (std::is_same_v<T, bool>)
      return x;
    else if constexpr (std::is_integral_v<T>)
      return static_cast<int64_t>(x);
    else
      return static_cast<double>(x);
  };
  return s;
}

template <class S>
AlgorithmSetting flag(std::string key, bool S::*field, std::vector<std::string> aliases = {}) {
  auto s = field_setting(std::move(key), field);
  s.aliases = std::move(aliases);
  return s;
}

template <class S, class T>
AlgorithmSetting integer(std::string key, T S::*field, int64_t min) {
  auto s = field_setting(std::move(key), field);
  s.min_integer = min;
  return s;
}

template <class S>
AlgorithmSetting number(std::string key, double S::*field, double low, bool low_open,
                        double high = std::numeric_limits<double>::infinity(),
                        bool high_open = true) {
  auto s = field_setting(std::move(key), field);
  s.low = low;
  s.low_open = low_open;
  s.high = high;
  s.high_open = high_open;
  return s;
}

// "ef" was the command line's spelling of error_feedback before the table joined the parsers.
const std::vector<std::string> kErrorFeedbackAliases = {"ef"};

std::vector<AlgorithmEntry> make_table() {
  auto sign = [](SignMode mode) {
    return AlgorithmEntry{
        mode == SignMode::scaled ? "sign" : "sign-vote",
        SignCompression{mode, mode == SignMode::scaled},
        {flag("error_feedback", &SignCompression::error_feedback, kErrorFeedbackAliases)}};
  };
  auto sparse = [](const char* name, SparseMode mode) {
    Sparsification defaults;
    defaults.mode = mode;
    return AlgorithmEntry{
        name,
        defaults,
        {number("ratio", &Sparsification::ratio, 0, true, 1, false),
         integer("count", &Sparsification::count, 0),
         flag("error_feedback", &Sparsification::error_feedback, kErrorFeedbackAliases),
         integer("seed", &Sparsification::seed, 0),
         number("momentum", &Sparsification::momentum, 0, false, 1, true)}};
  };
  return {
      {"allreduce", GradientAllReduce{}, {}},
      {"fp16", HalfPrecision{false}, {}},
      {"bf16", HalfPrecision{true}, {}},
      {"bytegrad", ByteGrad{}, {integer("block", &ByteGrad::block, 1)}},
      {"int4", Int4Quantization{}, {integer("block", &Int4Quantization::block, 2)}},
      sign(SignMode::scaled),
      sign(SignMode::majority_vote),
      sparse("topk", SparseMode::top_k),
      sparse("randomk", SparseMode::random_k),
      sparse("blockk", SparseMode::block),
      {"powersgd",
       PowerSGD{},
       {integer("rank", &PowerSGD::rank, 1), flag("warm_start", &PowerSGD::warm_start),
        flag("error_feedback", &PowerSGD::error_feedback, kErrorFeedbackAliases),
        number("min_compression_rate", &PowerSGD::min_compression_rate, 0, false),
        integer("start_iter", &PowerSGD::start_iter, 0), integer("seed", &PowerSGD::seed, 0)}},
  };
}

}  // namespace

bool AlgorithmSetting::named(const std::string& name) const {
  return name == key || std::find(aliases.begin(), aliases.end(), name) != aliases.end();
}

std::string AlgorithmSetting::expected() const {
  switch (type) {
    case SettingType::boolean:
      return "true or false";
    case SettingType::integer:
      return "an integer >= " + std::to_string(min_integer);
    case SettingType::number:
      if (std::isinf(high))
        return std::string("a number ") + (low_open ? "> " : ">= ") + number_text(low);
      return std::string("a number in ") + (low_open ? "(" : "[") + number_text(low) + ", " +
             number_text(high) + (high_open ? ")" : "]");
  }
  return "";
}

std::string AlgorithmSetting::check(const SettingValue& value) const {
  switch (type) {
    case SettingType::boolean:
      return std::holds_alternative<bool>(value) ? "" : expected();
    case SettingType::integer: {
      const auto* x = std::get_if<int64_t>(&value);
      if (!x || *x < min_integer) return expected();
      if (*x > max_integer)
        return "an integer in [" + std::to_string(min_integer) + ", " +
               std::to_string(max_integer) + "]";
      return "";
    }
    case SettingType::number: {
      double x = 0;
      if (const auto* d = std::get_if<double>(&value))
        x = *d;
      else if (const auto* i = std::get_if<int64_t>(&value))
        x = static_cast<double>(*i);
      else
        return expected();
      const bool above = low_open ? x > low : x >= low;
      const bool below = high_open ? x < high : x <= high;
      return std::isfinite(x) && above && below ? "" : expected();
    }
  }
  return expected();
}

const AlgorithmSetting* AlgorithmEntry::find(const std::string& key) const {
  for (const auto& s : settings)
    if (s.named(key)) return &s;
  return nullptr;
}

std::string AlgorithmEntry::keys() const {
  std::string out;
  for (const auto& s : settings) out += (out.empty() ? "" : ", ") + s.key;
  return out.empty() ? "none" : out;
}

const std::vector<AlgorithmEntry>& compression_algorithms() {
  static const std::vector<AlgorithmEntry> table = make_table();
  return table;
}

const AlgorithmEntry* find_compression_algorithm(const std::string& name) {
  for (const auto& entry : compression_algorithms())
    if (entry.name == name) return &entry;
  return nullptr;
}

std::string compression_algorithm_names(const std::string& quote, const std::string& last) {
  const auto& table = compression_algorithms();
  std::string out;
  for (size_t i = 0; i < table.size(); ++i)
    out += (i == 0 ? "" : i + 1 == table.size() ? last : ", ") + quote + table[i].name + quote;
  return out;
}

const AlgorithmEntry& compression_entry(const Compression& algorithm) {
  for (const auto& entry : compression_algorithms()) {
    if (entry.defaults.index() != algorithm.index()) continue;
    // Names that share a struct differ by its mode or precision.
    if (const auto* h = std::get_if<HalfPrecision>(&algorithm)) {
      if (std::get<HalfPrecision>(entry.defaults).bfloat16 != h->bfloat16) continue;
    } else if (const auto* s = std::get_if<SignCompression>(&algorithm)) {
      if (std::get<SignCompression>(entry.defaults).mode != s->mode) continue;
    } else if (const auto* p = std::get_if<Sparsification>(&algorithm)) {
      if (std::get<Sparsification>(entry.defaults).mode != p->mode) continue;
    }
    return entry;
  }
  throw Error("compression_entry: an algorithm with no entry in the settings table (index " +
              std::to_string(algorithm.index()) + ")");
}

}  // namespace troupe::comm
