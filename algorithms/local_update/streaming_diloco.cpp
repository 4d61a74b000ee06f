#include "algorithms/local_update/streaming_diloco.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>

#include "algorithms/local_update/outer_step.h"
#include "comm/collectives/communicator.h"
#include "comm/collectives/driver.h"
#include "comm/compression/reduction.h"
#include "comm/state.h"
#include "comm/tags.h"
#include "rank/module_id.h"
#include "rank/runtime_internal.h"

namespace troupe {

std::string streaming_diloco_name(const StreamingDiLoCo& c) {
  std::ostringstream s;
  s << "streaming_diloco(h=" << c.inner_steps << ", fragments=" << c.fragments
    << ", delay=" << c.delay << ", alpha=" << c.fragment_update_alpha << ", outer_lr=" << c.outer_lr
    << ", outer_momentum=" << c.outer_momentum << (c.nesterov ? "" : ", heavy ball") << ", "
    << comm::algorithm_name(c.outer_compression) << (c.eager ? ", eager" : "") << ")";
  return s.str();
}

std::vector<std::pair<size_t, size_t>> streaming_fragments(const std::vector<size_t>& rows,
                                                           const std::vector<size_t>& cols,
                                                           int fragments) {
  // Every place the flat vector may be cut: the end of each row.
  std::vector<size_t> ends;
  size_t at = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    for (size_t r = 0; r < rows[i]; ++r) ends.push_back(at += cols[i]);
  const size_t parts = static_cast<size_t>(fragments);
  if (fragments < 1 || ends.size() < parts)
    throw comm::Error("Streaming DiLoCo: fragments = " + std::to_string(fragments) +
                      ", expected 1 <= it <= " + std::to_string(ends.size()) +
                      " (the rows the model's parameters have to cut at)");
  std::vector<std::pair<size_t, size_t>> out;
  size_t taken = 0;  // rows already in earlier fragments
  for (size_t k = 0; k + 1 < parts; ++k) {
    const double target =
        static_cast<double>(at) * static_cast<double>(k + 1) / static_cast<double>(parts);
    // The row end nearest the target that leaves each fragment (this and the rest) a row.
    const size_t lo = taken + 1, hi = ends.size() - (parts - 1 - k);
    size_t j = static_cast<size_t>(
                   std::lower_bound(ends.begin(), ends.end(), static_cast<size_t>(target)) -
                   ends.begin()) +
               1;
    if (j > 1 && j <= ends.size() &&
        target - static_cast<double>(ends[j - 2]) < static_cast<double>(ends[j - 1]) - target)
      --j;
    j = std::clamp(j, lo, hi);
    out.emplace_back(taken ? ends[taken - 1] : 0, ends[j - 1]);
    taken = j;
  }
  out.emplace_back(taken ? ends[taken - 1] : 0, at);
  return out;
}

namespace {

StreamingDiLoCo checked(StreamingDiLoCo c) {
  check_outer_settings("Streaming DiLoCo", c.inner_steps, c.outer_lr, c.outer_momentum);
  auto bad = [](const std::string& what) { throw comm::Error("Streaming DiLoCo: " + what); };
  if (c.fragments < 1 || c.fragments > c.inner_steps)
    bad("fragments = " + std::to_string(c.fragments) + ", expected 1 <= it <= inner_steps (" +
        std::to_string(c.inner_steps) + "): each fragment needs its own sync step");
  const int most = c.inner_steps / c.fragments;
  if (c.delay < 0 || c.delay > most)
    bad("delay = " + std::to_string(c.delay) + ", expected 0 <= it <= inner_steps / fragments (" +
        std::to_string(most) + "): one fragment in flight at a time");
  if (!(c.fragment_update_alpha >= 0 && c.fragment_update_alpha <= 1))
    bad("fragment_update_alpha = " + comm::number_text(c.fragment_update_alpha) +
        ", expected 0 <= it <= 1");
  return c;
}

/// The module's own thread for reductions in flight: one job at a time, posted by the trainer and
/// waited for by it with a deadline.
class Courier {
 public:
  Courier() : thread_([this] { loop(); }) {}
  ~Courier() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  void post(std::function<comm::Status()> job) {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = std::move(job);
    done_ = false;
    wake_.notify_all();
  }
  /// The job's status, or a failure naming `what` when it has not ended by `deadline`.
  comm::Status wait(std::chrono::steady_clock::time_point deadline, const std::string& what) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!wake_.wait_until(lock, deadline, [&] { return done_; }))
      return comm::Status::failure(what + ": no answer by the deadline");
    return status_;
  }
  /// Whether the last job posted has ended (its status is the one wait() returned).
  bool done() {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || job_; });
      if (!job_) return;  // stopping with nothing posted
      auto job = std::move(job_);
      job_ = nullptr;
      lock.unlock();
      comm::Status status;
      try {
        status = job();
      } catch (const std::exception& e) {
        status = comm::Status::failure(e.what());
      }
      lock.lock();
      status_ = status;
      done_ = true;
      wake_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::function<comm::Status()> job_;
  comm::Status status_;
  bool done_ = true;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the rest is built
};

}  // namespace

struct StreamingDiLoCoModule::Impl : Algorithm {
  struct Fragment {
    size_t first = 0, count = 0;
    comm::BucketBuffer bucket;  // over delta's slice
    std::shared_ptr<comm::Reduction> reduction;
    int offset = 0;            // syncs after inner step t when t % H == offset
    int64_t syncs = 0;         // reductions started
    bool has_average = false;  // eager: `others` holds the others' last average
    int average_world = 0;     // eager: the world that took `average`, the fragment's last one
  };

  Impl(Runtime& rt, std::shared_ptr<torch::nn::Module> m, StreamingDiLoCo c)
      : runtime(rt),
        config(checked(std::move(c))),
        sgd{config.outer_lr, config.outer_momentum, config.nesterov},
        id(rt),
        core(rt, m, "Streaming DiLoCo", /*with_momentum=*/true) {
    const auto count = static_cast<int64_t>(core.flat.count());
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    if (config.eager) {
      own = torch::zeros({count}, f32);
      others = torch::zeros({count}, f32);
      provisional = torch::zeros({count}, f32);
      average = torch::zeros({count}, f32);
    }
    std::vector<size_t> rows, cols, slot_rows;
    for (auto& p : m->parameters()) {
      const auto n = static_cast<size_t>(p.numel());
      const size_t r = p.dim() >= 2 ? static_cast<size_t>(p.size(0)) : n;
      rows.push_back(r);
      cols.push_back(r ? n / r : 0);
      slot_rows.push_back(p.dim() >= 2 ? r : 1);
    }
    const auto cuts = streaming_fragments(rows, cols, config.fragments);
    const int H = config.inner_steps, P = config.fragments;
    for (size_t f = 0; f < cuts.size(); ++f) {
      Fragment frag;
      frag.first = cuts[f].first;
      frag.count = cuts[f].second - cuts[f].first;
      frag.offset = static_cast<int>(static_cast<int64_t>(f + 1) * H / P % H);
      frag.bucket.index = static_cast<int>(f);
      frag.bucket.data = core.delta.data_ptr<float>() + frag.first;
      frag.bucket.count = frag.count;
      frag.bucket.type = comm::DataType::float32;
      // The pieces of the tensors in this fragment, each whole rows of its tensor.
      size_t at = 0;
      for (size_t i = 0; i < rows.size(); ++i) {
        const size_t n = rows[i] * cols[i];
        const size_t lo = std::max(at, frag.first), hi = std::min(at + n, cuts[f].second);
        if (lo < hi) {
          comm::TensorSlot slot;
          slot.offset = lo - frag.first;
          slot.count = hi - lo;
          slot.rows = slot_rows[i] == 1 ? 1 : slot.count / cols[i];
          frag.bucket.tensors.push_back(slot);
        }
        at += n;
      }
      frag.reduction = comm::make_reduction(config.outer_compression, frag.bucket);
      fragments.push_back(std::move(frag));
    }
    Impl* self = this;
    listener = rt.add_failure_listener([self](int rank, const std::string& reason) {
      {
        std::lock_guard<std::mutex> lock(self->broken_mutex);
        if (self->broken.empty()) {
          self->broken = reason;
          self->broken_peer = rank;
        }
      }
      self->driver.abort(comm::Status::failure(reason, rank));
    });
  }

  ~Impl() { runtime.remove_failure_listener(listener); }

  static torch::Tensor slice(const torch::Tensor& t, const Fragment& f) {
    return t.narrow(0, static_cast<int64_t>(f.first), static_cast<int64_t>(f.count));
  }

  // After inner step `inner`: fragment f's outer gradient is computed and its reduction posted.
  void start(int f) {
    auto& frag = fragments[static_cast<size_t>(f)];
    {
      std::lock_guard<std::mutex> lock(core.flat.mutex());
      auto local = core.local();
      auto d = core.take_pseudo_gradient(local, frag.first, frag.count);
      if (config.eager) {
        // The provisional outer step: this rank's fresh outer gradient stands in for the others'
        // that are still on the way (1/W own + (W-1)/W the others' last average); the local
        // fragment continues from where that step lands.
        auto mine = slice(own, frag), p = slice(provisional, frag);
        mine.copy_(d);
        const double w = runtime.world_size();
        auto proxy = frag.has_average ? d.div(w).add_(slice(others, frag), (w - 1) / w) : d.clone();
        auto m = slice(core.momentum, frag).clone();
        p.copy_(slice(core.global, frag));
        sgd.step(p, m, proxy);  // on copies: the global fragment and its momentum stay
        slice(local, frag).copy_(p);
        core.flat.push();
      }
    }
    flight = f;
    apply_at = core.inner + config.delay;
    arrived = false;
    failed = false;
    const auto step = static_cast<uint32_t>(frag.syncs++);
    if (runtime.world_size() == 1) {
      arrived = true;
      traffic = {};
      return;
    }
    {
      std::lock_guard<std::mutex> lock(broken_mutex);
      failed = !broken.empty();  // never posted: nothing to wait for
      if (failed)
        throw comm::Error(
            "Streaming DiLoCo's reduction of fragment " + std::to_string(f) + " refused: " + broken,
            broken_peer);
    }
    auto built = frag.reduction->stages(core.reduce_step(step));
    if (built.size() > static_cast<size_t>(comm::tags::kMaxStages))
      throw comm::Error("Streaming DiLoCo: " + frag.reduction->name() + " has " +
                        std::to_string(built.size()) + " stages, expected at most " +
                        std::to_string(comm::tags::kMaxStages));
    std::vector<comm::Stage> stages;
    for (size_t s = 0; s < built.size(); ++s)
      stages.push_back(
          comm::Stage{comm::tags::bucket_key(id.key_prefix(), step, static_cast<int>(s), f),
                      std::move(built[s])});
    timeout = detail::RuntimeAccess::collective_timeout(runtime);
    auto transport = runtime.transport();
    courier.post([this, stages = std::move(stages), transport]() mutable {
      auto status = driver.run(std::move(stages), transport, timeout);
      traffic.sent = driver.last_bytes_sent();
      traffic.received = driver.last_bytes_received();
      return status;
    });
  }

  // Waits for the reduction in flight; its average is then in delta.
  void await() {
    if (arrived || flight < 0) return;
    if (failed)
      throw comm::Error("Streaming DiLoCo: the reduction of fragment " + std::to_string(flight) +
                        " failed (sync " +
                        std::to_string(fragments[static_cast<size_t>(flight)].syncs - 1) +
                        "); expected it landed from a peer's state (land_missed_sync) or a "
                        "state loaded");
    const auto t0 = std::chrono::steady_clock::now();
    // The driver fails its peers at its own deadline; this one only guards against a driver that
    // never returns.
    const auto status = courier.wait(
        t0 + timeout + std::chrono::seconds(30),
        "Streaming DiLoCo's reduction of fragment " + std::to_string(flight) + " (sync " +
            std::to_string(fragments[static_cast<size_t>(flight)].syncs - 1) + ")");
    core.count_wait(t0);
    if (!status.ok()) {
      // Ended (not past the deadline): the module's state is at rest and can be saved, with
      // this fragment marked as never landed here.
      failed = courier.done();
      throw comm::Error(status.message(), status.peer());
    }
    arrived = true;
  }

  // The fragment in flight lands: its global copy steps, the local fragment merges.
  void apply() {
    await();
    auto& frag = fragments[static_cast<size_t>(flight)];
    auto d = slice(core.delta, frag), g = slice(core.global, frag);
    core.count_sync(traffic);
    sync_bytes.push_back(traffic.sent);
    std::lock_guard<std::mutex> lock(core.flat.mutex());
    auto local = slice(core.local(), frag);
    const double w = runtime.world_size();
    if (config.eager) {  // the averages, taken before the outer step spends d
      if (w > 1) slice(others, frag).copy_(d.mul(w).sub_(slice(own, frag)).div_(w - 1));
      slice(average, frag).copy_(d);
      frag.average_world = static_cast<int>(w);
    }
    sgd.step(g, slice(core.momentum, frag), d);
    if (config.eager) {
      // The provisional step is replaced by the real one; the delay's local progress is kept.
      local.add_(g).sub_(slice(provisional, frag));
      frag.has_average = true;
    }
    const double alpha = config.fragment_update_alpha;
    if (alpha == 0)
      local.copy_(g);
    else
      local.mul_(alpha).add_(g, 1 - alpha);
    core.flat.push();
    flight = -1;
    ++core.outer;
  }

  // The fragment whose turn it is after inner step t, or -1.
  int due(int64_t t) const {
    const auto phase = static_cast<int>(t % config.inner_steps);
    for (size_t f = 0; f < fragments.size(); ++f)
      if (fragments[f].offset == phase) return static_cast<int>(f);
    return -1;
  }

  std::string name() const override { return streaming_diloco_name(config); }
  OuterStep& outer_step() override { return core; }

  void after_step(int64_t t) override {
    if (flight >= 0 && t == apply_at) {
      apply();
      landed();
    }
    if (const int f = due(t); f >= 0) start_due(f);
  }

  void start_due(int f) {
    start(f);
    if (config.delay == 0) {
      apply();
      landed();
    }
  }

  // How many reductions of fragment f start in the first t inner steps.
  int64_t starts_by(int f, int64_t t) const {
    const int64_t offset = fragments[static_cast<size_t>(f)].offset, H = config.inner_steps;
    if (offset == 0) return t / H;
    return t >= offset ? (t - offset) / H + 1 : 0;
  }

  // A state saved where a sync landed (landed()) and loaded: the fragment due at that step has
  // not started yet.
  void before_step(int64_t t) override {
    if (flight >= 0 || t < 1) return;
    const int f = due(t);
    if (f >= 0 && fragments[static_cast<size_t>(f)].syncs < starts_by(f, t)) start_due(f);
  }

  // The fragment whose reduction started `delay` steps before t, landed as apply() would from
  // the global weights (and, with eager updates, the average) of the shared state loaded. Eager
  // updates also need this rank's own part of that sync: its outer gradient and provisional
  // step, in the state saved after the reduction failed here (flight, failed).
  void land_missed(int64_t t) override {
    const int f = t - config.delay >= 1 ? due(t - config.delay) : -1;
    if (f < 0)
      throw comm::Error("Streaming DiLoCo: no fragment lands after inner step " +
                        std::to_string(t) + " (h = " + std::to_string(config.inner_steps) +
                        ", delay = " + std::to_string(config.delay) + ")");
    if (config.eager && !(flight == f && failed))
      throw comm::Error("Streaming DiLoCo with eager updates: fragment " + std::to_string(f) +
                        "'s provisional step (after inner step " +
                        std::to_string(t - config.delay) +
                        ") is not in this module's state (fragment in flight " +
                        std::to_string(flight) + (failed ? ", failed" : "") +
                        "); expected the state saved where its reduction failed on this rank");
    auto& frag = fragments[static_cast<size_t>(f)];
    std::lock_guard<std::mutex> lock(core.flat.mutex());
    auto local = slice(core.local(), frag);
    if (config.eager) {
      const double w = frag.average_world;
      if (w > 1)
        slice(others, frag).copy_(slice(average, frag).mul(w).sub_(slice(own, frag)).div_(w - 1));
      local.add_(slice(core.global, frag)).sub_(slice(provisional, frag));
    }
    flight = -1;
    failed = false;
    const double alpha = config.fragment_update_alpha;
    if (alpha == 0)
      local.copy_(slice(core.global, frag));
    else
      local.mul_(alpha).add_(slice(core.global, frag), 1 - alpha);
    core.flat.push();
  }

  // A fragment in flight: its average is saved; one whose reduction failed here is saved as
  // such (what land_missed_sync needs of it).
  void before_save() override {
    if (!failed) await();
  }

  void before_load(comm::StateReader& in) override {
    if (flight >= 0 && !failed)
      in.fail("a fragment of this module is in flight (step " + std::to_string(core.inner) +
              "): load into a module that has not stepped since construction or a sync landed");
  }

  void save_rest(comm::StateWriter& out) override {
    out.value(static_cast<int64_t>(flight));
    out.value(apply_at);
    out.value(static_cast<uint8_t>(failed));
    out.vector(values_of(core.delta));  // only the fragment in flight's slice matters
    if (config.eager) {
      out.vector(values_of(own));
      out.vector(values_of(others));
      out.vector(values_of(provisional));
      out.vector(values_of(average));
    }
    for (const auto& f : fragments) {
      out.value(f.syncs);
      out.value(static_cast<uint8_t>(f.has_average));
      out.value(static_cast<int64_t>(f.average_world));
    }
    for (const auto& f : fragments) f.reduction->save_state(out);
  }

  // Shared, where no fragment is in flight (a sync has just landed): each fragment's count of
  // reductions, and with eager updates its last average (what every rank received) and that
  // sync's world; each reduction's shared part. The outer gradient in flight, eager updates'
  // own outer gradient, others' average and provisional step, and the reductions' error
  // feedback are the rank's own.
  void save_shared_rest(comm::StateWriter& out) override {
    if (flight >= 0)
      throw comm::Error("Streaming DiLoCo: fragment " + std::to_string(flight) +
                        " is in flight (after inner step " + std::to_string(core.inner) +
                        "): its shared state is saved where a sync has landed and none is");
    for (const auto& f : fragments) {
      out.value(f.syncs);
      out.value(static_cast<uint8_t>(f.has_average));
      out.value(static_cast<int64_t>(f.average_world));
    }
    if (config.eager) out.vector(values_of(average));
    for (const auto& f : fragments) f.reduction->save_shared_state(out);
  }

  struct PerFragment {
    int64_t syncs = 0;
    bool has_average = false;
    int average_world = 0;
  };
  std::vector<PerFragment> read_per_fragment(comm::StateReader& in) const {
    std::vector<PerFragment> out;
    for (size_t f = 0; f < fragments.size(); ++f) {
      PerFragment p;
      p.syncs = in.value<int64_t>();
      p.has_average = in.value<uint8_t>() != 0;
      const auto world = in.value<int64_t>();
      if (world < 0 || world > (1 << 20))
        in.fail("fragment " + std::to_string(f) + "'s average world " + std::to_string(world) +
                ", expected 0 (none yet) or a world size");
      p.average_world = static_cast<int>(world);
      out.push_back(p);
    }
    return out;
  }
  void set_per_fragment(const std::vector<PerFragment>& per_fragment) {
    for (size_t f = 0; f < fragments.size(); ++f) {
      fragments[f].syncs = per_fragment[f].syncs;
      fragments[f].has_average = per_fragment[f].has_average;
      fragments[f].average_world = per_fragment[f].average_world;
    }
  }

  std::function<void(comm::StateReader&)> read_shared_rest(comm::StateReader& in) override {
    auto per_fragment = read_per_fragment(in);
    std::vector<float> avg;
    if (config.eager) avg = in.vector<float>(core.flat.count(), "Streaming DiLoCo's last averages");
    return [this, per_fragment = std::move(per_fragment),
            avg = std::move(avg)](comm::StateReader& rest) {
      for (auto& f : fragments) f.reduction->load_shared_state(rest);
      if (config.eager) {
        set_values(average, avg);
        // A fragment whose average this rank never took (a rank without its own state: a
        // restarted one) takes the whole average as the others' (it had no part in it).
        for (size_t f = 0; f < fragments.size(); ++f)
          if (per_fragment[f].has_average && !fragments[f].has_average)
            slice(others, fragments[f]).copy_(slice(average, fragments[f]));
      }
      set_per_fragment(per_fragment);
    };
  }

  std::function<void(comm::StateReader&)> read_rest(comm::StateReader& in) override {
    struct Saved {
      int64_t flight = -1, apply_at = 0;
      bool failed = false;
      std::vector<float> delta, own, others, provisional, average;
      std::vector<PerFragment> per_fragment;
    } s;
    s.flight = in.value<int64_t>();
    s.apply_at = in.value<int64_t>();
    s.failed = in.value<uint8_t>() != 0;
    if (s.flight < -1 || s.flight >= static_cast<int64_t>(fragments.size()))
      in.fail("fragment in flight " + std::to_string(s.flight) +
              ", expected -1 (none) or one of the " + std::to_string(fragments.size()) +
              " fragments");
    const auto count = core.flat.count();
    s.delta = in.vector<float>(count, "Streaming DiLoCo's outer gradient in flight");
    if (config.eager) {
      s.own = in.vector<float>(count, "Streaming DiLoCo's own outer gradient");
      s.others = in.vector<float>(count, "Streaming DiLoCo's others' last average");
      s.provisional = in.vector<float>(count, "Streaming DiLoCo's provisional global weights");
      s.average = in.vector<float>(count, "Streaming DiLoCo's last averages");
    }
    s.per_fragment = read_per_fragment(in);
    return [this, s = std::move(s)](comm::StateReader& rest) {
      // Each reduction checks its own state before changing it; the module's own is read
      // above, so a refusal leaves it as it was.
      for (auto& f : fragments) f.reduction->load_state(rest);
      set_values(core.delta, s.delta);
      if (config.eager) {
        set_values(own, s.own);
        set_values(others, s.others);
        set_values(provisional, s.provisional);
        set_values(average, s.average);
      }
      set_per_fragment(s.per_fragment);
      flight = static_cast<int>(s.flight);
      apply_at = s.apply_at;
      failed = s.flight >= 0 && s.failed;
      arrived = !failed;
      traffic = {};
    };
  }

  Runtime& runtime;
  StreamingDiLoCo config;
  OuterSgd sgd;
  ModuleId id;  // before the courier and driver that send under its keys
  OuterStep core;
  // Eager updates only; flat float32, in host memory: this rank's outer gradient of each
  // fragment's last sync, the others' average and the provisional weights of it, and the
  // average every rank received.
  torch::Tensor own, others, provisional, average;
  std::vector<Fragment> fragments;
  int flight = -1;       // the fragment in flight
  int64_t apply_at = 0;  // ... applied after this inner step
  bool arrived = false;  // ... whose average is in delta
  bool failed = false;   // ... whose reduction failed here (ended: nothing more to wait for)
  comm::Communicator::Traffic traffic;  // ... and what its reduction sent
  std::chrono::milliseconds timeout{60000};
  std::vector<uint64_t> sync_bytes;
  std::mutex broken_mutex;
  std::string broken;
  int broken_peer = -1;
  int listener = -1;
  comm::BlockingDriver driver;
  Courier courier;  // last: its thread ends (joined) before the rest goes
};

StreamingDiLoCoModule::StreamingDiLoCoModule(Runtime& runtime,
                                             std::shared_ptr<torch::nn::Module> module,
                                             StreamingDiLoCo config)
    : LocalUpdateModule(std::make_unique<Impl>(runtime, std::move(module), std::move(config))) {}

StreamingDiLoCoModule::Impl& StreamingDiLoCoModule::impl() const {
  return static_cast<Impl&>(*algorithm_);
}

void StreamingDiLoCoModule::finish() {
  if (impl().flight >= 0) impl().apply();
}

std::vector<std::pair<size_t, size_t>> StreamingDiLoCoModule::fragments() const {
  std::vector<std::pair<size_t, size_t>> out;
  for (const auto& f : impl().fragments) out.emplace_back(f.first, f.first + f.count);
  return out;
}

const std::vector<uint64_t>& StreamingDiLoCoModule::sync_bytes_sent() const {
  return impl().sync_bytes;
}

}  // namespace troupe
