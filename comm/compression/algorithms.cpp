#include "comm/compression/algorithms.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "comm/compression/coded.h"
#include "comm/compression/reductions.h"
#include "comm/compression/settings.h"
#include "comm/overloaded.h"
#include "comm/reduce.h"
#include "comm/shm/local_allreduce.h"
#include "comm/status.h"

namespace troupe::comm {

namespace {}  // namespace

std::string algorithm_name(const Compression& algorithm) {
  return std::visit(
      Overloaded{
          [](const GradientAllReduce&) -> std::string { return "allreduce"; },
          [](const HalfPrecision& c) -> std::string { return c.bfloat16 ? "bf16" : "fp16"; },
          [](const ByteGrad&) -> std::string { return "bytegrad"; },
          [](const Int4Quantization&) -> std::string { return "int4"; },
          [](const SignCompression& c) -> std::string {
            std::string s = c.mode == SignMode::scaled ? "sign" : "sign(majority vote)";
            return c.error_feedback && c.mode == SignMode::scaled ? "ef-" + s : s;
          },
          [](const Sparsification& c) -> std::string {
            std::string s = c.mode == SparseMode::top_k      ? "top-k"
                            : c.mode == SparseMode::random_k ? "random-k"
                                                             : "block-k";
            s += c.count ? "(k=" + std::to_string(c.count) + ")" : "(" + number_text(c.ratio) + ")";
            if (c.momentum > 0) s += "+momentum(" + number_text(c.momentum) + ")";
            return c.error_feedback ? s + "+ef" : s;
          },
          [](const PowerSGD& c) -> std::string {
            return "powersgd(rank=" + std::to_string(c.rank) + ")";
          },
      },
      algorithm);
}

void validate(const Compression& algorithm) {
  std::visit(Overloaded{
                 [](const GradientAllReduce&) {},
                 [](const HalfPrecision&) {},
                 [](const ByteGrad& c) {
                   if (c.block == 0)
                     throw Error("ByteGrad.block=0 (expected >= 1 element per block)");
                 },
                 [](const Int4Quantization& c) {
                   if (c.block < 2 || c.block % 2)
                     throw Error("Int4Quantization.block=" + std::to_string(c.block) +
                                 " (expected an even number of elements >= 2 per block)");
                 },
                 [](const SignCompression& c) {
                   if (c.mode == SignMode::majority_vote && c.error_feedback)
                     throw Error(
                         "SignCompression.error_feedback=true with mode majority_vote (error "
                         "feedback needs the scaled mode; set error_feedback = false)");
                 },
                 [](const Sparsification& c) {
                   if (c.count == 0 && !(c.ratio > 0 && c.ratio <= 1))
                     throw Error("Sparsification.ratio=" + number_text(c.ratio) +
                                 " (expected 0 < ratio <= 1, or a count > 0)");
                   if (!(c.momentum >= 0 && c.momentum < 1))
                     throw Error("Sparsification.momentum=" + number_text(c.momentum) +
                                 " (expected 0 <= momentum < 1)");
                   if (c.momentum > 0 && !c.error_feedback)
                     throw Error("Sparsification.momentum=" + number_text(c.momentum) +
                                 " with error_feedback=false (momentum correction keeps the unsent "
                                 "momentum in the error memory; set error_feedback = true)");
                 },
                 [](const PowerSGD& c) {
                   if (c.rank < 1)
                     throw Error("PowerSGD.rank=" + std::to_string(c.rank) + " (expected >= 1)");
                   if (!(c.min_compression_rate >= 0))
                     throw Error("PowerSGD.min_compression_rate=" +
                                 number_text(c.min_compression_rate) + " (expected >= 0)");
                 },
             },
             algorithm);
}

std::shared_ptr<Reduction> make_reduction(const Compression& algorithm,
                                          const BucketBuffer& bucket) {
  validate(algorithm);
  if (!std::holds_alternative<GradientAllReduce>(algorithm) && bucket.type != DataType::float32)
    throw Error(algorithm_name(algorithm) + " compresses float32 gradients; bucket " +
                std::to_string(bucket.index) + " holds " + to_string(bucket.type) +
                " (use GradientAllReduce for other types)");
  return std::visit(Overloaded{
                        [&](const GradientAllReduce&) { return make_allreduce_reduction(bucket); },
                        [&](const HalfPrecision& c) { return make_half_reduction(c, bucket); },
                        [&](const ByteGrad& c) { return make_byte_grad_reduction(c, bucket); },
                        [&](const Int4Quantization& c) { return make_int4_reduction(c, bucket); },
                        [&](const SignCompression& c) { return make_sign_reduction(c, bucket); },
                        [&](const Sparsification& c) { return make_sparse_reduction(c, bucket); },
                        [&](const PowerSGD& c) { return make_power_sgd_reduction(c, bucket); },
                    },
                    algorithm);
}

Compression parse_compression(const std::string& spec) {
  const auto colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  const AlgorithmEntry* entry = find_compression_algorithm(name);
  if (!entry)
    throw Error("--algorithm '" + name + "' is not an algorithm (expected " +
                compression_algorithm_names("", " or ") + ")");
  Compression out = entry->defaults;
  if (colon == std::string::npos) return out;

  const std::string where = "--algorithm " + name + ": ";
  const std::string rest = spec.substr(colon + 1);
  std::vector<const AlgorithmSetting*> seen;
  size_t at = 0;
  while (at <= rest.size()) {
    size_t comma = rest.find(',', at);
    if (comma == std::string::npos) comma = rest.size();
    const std::string item = rest.substr(at, comma - at);
    at = comma + 1;
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error("--algorithm " + spec + ": '" + item + "' is not key=value");
    const std::string key = item.substr(0, eq);
    const std::string text = item.substr(eq + 1);
    const AlgorithmSetting* setting = entry->find(key);
    if (!setting)
      throw Error(where + "unknown key '" + key + "' (allowed for " + name + ": " + entry->keys() +
                  ")");
    if (std::find(seen.begin(), seen.end(), setting) != seen.end())
      throw Error(where + "'" + setting->key + "' is given twice");
    seen.push_back(setting);

    // The text as the setting's type reads it; check() then applies the table's range.
    std::optional<SettingValue> value;
    char* end = nullptr;
    if (setting->type == SettingType::boolean) {
      if (text == "true" || text == "1")
        value = true;
      else if (text == "false" || text == "0")
        value = false;
    } else if (setting->type == SettingType::integer) {
      errno = 0;
      const long long x = std::strtoll(text.c_str(), &end, 10);
      if (!text.empty() && !*end && errno == 0) value = static_cast<int64_t>(x);
    } else {
      const double x = std::strtod(text.c_str(), &end);
      if (!text.empty() && !*end) value = x;
    }
    const std::string expected = value ? setting->check(*value) : setting->expected();
    if (!expected.empty())
      throw Error(where + key + "=" + text + ": expected " +
                  (setting->type == SettingType::boolean ? "true, false, 1 or 0" : expected));
    setting->set(out, *value);
  }
  validate(out);
  return out;
}

uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b) {
  auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  return mix(mix(mix(seed) ^ a) ^ b);
}

std::vector<Range> padding_of(const BucketBuffer& bucket) {
  std::vector<Range> gaps;
  size_t at = 0;
  for (const auto& t : bucket.tensors) {
    if (t.offset > at) gaps.push_back(Range{at, t.offset});
    at = std::max(at, t.offset + t.count);
  }
  if (bucket.count > at) gaps.push_back(Range{at, bucket.count});
  return gaps;
}

void zero_padding(const BucketBuffer& bucket) {
  auto* data = static_cast<float*>(bucket.data);
  for (const Range& gap : padding_of(bucket))
    std::memset(data + gap.begin, 0, gap.size() * sizeof(float));
}

Schedule scaled_allreduce(const ReduceStep& step, void* data, size_t count, DataType type) {
  const auto how = LocalReduce::scaled(step.scale, step.divide_before, step.group.world_size);
  if (how.scale_before) scale(data, count, type, how.scale);
  auto schedule = allreduce_schedule(step.group, data, count, type, how.op, step.collectives);
  if (how.scale != 1.0 && !how.scale_before)
    schedule.finally = [data, count, type, factor = how.scale] {
      scale(data, count, type, factor);
    };
  return schedule;
}

namespace {

class AllReduce final : public Reduction {
 public:
  explicit AllReduce(const BucketBuffer& bucket) : bucket_(bucket) {}
  std::string name() const override { return "allreduce"; }
  std::vector<std::function<Schedule()>> stages(const ReduceStep& step) override {
    if (!step.collectives.hosts.empty()) return hierarchical_stages(step);
    return {
        [this, step] { return scaled_allreduce(step, bucket_.data, bucket_.count, bucket_.type); }};
  }

 private:
  // Sums by host; the step's scale is applied before (divide_before) or after the three stages.
  std::vector<std::function<Schedule()>> hierarchical_stages(const ReduceStep& step) {
    void* data = bucket_.data;
    const size_t count = bucket_.count;
    const DataType type = bucket_.type;
    auto stages = hierarchical_allreduce_stages(step.group, step.collectives.hosts, data, count,
                                                type, ReduceOp::sum, step.collectives);
    const double factor = step.scale;
    if (factor == 1.0) return stages;
    if (step.divide_before) {
      stages.front() = [first = stages.front(), data, count, type, factor] {
        scale(data, count, type, factor);
        return first();
      };
    } else {
      stages.back() = [last = stages.back(), data, count, type, factor] {
        Schedule s = last();
        s.finally = [previous = std::move(s.finally), data, count, type, factor] {
          if (previous) previous();
          scale(data, count, type, factor);
        };
        return s;
      };
    }
    return stages;
  }

  BucketBuffer bucket_;
};

}  // namespace

std::shared_ptr<Reduction> make_allreduce_reduction(const BucketBuffer& bucket) {
  return std::make_shared<AllReduce>(bucket);
}

}  // namespace troupe::comm
