// cuda/stream.h and cuda/event_watcher.h: streams, events, pinned memory and copies on the GPU,
// and the watcher's callbacks and deadlines. The argument checks run without a GPU too.
#ifdef TROUPE_HAVE_CUDA

#include "cuda/stream.h"
#include "cuda/event_watcher.h"
#include "cuda/reduce.h"
#include "tests/support/cuda_stream.h"
#include "tests/support/skip.h"

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;

bool skip_without_device() {
  if (troupe::cuda::device_available()) return false;
  troupe::test::skip_case("no CUDA device in this process: skipping the GPU case");
  return true;
}

/// A host function that holds its stream until release() (or 20 s, so that a failing test does
/// not hang): work enqueued after it, and events recorded after it, stay pending until then.
struct Gate {
  std::atomic<bool> open{false};
  static void CUDART_CB hold(void* self) {
    auto* gate = static_cast<Gate*>(self);
    const auto give_up = std::chrono::steady_clock::now() + 20s;
    while (!gate->open.load() && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(1ms);
  }
  void close_on(void* stream) {
    CHECK_CUDA(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), &Gate::hold, this));
  }
  void release() { open = true; }
};

}  // namespace

TEST_CASE("bad stream arguments are rejected naming the value, with or without a GPU") {
  using namespace troupe::cuda;
  CHECK(device_count() >= 0);
  CHECK_THROWS_WITH_AS(set_device(-1), doctest::Contains("device -1"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      set_device(device_count()),
      doctest::Contains(("expected 0 <= device < " + std::to_string(device_count())).c_str()),
      std::invalid_argument);
  CHECK_THROWS_WITH_AS(record_event(nullptr, nullptr), doctest::Contains("event is null"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(event_done(nullptr), doctest::Contains("event is null"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(host_alloc(0), doctest::Contains("0 bytes"), std::invalid_argument);
  int x = 0;
  CHECK_THROWS_WITH_AS(copy_to_host_async(&x, nullptr, 4, nullptr),
                       doctest::Contains("null buffer with 4 bytes"), std::invalid_argument);
  CHECK(device_of(&x) == -1);
  CHECK(device_of(nullptr) == -1);
}

TEST_CASE("an event watcher refuses a null event and stops cleanly with nothing watched") {
  troupe::cuda::EventWatcher watcher(-1);
  CHECK_THROWS_WITH_AS(watcher.watch(nullptr, "the copy", 1s, [](const std::string&) {}),
                       doctest::Contains("'the copy' is null"), std::invalid_argument);
}

TEST_CASE("pinned memory goes to the device and back through two streams ordered by an event") {
  if (skip_without_device()) return;
  using namespace troupe::cuda;
  DeviceGuard guard(0);
  CHECK(current_device() == 0);
  const size_t n = 1 << 20;
  auto* host = static_cast<float*>(host_alloc(n * sizeof(float)));
  auto* back = static_cast<float*>(host_alloc(n * sizeof(float)));
  std::iota(host, host + n, 1.0f);
  std::memset(back, 0, n * sizeof(float));
  void* device = nullptr;
  CHECK_CUDA(cudaMalloc(&device, n * sizeof(float)));
  CHECK(device_of(device) == 0);
  CHECK(device_of(host) == -1);

  void* up = create_stream();
  void* down = create_stream();
  void* uploaded = create_event();
  Gate gate;
  gate.close_on(up);  // the upload, and so the download, wait for the gate
  copy_to_device_async(device, host, n * sizeof(float), up);
  record_event(uploaded, up);
  stream_wait_event(down, uploaded);
  copy_to_host_async(back, device, n * sizeof(float), down);
  void* downloaded = create_event();
  record_event(downloaded, down);
  CHECK_FALSE(event_done(downloaded));  // held by the gate
  gate.release();
  synchronize_stream(down);
  CHECK(event_done(uploaded));
  CHECK(event_done(downloaded));
  CHECK(std::memcmp(host, back, n * sizeof(float)) == 0);

  destroy_event(uploaded);
  destroy_event(downloaded);
  destroy_stream(up);
  destroy_stream(down);
  cudaFree(device);
  host_free(host);
  host_free(back);
}

TEST_CASE(
    "an event watcher calls back when an event completes, and names one that misses its deadline") {
  if (skip_without_device()) return;
  using namespace troupe::cuda;
  DeviceGuard guard(0);
  EventWatcher watcher(0);
  troupe::test::Stream stream;
  void* quick = create_event();
  void* stuck = create_event();
  Gate gate;

  record_event(quick, stream.handle());
  std::promise<std::string> quick_done;
  watcher.watch(quick, "the quick one", 5s, [&](const std::string& e) { quick_done.set_value(e); });
  auto quick_future = quick_done.get_future();
  REQUIRE(quick_future.wait_for(5s) == std::future_status::ready);
  CHECK(quick_future.get() == "");

  gate.close_on(stream.handle());
  record_event(stuck, stream.handle());
  std::promise<std::string> stuck_done;
  const auto start = std::chrono::steady_clock::now();
  watcher.watch(stuck, "the stuck one", 200ms,
                [&](const std::string& e) { stuck_done.set_value(e); });
  auto stuck_future = stuck_done.get_future();
  REQUIRE(stuck_future.wait_for(5s) == std::future_status::ready);
  const auto waited = std::chrono::steady_clock::now() - start;
  const std::string error = stuck_future.get();
  CHECK(error.find("'the stuck one' did not complete within 200 ms") != std::string::npos);
  CHECK(waited >= 200ms);
  gate.release();
  stream.synchronize();
  destroy_event(quick);
  destroy_event(stuck);
}

#endif  // TROUPE_HAVE_CUDA
