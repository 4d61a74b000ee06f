#include "algorithms/local_update/sparseloco.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include "algorithms/local_update/outer_step.h"
#include "comm/collectives/collectives.h"
#include "comm/state.h"
#include "comm/status.h"
#include "rank/fault.h"

namespace troupe {

std::string sparseloco_name(const SparseLoCo& c) {
  std::ostringstream s;
  s << "sparseloco(h=" << c.inner_steps << ", ratio=" << c.ratio << ", chunk=" << c.chunk
    << ", bits=" << c.value_bits << ", beta=" << c.ef_decay << ", outer_lr=" << c.outer_lr << ")";
  return s.str();
}

namespace {

SparseLoCo checked(SparseLoCo c) {
  check_outer_settings("SparseLoCo", c.inner_steps, c.outer_lr);
  auto bad = [](const std::string& what) { throw comm::Error("SparseLoCo: " + what); };
  if (!(c.ratio > 0 && c.ratio <= 1))
    bad("ratio = " + comm::number_text(c.ratio) + ", expected 0 < ratio <= 1");
  if (c.chunk < 1 || c.chunk > 65536)
    bad("chunk = " + std::to_string(c.chunk) + ", expected 1 <= chunk <= 65536");
  if (c.value_bits != 2 && c.value_bits != 4 && c.value_bits != 8 && c.value_bits != 32)
    bad("value_bits = " + std::to_string(c.value_bits) + ", expected 2, 4, 8 or 32");
  if (!(c.ef_decay >= 0 && c.ef_decay <= 1))
    bad("ef_decay = " + comm::number_text(c.ef_decay) + ", expected 0 <= ef_decay <= 1");
  return c;
}

/// Where each part of one rank's message lies, fixed by the config and the model's size.
struct Layout {
  size_t chunks = 0;
  std::vector<size_t> k_begin;  // chunk c's values are numbers [k_begin[c], k_begin[c + 1])
  size_t total_k = 0;
  size_t floats = 0;      // bytes of {min, max} pairs, or of the values themselves at 32 bits
  size_t indices_at = 0;  // uint16 index within its chunk, per value
  size_t codes_at = 0;    // value_bits-bit codes, value m at bit m * value_bits
  size_t bytes = 0;       // the whole message, in whole 32-bit words

  Layout(const SparseLoCo& c, size_t count) {
    chunks = (count + c.chunk - 1) / c.chunk;
    k_begin.push_back(0);
    for (size_t i = 0; i < chunks; ++i) {
      const size_t len = std::min(c.chunk, count - i * c.chunk);
      const auto k = static_cast<size_t>(std::llround(c.ratio * static_cast<double>(len)));
      k_begin.push_back(k_begin.back() + std::clamp<size_t>(k, 1, len));
    }
    total_k = k_begin.back();
    const bool raw = c.value_bits == 32;
    floats = raw ? total_k * sizeof(float) : chunks * 2 * sizeof(float);
    indices_at = floats;
    codes_at = indices_at + total_k * sizeof(uint16_t);
    const size_t code_bytes = raw ? 0 : (total_k * static_cast<size_t>(c.value_bits) + 7) / 8;
    bytes = (codes_at + code_bytes + 3) / 4 * 4;
  }
};

}  // namespace

size_t sparseloco_message_bytes(const SparseLoCo& config, size_t count) {
  return Layout(checked(config), count).bytes;
}

struct SparseLoCoModule::Impl : PeriodicAlgorithm {
  Impl(Runtime& rt, std::shared_ptr<torch::nn::Module> m, SparseLoCo c)
      : config(checked(std::move(c))),
        core(rt, std::move(m), "SparseLoCo", /*with_momentum=*/false),
        layout(config, core.flat.count()) {
    error.assign(core.flat.count(), 0.0f);
    sum.assign(core.flat.count(), 0.0f);
    order.resize(std::min(config.chunk, core.flat.count()));
    mine.assign(layout.bytes, 0);
    all.assign(layout.bytes * static_cast<size_t>(rt.world_size()), 0);
  }

  // One chunk's top-k of |e| into the message: indices ascending, values coded against the
  // chosen values' {min, max}; the decoded values are taken out of e.
  void encode_chunk(size_t c) {
    const size_t begin = c * config.chunk, len = std::min(config.chunk, count() - begin);
    const size_t k0 = layout.k_begin[c], k = layout.k_begin[c + 1] - k0;
    float* e = error.data() + begin;
    std::iota(order.begin(), order.begin() + static_cast<long>(len), 0u);
    if (k < len)
      std::nth_element(order.begin(), order.begin() + static_cast<long>(k),
                       order.begin() + static_cast<long>(len),
                       [e](uint32_t a, uint32_t b) { return std::abs(e[a]) > std::abs(e[b]); });
    std::sort(order.begin(), order.begin() + static_cast<long>(k));
    auto* indices = reinterpret_cast<uint16_t*>(mine.data() + layout.indices_at) + k0;
    for (size_t j = 0; j < k; ++j) indices[j] = static_cast<uint16_t>(order[j]);
    if (config.value_bits == 32) {
      auto* values = reinterpret_cast<float*>(mine.data()) + k0;
      for (size_t j = 0; j < k; ++j) {
        values[j] = e[order[j]];
        e[order[j]] = 0.0f;  // sent exactly
      }
      return;
    }
    float lo = e[order[0]], hi = lo;
    for (size_t j = 1; j < k; ++j) {
      lo = std::min(lo, e[order[j]]);
      hi = std::max(hi, e[order[j]]);
    }
    const float range[2] = {lo, hi};
    std::memcpy(mine.data() + c * sizeof(range), range, sizeof(range));
    const int bits = config.value_bits;
    const int levels = (1 << bits) - 1;
    // Nearest rounding: t >= 0.5, so truncation rounds; a constant set codes to 0 exactly.
    const float inv = hi > lo ? static_cast<float>(levels / (static_cast<double>(hi) - lo)) : 0.0f;
    const float step = static_cast<float>((static_cast<double>(hi) - lo) / levels);
    uint8_t* codes = mine.data() + layout.codes_at;
    for (size_t j = 0; j < k; ++j) {
      float& x = e[order[j]];
      const float t = std::min((x - lo) * inv + 0.5f, static_cast<float>(levels));
      const auto q = static_cast<uint32_t>(static_cast<int32_t>(t));
      const size_t bit = (k0 + j) * static_cast<size_t>(bits);
      codes[bit / 8] = static_cast<uint8_t>(codes[bit / 8] | q << (bit % 8));
      x -= lo + step * static_cast<float>(q);
    }
  }

  // sum += the values of one rank's message, scattered to their coordinates.
  void decode_add(const uint8_t* message) {
    const auto* indices = reinterpret_cast<const uint16_t*>(message + layout.indices_at);
    const uint8_t* codes = message + layout.codes_at;
    const int bits = config.value_bits;
    const int levels = (1 << (bits % 32)) - 1;
    const uint32_t mask = static_cast<uint32_t>(levels);
    for (size_t c = 0; c < layout.chunks; ++c) {
      float* s = sum.data() + c * config.chunk;
      const size_t k0 = layout.k_begin[c], k1 = layout.k_begin[c + 1];
      if (bits == 32) {
        const auto* values = reinterpret_cast<const float*>(message);
        for (size_t m = k0; m < k1; ++m) s[indices[m]] += values[m];
        continue;
      }
      float range[2];
      std::memcpy(range, message + c * sizeof(range), sizeof(range));
      const float lo = range[0];
      const float step = static_cast<float>((static_cast<double>(range[1]) - lo) / levels);
      for (size_t m = k0; m < k1; ++m) {
        const size_t bit = m * static_cast<size_t>(bits);
        const uint32_t q = (codes[bit / 8] >> (bit % 8)) & mask;
        s[indices[m]] += lo + step * static_cast<float>(q);
      }
    }
  }

  size_t count() const { return core.flat.count(); }

  void synchronise() override {
    std::lock_guard<std::mutex> lock(core.flat.mutex());
    auto local = core.local();
    const float* delta = core.take_pseudo_gradient(local).data_ptr<float>();
    const size_t n = count();
    const auto beta = static_cast<float>(config.ef_decay);
    for (size_t i = 0; i < n; ++i) error[i] = beta * error[i] + delta[i];
    std::fill(mine.begin(), mine.end(), uint8_t{0});
    for (size_t c = 0; c < layout.chunks; ++c) encode_chunk(c);

    const auto start = std::chrono::steady_clock::now();
    comm::Communicator::Traffic traffic;
    Runtime& runtime = core.runtime;
    const int world = runtime.world_size();
    fault::at(FaultPhase::reduce, core.inner - 1);  // the sync after inner step `inner - 1`
    if (world > 1) {
      const size_t words = layout.bytes / 4;
      comm::Group group{runtime.rank(), world};
      auto options = runtime.comm().options();
      traffic = runtime.comm().run_stages({[this, group, words, options] {
                                            return comm::allgather_schedule(
                                                group, mine.data(), all.data(), words,
                                                comm::DataType::int32, options);
                                          }},
                                          "SparseLoCo's outer allgather");
    } else {
      std::copy(mine.begin(), mine.end(), all.begin());
    }
    core.count_wait(start);
    core.count_sync(traffic);

    // Summed in fp32 in rank order, so that every rank computes the same global weights.
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int r = 0; r < world; ++r) decode_add(all.data() + layout.bytes * static_cast<size_t>(r));
    const auto factor = static_cast<float>(config.outer_lr / world);
    float* global = core.global.data_ptr<float>();
    for (size_t i = 0; i < n; ++i) global[i] -= factor * sum[i];
    core.continue_from_global(local);
  }

  std::string name() const override { return sparseloco_name(config); }
  OuterStep& outer_step() override { return core; }
  int period() const override { return config.inner_steps; }
  void save_rest(comm::StateWriter& out) override { out.vector(error); }
  std::function<void(comm::StateReader&)> read_rest(comm::StateReader& in) override {
    auto saved = in.vector<float>(error.size(), "SparseLoCo's error-feedback memory");
    return
        [this, saved = std::move(saved)](comm::StateReader&) mutable { error = std::move(saved); };
  }
  // Shared: nothing beyond OuterStep's; the error-feedback memory is the rank's own.
  void save_shared_rest(comm::StateWriter&) override {}
  std::function<void(comm::StateReader&)> read_shared_rest(comm::StateReader&) override {
    return [](comm::StateReader&) {};
  }

  SparseLoCo config;
  OuterStep core;
  Layout layout;
  std::vector<float> error, sum;   // flat, in host memory
  std::vector<uint32_t> order;     // a chunk's coordinates, for the top-k
  std::vector<uint8_t> mine, all;  // this rank's message; every rank's, in rank order
};

SparseLoCoModule::SparseLoCoModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                                   SparseLoCo config)
    : LocalUpdateModule(std::make_unique<Impl>(runtime, std::move(module), std::move(config))) {}

}  // namespace troupe
