#include "actors/reducer.h"

#include <algorithm>
#include <caf/all.hpp>
#include <chrono>
#include <map>

namespace troupe::actors {

namespace {

using Clock = std::chrono::steady_clock;

struct StepState {
  int done = 0;
  std::vector<bool> finished;
  std::string failure;
  caf::typed_response_promise<step_done_atom, uint32_t, bool, std::string> waiter;
  // The buckets the waiter waits for; empty: all of them (the step ends with that answer).
  std::vector<int> wanted;
  Clock::time_point since;  // when the waiter came
  int64_t stall_ms = 0;
  bool stalled = false;
};

struct ReducerState {
  int buckets = 0;
  std::vector<bucket_actor> handles;
  std::vector<std::vector<std::string>> names;
  std::vector<int> expected;
  std::map<uint32_t, StepState> steps;
  // One stall timer at a time, re-armed for the oldest waiter: a timer per step would keep a
  // delayed message per step alive for the whole stall timeout.
  bool timer_armed = false;
  static inline const char* name = "troupe.reducer";
};

using Self = reducer_actor::stateful_pointer<ReducerState>;

StepState& step_state(Self self, uint32_t step) {
  auto& s = self->state.steps[step];
  if (s.finished.empty()) s.finished.assign(static_cast<size_t>(self->state.buckets), false);
  return s;
}

std::string describe(Self self, int bucket) {
  std::string s = "bucket " + std::to_string(bucket) + " (";
  const auto& names = self->state.names[static_cast<size_t>(bucket)];
  for (size_t i = 0; i < names.size() && i < 4; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > 4) s += ", ... " + std::to_string(names.size() - 4) + " more";
  return s + ")";
}

bool wanted_done(const StepState& s, int buckets) {
  if (s.wanted.empty()) return s.done == buckets;
  for (int b : s.wanted)
    if (!s.finished[static_cast<size_t>(b)]) return false;
  return true;
}

void deliver_if_ready(Self self, uint32_t step) {
  auto it = self->state.steps.find(step);
  if (it == self->state.steps.end()) return;
  auto& s = it->second;
  if (!s.waiter.pending()) return;
  const bool ok = s.failure.empty();
  if (ok && !wanted_done(s, self->state.buckets)) return;
  s.waiter.deliver(step_done_atom::value, step, ok, s.failure);
  // A wait for some of the buckets leaves the step (and a failure) for the waits that follow.
  if (s.wanted.empty()) {
    self->state.steps.erase(it);
  } else {
    s.waiter = {};
    s.wanted.clear();
    s.stalled = false;
  }
}

std::string list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

// The stall timeout of `step` has passed: ask every unfinished bucket where it stands, then
// fail the step with what they said.
void report_stall(Self self, uint32_t step) {
  auto it = self->state.steps.find(step);
  const int64_t stall_ms = it->second.stall_ms;
  it->second.stalled = true;
  auto pending = std::make_shared<int>(0);
  auto report =
      std::make_shared<std::string>("step " + std::to_string(step) + " stalled: not done after " +
                                    std::to_string(stall_ms) + " ms:");
  auto finish = [self, step, report] {
    auto jt = self->state.steps.find(step);
    if (jt == self->state.steps.end() || !jt->second.waiter.pending()) return;
    jt->second.failure = *report;
    deliver_if_ready(self, step);
  };
  const auto& wanted = it->second.wanted;
  for (int b = 0; b < self->state.buckets; ++b) {
    if (it->second.finished[static_cast<size_t>(b)]) continue;
    if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), b) == wanted.end()) continue;
    ++*pending;
    self->request(self->state.handles[static_cast<size_t>(b)], std::chrono::seconds(2),
                  progress_atom::value)
        .then(
            [self, b, pending, report, finish](bucket_state_atom, int, bool launched, int ready,
                                               const std::vector<int>& waiting) {
              if (launched)
                *report += " " + describe(self, b) + " is reducing and waits for rank(s) " +
                           (waiting.empty() ? "(none)" : list(waiting)) + ";";
              else
                *report += " " + describe(self, b) + " never started: " + std::to_string(ready) +
                           " of " + std::to_string(self->state.expected[static_cast<size_t>(b)]) +
                           " parameters had a gradient;";
              if (--*pending == 0) finish();
            },
            [self, b, pending, report, finish](caf::error&) {
              *report += " " + describe(self, b) + " did not answer;";
              if (--*pending == 0) finish();
            });
  }
  if (*pending == 0) finish();
}

void arm_stall_timer(Self self, std::chrono::milliseconds after) {
  if (self->state.timer_armed) return;
  self->state.timer_armed = true;
  self->delayed_send(self, after, stall_atom::value);
}

// A waiter for `wanted` of the buckets of `step` (empty: all, which ends the step).
caf::result<step_done_atom, uint32_t, bool, std::string> await(Self self, uint32_t step,
                                                               int64_t stall_ms,
                                                               std::vector<int> wanted) {
  for (int b : wanted)
    if (b < 0 || b >= self->state.buckets)
      return {step_done_atom::value, step, false,
              "step " + std::to_string(step) + ": no bucket " + std::to_string(b) +
                  " (expected 0 to " + std::to_string(self->state.buckets - 1) + ")"};
  auto& s = step_state(self, step);
  s.wanted = std::move(wanted);
  if (!s.failure.empty() || wanted_done(s, self->state.buckets)) {
    const bool ok = s.failure.empty();
    std::string failure = s.failure;
    if (s.wanted.empty())
      self->state.steps.erase(step);
    else
      s.wanted.clear();
    return {step_done_atom::value, step, ok, failure};
  }
  s.waiter = self->make_response_promise<step_done_atom, uint32_t, bool, std::string>();
  s.since = Clock::now();
  s.stall_ms = stall_ms;
  arm_stall_timer(self, std::chrono::milliseconds(stall_ms));
  return caf::delegated<step_done_atom, uint32_t, bool, std::string>{};
}

reducer_actor::behavior_type reducer(Self self, int buckets) {
  self->state.buckets = buckets;
  return {
      [self](setup_atom, const std::vector<bucket_actor>& handles,
             const std::vector<std::vector<std::string>>& names, const std::vector<int>& expected) {
        self->state.handles = handles;
        self->state.names = names;
        self->state.expected = expected;
      },
      [self](bucket_done_atom, int index, uint32_t step, bool ok, const std::string& error, int) {
        auto& s = step_state(self, step);
        if (s.finished[static_cast<size_t>(index)]) return;
        s.finished[static_cast<size_t>(index)] = true;
        ++s.done;
        if (!ok && s.failure.empty())
          s.failure =
              "step " + std::to_string(step) + ": " + describe(self, index) + " failed: " + error;
        deliver_if_ready(self, step);
      },
      [self](await_atom, uint32_t step,
             int64_t stall_ms) -> caf::result<step_done_atom, uint32_t, bool, std::string> {
        return await(self, step, stall_ms, {});
      },
      [self](await_atom, uint32_t step, int64_t stall_ms, const std::vector<int>& buckets)
          -> caf::result<step_done_atom, uint32_t, bool, std::string> {
        return await(self, step, stall_ms, buckets);
      },
      [self](stall_atom) {
        self->state.timer_armed = false;
        const auto now = Clock::now();
        std::vector<uint32_t> stalled;
        auto next = Clock::duration::max();
        for (auto& [step, s] : self->state.steps) {
          if (!s.waiter.pending() || s.stalled) continue;
          const auto due = s.since + std::chrono::milliseconds(s.stall_ms);
          if (now >= due)
            stalled.push_back(step);
          else
            next = std::min(next, due - now);
        }
        if (next != Clock::duration::max())
          arm_stall_timer(self, std::chrono::ceil<std::chrono::milliseconds>(next));
        for (uint32_t step : stalled) report_stall(self, step);
      },
  };
}

}  // namespace

Reducer Reducer::spawn(caf::actor_system& system, int buckets) {
  return Reducer(system.spawn(reducer, buckets));
}

bucket_sink_actor Reducer::sink() const { return actor_; }

void Reducer::set_buckets(const std::vector<Bucket>& buckets,
                          const std::vector<std::vector<std::string>>& names,
                          const std::vector<int>& expected) const {
  std::vector<bucket_actor> handles;
  for (const auto& b : buckets) handles.push_back(b.actor());
  caf::anon_send(actor_, setup_atom::value, std::move(handles), names, expected);
}

StepResult Reducer::await(uint32_t step, std::chrono::milliseconds stall,
                          const std::vector<int>& wanted) const {
  StepResult result;
  if (!actor_) {
    result.error = "step " + std::to_string(step) + ": no reducer";
    return result;
  }
  auto& system = actor_.home_system();
  caf::scoped_actor self{system};
  const int64_t stall_ms = stall.count();
  // The deadline is the reducer's: it answers with a stall report after stall_ms. A request
  // timeout here would be an entry in CAF's clock that keeps this scoped actor alive until it
  // expires, whether or not the answer came (one per step, for a minute: the memory of a long
  // job grew with them); a reducer that is gone answers at once with an error.
  auto on_answer = [&](step_done_atom, uint32_t, bool ok, const std::string& error) {
    result.ok = ok;
    result.error = error;
  };
  auto on_error = [&](caf::error& e) {
    result.error =
        "step " + std::to_string(step) + ": no answer from the reducer: " + system.render(e);
  };
  if (wanted.empty())
    self->request(actor_, caf::infinite, await_atom::value, step, stall_ms)
        .receive(on_answer, on_error);
  else
    self->request(actor_, caf::infinite, await_atom::value, step, stall_ms, wanted)
        .receive(on_answer, on_error);
  return result;
}

void Reducer::stop() {
  if (actor_) caf::anon_send_exit(actor_, caf::exit_reason::user_shutdown);
  actor_ = nullptr;
}

}  // namespace troupe::actors
