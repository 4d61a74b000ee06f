#pragma once
// The elastic test job's problem and its one-process references (tests/runtime/elastic_rank.cpp
// runs the job; tests/runtime/elastic_reference_test.cpp checks the references against
// non-elastic runs): a small MLP on synthetic data, global batches cut among the ranks by
// ElasticSampler, the local-update algorithms' settings, and reference_local_update, which runs
// every rank's replica of an elastic local-update job in one process through the worlds of its
// recoveries.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "algorithms/local_update/algorithms.h"
#include "algorithms/local_update/streaming_diloco.h"
#include "comm/status.h"
#include "elastic/elastic.h"

namespace troupe::test::elastic {

constexpr int64_t kSamples = 480;
constexpr int64_t kGlobalBatch = 24;  // divides by 1, 2, 3, 4
constexpr uint64_t kSeed = 7;

struct Data {
  torch::Tensor x, y;
};

inline Data make_data() {
  torch::manual_seed(1234);
  Data d;
  d.x = torch::randn({kSamples, 16});
  d.y = torch::randint(0, 4, {kSamples});
  return d;
}

inline torch::nn::Sequential make_model() {
  torch::manual_seed(99);
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 4));
}

inline torch::Tensor flat(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return torch::cat(parts);
}

inline torch::Tensor as_index(const std::vector<int64_t>& v) {
  return torch::tensor(std::vector<int64_t>(v.begin(), v.end()), torch::kLong);
}

inline torch::optim::SGD make_sgd(torch::nn::Module& m) {
  return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

/// One inner step of `net` on global batch `step`'s share of `rank` in `world`.
inline void train_step(torch::nn::Sequential& net, torch::optim::Optimizer& opt, const Data& d,
                       int64_t step, int rank, int world, ElasticSampler& sampler) {
  auto idx = as_index(sampler.indices(step, rank, world));
  opt.zero_grad();
  torch::nn::functional::cross_entropy(net->forward(d.x.index({idx})), d.y.index({idx})).backward();
}

// One process on the whole global batches: the reference trajectory.
inline torch::Tensor reference(const Data& d, int64_t steps) {
  auto net = make_model();
  auto opt = make_sgd(*net);
  ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
  for (int64_t s = 0; s < steps; ++s) {
    train_step(net, opt, d, s, 0, 1, sampler);
    opt.step();
  }
  return flat(*net);
}

constexpr int kH = 4;  // the local-update algorithms' inner steps

inline DiLoCo make_diloco() {
  DiLoCo c;
  c.inner_steps = kH;
  // Milder than the paper's 0.7 and 0.9: a survivor trains alone for hundreds of steps until the
  // restarted rank is back, and this small problem diverges under the paper's.
  c.outer_lr = 0.5;
  c.outer_momentum = 0.5;
  c.nesterov = true;
  return c;
}

// Whether `name` is one of the Streaming DiLoCo jobs: streaming-diloco, streaming-diloco-eager
// (eager updates), streaming-diloco-topk (a top-k outer reduction with error feedback),
// streaming-diloco-eager-topk (both).
inline bool streaming_job(const std::string& name) {
  return name.rfind("streaming-diloco", 0) == 0;
}

// Two fragments, each in flight for two steps: fragment 0 starts after steps 2, 6, 10, ... and
// lands after 4, 8, 12, ..., fragment 1 starts after 4, 8, ... and lands after 6, 10, ...: a
// sync lands after every even step, and the other fragment starts right after it, so one is
// always in flight but at the landing points (where a re-form goes on by starting it again).
// "-topk": each fragment's outer gradient travels as its top quarter (k of its elements, exact
// values) through an allgather, the rest kept as the rank's residual (error feedback).
inline StreamingDiLoCo make_streaming(const std::string& name = "streaming-diloco") {
  if (name != "streaming-diloco" && name != "streaming-diloco-eager" &&
      name != "streaming-diloco-topk" && name != "streaming-diloco-eager-topk")
    throw comm::Error("elastic reference: algorithm '" + name +
                      "' (expected streaming-diloco, streaming-diloco-eager, "
                      "streaming-diloco-topk or streaming-diloco-eager-topk)");
  StreamingDiLoCo c;
  c.inner_steps = kH;
  c.fragments = 2;
  c.delay = 2;
  c.fragment_update_alpha = 0.5;
  c.outer_lr = 0.5;
  c.outer_momentum = 0.5;
  c.eager = name.find("-eager") != std::string::npos;
  if (name.find("-topk") != std::string::npos) {
    Sparsification topk;
    topk.ratio = 0.25;
    topk.error_feedback = true;
    c.outer_compression = topk;
  }
  return c;
}

// Top quarter of each 64-element chunk as exact floats (32 bits): the reference needs no
// quantiser, and the error-feedback memory keeps three quarters of every outer gradient.
inline SparseLoCo make_sparseloco() {
  SparseLoCo c;
  c.inner_steps = kH;
  c.outer_lr = 0.5;
  c.ratio = 0.25;
  c.chunk = 64;
  c.value_bits = 32;
  c.ef_decay = 0.9;
  return c;
}

// Whether a sync lands after step t (where an elastic job may end, and goes back to).
inline bool lands_after(const std::string& algorithm, int64_t t) {
  if (streaming_job(algorithm)) return t % 2 == 0;
  return t % kH == 0;
}

// The world from a step on: {0, launch world}, then one per recovery (a later one at the same
// step replaces an earlier), with the rank whose state a new member took.
struct Segment {
  int64_t from;
  int world;
  int source;
};

// One process running the elastic local-update job (diloco, sparseloco or one of the
// streaming_job()s): a replica (model, inner optimizer, its own outer state) per rank, each
// stepping on its shard of the global batch, and the outer steps of diloco.h, streaming_diloco.h
// and sparseloco.h on the shared global weights. At a segment's step (where a sync has landed,
// before the fragment due there starts) the world becomes the segment's: the first ranks'
// replicas go on as they were, a new rank takes the source's model and inner optimizer, zero
// residuals and memory, and (eager updates) each fragment's last average as the others'.
// Returns each rank's weights at the end.
inline std::vector<torch::Tensor> reference_local_update(const Data& d,
                                                         const std::string& algorithm,
                                                         std::vector<Segment> segments,
                                                         int64_t steps) {
  struct Replica {
    torch::nn::Sequential net;
    std::unique_ptr<torch::optim::SGD> opt;
    torch::Tensor memory;  // SparseLoCo's error feedback; Streaming DiLoCo top-k's residual
    // Streaming DiLoCo: the outer gradient sent; eager updates' others' average and provisional
    // weights.
    torch::Tensor sent, others, provisional;
  };
  torch::Tensor global = flat(*make_model()).clone();
  auto make_replica = [&] {
    Replica r{make_model(),
              nullptr,
              torch::zeros_like(global),
              torch::zeros_like(global),
              torch::zeros_like(global),
              torch::zeros_like(global)};
    r.opt = std::make_unique<torch::optim::SGD>(make_sgd(*r.net));
    return r;
  };
  auto set_flat = [](torch::nn::Module& m, const torch::Tensor& v, int64_t first, int64_t n) {
    torch::NoGradGuard no_grad;
    int64_t at = 0;
    for (auto& p : m.parameters()) {
      auto pf = p.view({-1});
      const int64_t lo = std::max(at, first), hi = std::min(at + p.numel(), first + n);
      if (lo < hi) pf.narrow(0, lo - at, hi - lo).copy_(v.narrow(0, lo, hi - lo));
      at += p.numel();
    }
  };
  const int64_t count = global.numel();
  std::vector<Replica> replicas;
  torch::Tensor momentum = torch::zeros_like(global);
  ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
  const DiLoCo dc = make_diloco();
  const bool streaming = streaming_job(algorithm);
  const StreamingDiLoCo sc = make_streaming(streaming ? algorithm : "streaming-diloco");
  const auto* topk = std::get_if<Sparsification>(&sc.outer_compression);
  const SparseLoCo lc = make_sparseloco();
  // Outer SGD with Nesterov momentum on x and buf, as algorithms/local_update/outer_step.h.
  auto outer_sgd = [](double lr, double mu, torch::Tensor x, torch::Tensor buf,
                      torch::Tensor mean) {
    buf.mul_(mu).add_(mean);
    x.sub_(mean.add(buf, mu), lr);
  };
  // Streaming DiLoCo's fragments and schedule, as streaming_diloco.h cuts them.
  std::vector<std::pair<size_t, size_t>> cuts;
  {
    std::vector<size_t> rows, cols;
    for (auto& p : make_model()->parameters()) {
      const auto n = static_cast<size_t>(p.numel());
      const size_t r = p.dim() >= 2 ? static_cast<size_t>(p.size(0)) : n;
      rows.push_back(r);
      cols.push_back(n / r);
    }
    cuts = streaming_fragments(rows, cols, sc.fragments);
  }
  auto due = [&](int64_t t) {
    for (int f = 0; f < sc.fragments; ++f)
      if ((f + 1) * sc.inner_steps / sc.fragments % sc.inner_steps == t % sc.inner_steps) return f;
    return -1;
  };
  // Eager updates' shared part: each fragment's last average and the world that took it.
  torch::Tensor average = torch::zeros_like(global);
  std::vector<int> average_world(static_cast<size_t>(sc.fragments), 0);
  int flight = -1;
  int64_t apply_at = 0;
  size_t next = 0;  // the next segment
  auto switch_world = [&] {
    const Segment& seg = segments[next++];
    while (static_cast<int>(replicas.size()) > seg.world) replicas.pop_back();
    while (static_cast<int>(replicas.size()) < seg.world) {
      auto r = make_replica();
      if (!replicas.empty()) {
        auto& from = replicas.at(static_cast<size_t>(seg.source));
        auto state = troupe::module_state(from.net.ptr(), *from.opt);
        troupe::module_state(r.net.ptr(), *r.opt).load(state.save());
      }
      for (size_t f = 0; f < average_world.size(); ++f)
        if (average_world[f] > 0) {
          const auto first = static_cast<int64_t>(cuts[f].first);
          const auto n = static_cast<int64_t>(cuts[f].second) - first;
          r.others.narrow(0, first, n).copy_(average.narrow(0, first, n));
        }
      replicas.push_back(std::move(r));
    }
  };
  switch_world();
  for (int64_t t = 1; t <= steps; ++t) {
    const int world = static_cast<int>(replicas.size());
    for (int r = 0; r < world; ++r) {
      auto& rep = replicas[static_cast<size_t>(r)];
      train_step(rep.net, *rep.opt, d, t - 1, r, world, sampler);
      rep.opt->step();
    }
    if (algorithm == "diloco" && t % dc.inner_steps == 0) {
      torch::Tensor mean = torch::zeros_like(global);
      for (auto& rep : replicas) mean += global - flat(*rep.net);
      mean /= world;
      outer_sgd(dc.outer_lr, dc.outer_momentum, global, momentum, mean);
      for (auto& rep : replicas) set_flat(*rep.net, global, 0, count);
    }
    if (algorithm == "sparseloco" && t % lc.inner_steps == 0) {
      torch::Tensor sum = torch::zeros_like(global);
      for (auto& rep : replicas) {  // in rank order, as the module sums
        rep.memory.mul_(static_cast<float>(lc.ef_decay)).add_(global - flat(*rep.net));
        torch::Tensor sent = torch::zeros_like(global);
        for (int64_t c = 0; c < count; c += static_cast<int64_t>(lc.chunk)) {
          const int64_t len = std::min<int64_t>(static_cast<int64_t>(lc.chunk), count - c);
          const int64_t k = std::clamp<int64_t>(std::llround(lc.ratio * len), 1, len);
          auto e = rep.memory.narrow(0, c, len);
          auto top = std::get<1>(e.abs().topk(k));
          sent.narrow(0, c, len).index_put_({top}, e.index({top}));
          e.index_put_({top}, 0.0f);
        }
        sum += sent;
      }
      global.sub_(sum * static_cast<float>(lc.outer_lr / world));
      for (auto& rep : replicas) set_flat(*rep.net, global, 0, count);
    }
    if (streaming) {
      auto part = [&](const torch::Tensor& v, int f) {
        const auto first = static_cast<int64_t>(cuts[static_cast<size_t>(f)].first);
        const auto last = static_cast<int64_t>(cuts[static_cast<size_t>(f)].second);
        return v.narrow(0, first, last - first);
      };
      const double w = world;
      auto land = [&] {
        const int f = flight;
        auto g = part(global, f);
        torch::Tensor mean = torch::zeros_like(g);
        if (topk && world > 1) {
          // Each rank's top k of its outer gradient plus residual, scatter-added in rank order
          // times 1/W (comm/compression/sparsification.cpp). A world of one reduces nothing.
          const int64_t n = g.numel();
          const int64_t k =
              std::max<int64_t>(1, static_cast<int64_t>(std::llround(topk->ratio * n)));
          const auto scale = static_cast<float>(1.0 / w);
          for (auto& rep : replicas) {
            auto x = part(rep.sent, f) + part(rep.memory, f);
            auto top = std::get<1>(x.abs().topk(k));
            auto values = x.index({top});
            mean.index_put_({top}, mean.index({top}) + values * scale);
            x.index_put_({top}, 0.0f);
            part(rep.memory, f).copy_(x);
          }
        } else {
          for (auto& rep : replicas) mean += part(rep.sent, f);
          mean /= world;
        }
        if (sc.eager) {
          for (auto& rep : replicas)
            if (world > 1)
              part(rep.others, f).copy_(mean.mul(w).sub_(part(rep.sent, f)).div_(w - 1));
          part(average, f).copy_(mean);
          average_world[static_cast<size_t>(f)] = world;
        }
        outer_sgd(sc.outer_lr, sc.outer_momentum, g, part(momentum, f), mean);
        const double alpha = sc.fragment_update_alpha;
        for (auto& rep : replicas) {
          auto mine = flat(*rep.net);
          auto local = part(mine, f);
          if (sc.eager) local.add_(g).sub_(part(rep.provisional, f));
          local.mul_(alpha).add_(g, 1 - alpha);
          set_flat(*rep.net, mine, 0, count);
        }
        flight = -1;
      };
      if (flight >= 0 && t == apply_at) land();
      if (next < segments.size() && segments[next].from == t) switch_world();
      if (const int f = due(t); f >= 0) {
        const int now = static_cast<int>(replicas.size());
        const double wn = now;
        for (auto& rep : replicas) {
          auto mine = flat(*rep.net);
          auto d = part(global, f) - part(mine, f);
          part(rep.sent, f).copy_(d);
          if (sc.eager) {
            // The provisional outer step on copies, from this rank's outer gradient and the
            // others' last average (streaming_diloco.cpp's start()).
            auto proxy = average_world[static_cast<size_t>(f)] > 0
                             ? d.div(wn).add_(part(rep.others, f), (wn - 1) / wn)
                             : d.clone();
            auto m = part(momentum, f).clone();
            auto p = part(global, f).clone();
            outer_sgd(sc.outer_lr, sc.outer_momentum, p, m, proxy);
            part(rep.provisional, f).copy_(p);
            part(mine, f).copy_(p);
            set_flat(*rep.net, mine, 0, count);
          }
        }
        flight = f;
        apply_at = t + sc.delay;
      }
    } else if (next < segments.size() && segments[next].from == t) {
      switch_world();
    }
  }
  std::vector<torch::Tensor> out;
  for (auto& rep : replicas) out.push_back(flat(*rep.net));
  return out;
}

}  // namespace troupe::test::elastic
