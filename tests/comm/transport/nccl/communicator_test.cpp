// comm/transport/nccl: NcclCommunicator against a CPU reference (comm/reduce.h) — one rank with
// every type and operation, several ranks when the machine has one GPU per rank (NCCL refuses two
// ranks of a communicator on one GPU) — its ready events, deadline, abort and split, and its
// argument checks. The construction checks run without a GPU; the rest skip themselves.
#if defined(TROUPE_HAVE_CUDA) && defined(TROUPE_HAVE_NCCL)

#include "comm/transport/nccl/communicator.h"

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "comm/reduce.h"
#include "cuda/reduce.h"
#include "cuda/stream.h"
#include "tests/support/cuda_stream.h"
#include "tests/support/skip.h"

namespace {

using namespace std::chrono_literals;
using troupe::comm::Callback;
using troupe::comm::DataType;
using troupe::comm::NcclCommunicator;
using troupe::comm::ReduceOp;
using troupe::comm::Status;
using Bytes = std::vector<unsigned char>;

bool skip_without_device() {
  if (troupe::cuda::device_available()) return false;
  troupe::test::skip_case("no CUDA device in this process: skipping the GPU case");
  return true;
}

const DataType kTypes[] = {DataType::float32,  DataType::float64, DataType::float16,
                           DataType::bfloat16, DataType::int32,   DataType::int64};
const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max};

/// count elements of `type` holding small integers (exact in every type) that depend on `seed`.
Bytes values(DataType type, size_t count, int seed) {
  Bytes out(count * troupe::comm::element_size(type));
  for (size_t i = 0; i < count; ++i) {
    const int v = static_cast<int>((i * 7 + static_cast<size_t>(seed) * 13) % 41) - 20;
    void* at = out.data() + i * troupe::comm::element_size(type);
    switch (type) {
      case DataType::float32: {
        float f = static_cast<float>(v);
        std::memcpy(at, &f, 4);
        break;
      }
      case DataType::float64: {
        double d = v;
        std::memcpy(at, &d, 8);
        break;
      }
      case DataType::float16: {
        uint16_t h = troupe::comm::float_to_half(static_cast<float>(v));
        std::memcpy(at, &h, 2);
        break;
      }
      case DataType::bfloat16: {
        uint16_t h = troupe::comm::float_to_bfloat16(static_cast<float>(v));
        std::memcpy(at, &h, 2);
        break;
      }
      case DataType::int32: {
        int32_t x = v;
        std::memcpy(at, &x, 4);
        break;
      }
      case DataType::int64: {
        int64_t x = v;
        std::memcpy(at, &x, 8);
        break;
      }
    }
  }
  return out;
}

double element(DataType type, const Bytes& b, size_t i) {
  const void* at = b.data() + i * troupe::comm::element_size(type);
  switch (type) {
    case DataType::float32: {
      float f;
      std::memcpy(&f, at, 4);
      return f;
    }
    case DataType::float64: {
      double d;
      std::memcpy(&d, at, 8);
      return d;
    }
    case DataType::float16: {
      uint16_t h;
      std::memcpy(&h, at, 2);
      return troupe::comm::half_to_float(h);
    }
    case DataType::bfloat16: {
      uint16_t h;
      std::memcpy(&h, at, 2);
      return troupe::comm::bfloat16_to_float(h);
    }
    case DataType::int32: {
      int32_t x;
      std::memcpy(&x, at, 4);
      return x;
    }
    case DataType::int64: {
      int64_t x;
      std::memcpy(&x, at, 8);
      return static_cast<double>(x);
    }
  }
  return 0;
}

/// Element-wise comparison; an average may round differently on the GPU (NCCL's avg
/// pre-multiplies), so `loose` allows a relative error of the type's precision.
void check_same(DataType type, const Bytes& got, const Bytes& want, bool loose,
                const std::string& what) {
  REQUIRE(got.size() == want.size());
  const double tolerance = type == DataType::float16 || type == DataType::bfloat16 ? 1e-2 : 1e-5;
  const size_t n = got.size() / troupe::comm::element_size(type);
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = element(type, got, i), w = element(type, want, i);
    const bool ok = loose ? std::abs(g - w) <= tolerance * std::max(1.0, std::abs(w)) : g == w;
    if (!ok && bad++ < 3)
      FAIL_CHECK(what << " (" << troupe::comm::to_string(type) << "): element " << i << " is " << g
                      << ", expected " << w);
  }
  CHECK_MESSAGE(bad == 0, what);
}

/// Device memory of `bytes` bytes, freed at scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    CHECK_CUDA(cudaMalloc(&data_, std::max<size_t>(bytes, 1)));
  }
  explicit DeviceBuffer(const Bytes& b) : DeviceBuffer(b.size()) { upload(b); }
  ~DeviceBuffer() { cudaFree(data_); }
  void* get() const { return data_; }
  void upload(const Bytes& b) { troupe::test::upload(data_, b.data(), b.size()); }
  Bytes download() const {
    Bytes b(bytes_);
    troupe::test::download(b.data(), data_, bytes_);
    return b;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

/// Runs one operation and waits (at most 30 s) for its callback.
Status wait_for(const std::function<void(Callback)>& post) {
  auto promise = std::make_shared<std::promise<Status>>();
  auto future = promise->get_future();
  auto calls = std::make_shared<std::atomic<int>>(0);
  post([promise, calls](const Status& s) {
    if (calls->fetch_add(1) == 0) promise->set_value(s);
  });
  if (future.wait_for(30s) != std::future_status::ready)
    return Status::failure("test: no callback within 30 s");
  Status s = future.get();
  CHECK(calls->load() == 1);
  return s;
}

/// Holds a stream (a host function) until released, or after `auto_release` at the latest.
struct Gate {
  explicit Gate(std::chrono::milliseconds auto_release = 20s) : limit(auto_release) {}
  std::atomic<bool> open{false};
  std::chrono::milliseconds limit;
  static void CUDART_CB hold(void* self) {
    auto* gate = static_cast<Gate*>(self);
    const auto give_up = std::chrono::steady_clock::now() + gate->limit;
    while (!gate->open.load() && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(1ms);
  }
  void close_on(void* stream) {
    CHECK_CUDA(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), &Gate::hold, this));
  }
};

/// The first `bytes` bytes of b.
Bytes first(const Bytes& b, size_t bytes) { return Bytes(b.begin(), b.begin() + bytes); }

/// The CPU reference of a reduction over ranks' inputs (comm::reduce, then comm::divide).
Bytes reference(DataType type, ReduceOp op, const std::vector<Bytes>& inputs) {
  Bytes out = inputs[0];
  const size_t n = out.size() / troupe::comm::element_size(type);
  for (size_t r = 1; r < inputs.size(); ++r)
    troupe::comm::reduce(out.data(), out.data(), inputs[r].data(), n, type, op);
  if (op == ReduceOp::avg)
    troupe::comm::divide(out.data(), n, type, static_cast<int>(inputs.size()));
  return out;
}

}  // namespace

TEST_CASE(
    "an NCCL communicator refuses bad construction arguments, naming them, before any device "
    "work") {
  const std::string id(NcclCommunicator::kUniqueIdBytes, 'x');
  CHECK_THROWS_WITH_AS(NcclCommunicator(0, 0, id, 0, 1s),
                       doctest::Contains("world size 0 (expected >= 1)"), troupe::comm::Error);
  CHECK_THROWS_WITH_AS(NcclCommunicator(2, 2, id, 0, 1s),
                       doctest::Contains("rank 2 (expected 0 <= rank < 2)"), troupe::comm::Error);
  CHECK_THROWS_WITH_AS(NcclCommunicator(0, 1, "short", 0, 1s),
                       doctest::Contains("unique id of 5 bytes (expected 128"),
                       troupe::comm::Error);
  CHECK_THROWS_WITH_AS(NcclCommunicator(0, 1, id, 0, 0ms),
                       doctest::Contains("timeout 0 ms (expected > 0)"), troupe::comm::Error);
  const int devices = troupe::cuda::device_count();
  CHECK_THROWS_WITH_AS(NcclCommunicator(0, 1, id, devices, 1s),
                       doctest::Contains(("device " + std::to_string(devices) +
                                          " (expected 0 <= device < " + std::to_string(devices))
                                             .c_str()),
                       troupe::comm::Error);
}

TEST_CASE(
    "the NCCL this process loaded is one troupe can run with, and an older one is named and "
    "refused") {
  // Needs no GPU: ncclGetVersion only reads the library.
  const int compiled = NcclCommunicator::compiled_version(),
            loaded = NcclCommunicator::loaded_version();
  CAPTURE(compiled);
  CAPTURE(loaded);
  CHECK(compiled >= 20900);  // 2.9.0 and later number versions major * 10000 + minor * 100 + patch
  CHECK(NcclCommunicator::version_mismatch(compiled, loaded) == "");
  CHECK(NcclCommunicator::version_mismatch(22803, 22803) == "");
  CHECK(NcclCommunicator::version_mismatch(22803, 22901) == "");
  const std::string older = NcclCommunicator::version_mismatch(22803, 22105);
  CHECK(older.find("loaded NCCL 2.21.5, older than the NCCL 2.28.3 troupe was compiled against") !=
        std::string::npos);
  CHECK(older.find("expected the same or newer") != std::string::npos);
}

TEST_CASE("every NCCL collective on one rank matches the CPU reference for every type and op") {
  if (skip_without_device()) return;
  troupe::cuda::DeviceGuard guard(0);
  NcclCommunicator nccl(0, 1, NcclCommunicator::unique_id(), 0, 30s);
  CHECK(nccl.rank() == 0);
  CHECK(nccl.world_size() == 1);
  CHECK(nccl.stream() != nullptr);
  const size_t n = 1003;
  for (DataType type : kTypes) {
    CAPTURE(troupe::comm::to_string(type));
    const Bytes in = values(type, n, 1);
    for (ReduceOp op : kOps) {
      CAPTURE(troupe::comm::to_string(op));
      DeviceBuffer a(in), out(in.size());
      REQUIRE(wait_for([&](Callback done) {
                nccl.allreduce(a.get(), out.get(), n, type, op, {}, done);
              }).ok());
      check_same(type, out.download(), reference(type, op, {in}), false, "allreduce");
      // In place.
      REQUIRE(wait_for([&](Callback done) {
                nccl.allreduce(a.get(), a.get(), n, type, op, {}, done);
              }).ok());
      check_same(type, a.download(), reference(type, op, {in}), false, "allreduce in place");
    }
    DeviceBuffer data(in), out(in.size());
    REQUIRE(wait_for([&](Callback d) { nccl.broadcast(data.get(), n, type, 0, {}, d); }).ok());
    check_same(type, data.download(), in, false, "broadcast");
    REQUIRE(
        wait_for([&](Callback d) { nccl.allgather(data.get(), out.get(), n, type, {}, d); }).ok());
    check_same(type, out.download(), in, false, "allgather");
    REQUIRE(wait_for([&](Callback d) {
              nccl.reduce_scatter(data.get(), out.get(), n, type, ReduceOp::sum, {}, d);
            }).ok());
    check_same(type, out.download(), in, false, "reduce_scatter");
    REQUIRE(
        wait_for([&](Callback d) { nccl.alltoall(data.get(), out.get(), n, type, {}, d); }).ok());
    check_same(type, out.download(), in, false, "alltoall");
    if (type == DataType::int32 || type == DataType::int64) continue;
    // A scaled sum: 0.5 x is exact for these small integers in every float type.
    REQUIRE(wait_for([&](Callback d) {
              nccl.allreduce_scaled(data.get(), out.get(), n, type, 0.5, {}, d);
            }).ok());
    Bytes half = in;
    troupe::comm::scale(half.data(), n, type, 0.5);
    check_same(type, out.download(), half, false, "allreduce_scaled");
  }
  // Nothing to move: completes in order without NCCL, null buffers allowed.
  CHECK(wait_for([&](Callback d) {
          nccl.allreduce(nullptr, nullptr, 0, DataType::float32, ReduceOp::sum, {}, d);
        }).ok());
  CHECK(wait_for([&](Callback d) {
          nccl.exchange(nullptr, 4, DataType::float32, {}, {}, {}, {}, d);
        }).ok());
}

TEST_CASE("an NCCL operation starts only after its ready events, not before") {
  if (skip_without_device()) return;
  troupe::cuda::DeviceGuard guard(0);
  NcclCommunicator nccl(0, 1, NcclCommunicator::unique_id(), 0, 30s);
  const size_t n = 4096;
  const Bytes old_values = values(DataType::float32, n, 1),
              new_values = values(DataType::float32, n, 2);
  DeviceBuffer in(old_values), out(old_values.size());
  // The input is rewritten on another stream behind a gate; the event marks the rewrite.
  troupe::test::Stream producer;
  auto* pinned = static_cast<unsigned char*>(troupe::cuda::host_alloc(new_values.size()));
  std::memcpy(pinned, new_values.data(), new_values.size());
  Gate gate;
  gate.close_on(producer.handle());
  troupe::cuda::copy_to_device_async(in.get(), pinned, new_values.size(), producer.handle());
  void* ready = troupe::cuda::create_event();
  troupe::cuda::record_event(ready, producer.handle());

  auto promise = std::make_shared<std::promise<Status>>();
  auto future = promise->get_future();
  nccl.allreduce(in.get(), out.get(), n, DataType::float32, ReduceOp::sum, {ready},
                 [promise](const Status& s) { promise->set_value(s); });
  CHECK(future.wait_for(200ms) == std::future_status::timeout);  // still behind the gate
  gate.open = true;
  REQUIRE(future.wait_for(30s) == std::future_status::ready);
  CHECK(future.get().ok());
  check_same(DataType::float32, out.download(), new_values, false, "allreduce after its event");
  producer.synchronize();
  troupe::cuda::destroy_event(ready);
  troupe::cuda::host_free(pinned);
}

TEST_CASE(
    "an NCCL communicator that not every rank joins fails at its deadline, naming rank, world and "
    "timeout") {
  if (skip_without_device()) return;
  troupe::cuda::DeviceGuard guard(0);
  const auto start = std::chrono::steady_clock::now();
  try {
    NcclCommunicator lonely(0, 2, NcclCommunicator::unique_id(), 0, 500ms);  // rank 1 never comes
    FAIL("a communicator of 2 ranks was created by one");
  } catch (const troupe::comm::Error& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("rank 0 of 2 on device 0") != std::string::npos);
    CHECK(what.find("within 500 ms") != std::string::npos);
  }
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(waited >= 500ms);
  CHECK(waited < 20s);
}

TEST_CASE(
    "an NCCL operation that a peer never issues fails at its deadline and aborts the "
    "communicator") {
  if (skip_without_device()) return;
  if (troupe::cuda::device_count() < 2) {
    // With one GPU the pending operation could only be held by a stream that never runs, and
    // aborting a communicator whose kernel is still queued is not something NCCL supports.
    troupe::test::skip_case("one CUDA device: the operation deadline needs two ranks; skipping");
    return;
  }
  const std::string id = NcclCommunicator::unique_id();
  std::promise<void> rank0_done;
  auto shared_done = rank0_done.get_future().share();
  auto silent = std::async(std::launch::async, [&] {
    troupe::cuda::DeviceGuard guard(1);
    NcclCommunicator nccl(1, 2, id, 1, 30s);
    shared_done.wait_for(30s);  // issues nothing meanwhile
    nccl.abort("test over");
  });
  {
    troupe::cuda::DeviceGuard guard(0);
    NcclCommunicator nccl(0, 2, id, 0, 30s);
    nccl.set_timeout(500ms);
    DeviceBuffer data(values(DataType::float32, 256, 1));
    const auto start = std::chrono::steady_clock::now();
    const Status s = wait_for([&](Callback d) {
      nccl.allreduce(data.get(), data.get(), 256, DataType::float32, ReduceOp::sum, {}, d);
    });
    CHECK_FALSE(s.ok());
    CHECK(s.message().find("allreduce of 256 float32") != std::string::npos);
    CHECK(s.message().find("within 500 ms") != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - start >= 500ms);
    CHECK(nccl.aborted());
    const Status later =
        wait_for([&](Callback d) { nccl.broadcast(data.get(), 256, DataType::float32, 0, {}, d); });
    CHECK_FALSE(later.ok());
    CHECK(later.message().find("was aborted") != std::string::npos);
    rank0_done.set_value();
  }
  silent.get();
}

TEST_CASE(
    "abort fails later NCCL operations at once with the reason, and split gives a working "
    "communicator") {
  if (skip_without_device()) return;
  troupe::cuda::DeviceGuard guard(0);
  NcclCommunicator nccl(0, 1, NcclCommunicator::unique_id(), 0, 30s);
  auto child = nccl.split(30s);
  REQUIRE(child);
  CHECK(child->stream() != nccl.stream());
  const Bytes in = values(DataType::float32, 100, 3);
  DeviceBuffer data(in);
  REQUIRE(wait_for([&](Callback d) {
            child->allreduce(data.get(), data.get(), 100, DataType::float32, ReduceOp::max, {}, d);
          }).ok());
  check_same(DataType::float32, data.download(), in, false, "allreduce on the split communicator");

  nccl.abort("rank 7 died (test)");
  const Status s = wait_for([&](Callback d) {
    nccl.allreduce(data.get(), data.get(), 100, DataType::float32, ReduceOp::sum, {}, d);
  });
  CHECK_FALSE(s.ok());
  CHECK(s.message().find("rank 7 died (test)") != std::string::npos);
  CHECK(nccl.aborted());
  CHECK_FALSE(child->aborted());  // a communicator of its own
}

TEST_CASE(
    "bad NCCL operation arguments are refused at the call, naming the argument and the value") {
  if (skip_without_device()) return;
  troupe::cuda::DeviceGuard guard(0);
  NcclCommunicator nccl(0, 1, NcclCommunicator::unique_id(), 0, 30s);
  DeviceBuffer buffer(1024);
  std::vector<float> host(256);
  auto never = [](const Status&) { FAIL("a refused operation called back"); };
  using troupe::comm::Error;
  CHECK_THROWS_WITH_AS(
      nccl.allreduce(nullptr, buffer.get(), 8, DataType::float32, ReduceOp::sum, {}, never),
      doctest::Contains("input is null with 8 elements"), Error);
  CHECK_THROWS_WITH_AS(
      nccl.allreduce(host.data(), buffer.get(), 8, DataType::float32, ReduceOp::sum, {}, never),
      doctest::Contains("is host memory (expected device memory of device 0"), Error);
  CHECK_THROWS_WITH_AS(nccl.broadcast(buffer.get(), 8, DataType::float32, 1, {}, never),
                       doctest::Contains("root 1 (expected 0 <= root < 1)"), Error);
  CHECK_THROWS_WITH_AS(nccl.allreduce(buffer.get(), buffer.get(), 8, static_cast<DataType>(42),
                                      ReduceOp::sum, {}, never),
                       doctest::Contains("data type 42"), Error);
  CHECK_THROWS_WITH_AS(nccl.allreduce(buffer.get(), buffer.get(), 8, DataType::float32,
                                      static_cast<ReduceOp>(9), {}, never),
                       doctest::Contains("reduce op 9"), Error);
  CHECK_THROWS_WITH_AS(
      nccl.allreduce_scaled(buffer.get(), buffer.get(), 8, DataType::int32, 0.5, {}, never),
      doctest::Contains("needs a float type (got int32)"), Error);
  CHECK_THROWS_WITH_AS(nccl.allreduce(buffer.get(), buffer.get(), 8, DataType::float32,
                                      ReduceOp::sum, {nullptr}, never),
                       doctest::Contains("ready event 0 is null"), Error);
  CHECK_THROWS_WITH_AS(nccl.exchange(buffer.get(), 8, DataType::float32, {0}, {}, {}, {}, never),
                       doctest::Contains("send_to peer 0 is this rank"), Error);
  CHECK_THROWS_WITH_AS(
      nccl.exchange(buffer.get(), 8, DataType::float32, {}, {3}, {buffer.get()}, {}, never),
      doctest::Contains("recv_from peer 3 (expected 0 <= recv_from peer < 1)"), Error);
  CHECK_THROWS_WITH_AS(
      nccl.exchange(buffer.get(), 8, DataType::float32, {}, {}, {buffer.get()}, {}, never),
      doctest::Contains("1 receive buffers for 0 peers"), Error);
}

TEST_CASE("NCCL collectives over several ranks, one GPU each, match the CPU reference") {
  if (skip_without_device()) return;
  const int devices = troupe::cuda::device_count();
  if (devices < 2) {
    troupe::test::skip_case(
        "one CUDA device: NCCL does not run two ranks of a communicator on one GPU; skipping "
        "the multi-rank case");
    return;
  }
  const int world = std::min(devices, 4);
  const std::string id = NcclCommunicator::unique_id();
  const size_t n = 5003;  // not a multiple of anything
  const DataType types[] = {DataType::float32, DataType::bfloat16, DataType::int64};
  std::vector<std::vector<Bytes>> inputs(3);
  for (int t = 0; t < 3; ++t)
    for (int r = 0; r < world; ++r) inputs[t].push_back(values(types[t], n * world, r + 1));
  std::vector<std::future<void>> ranks;
  for (int rank = 0; rank < world; ++rank)
    ranks.push_back(std::async(std::launch::async, [&, rank] {
      troupe::cuda::DeviceGuard guard(rank);
      NcclCommunicator nccl(rank, world, id, rank, 60s);
      for (int t = 0; t < 3; ++t) {
        const DataType type = types[t];
        const size_t es = troupe::comm::element_size(type);
        const Bytes& mine = inputs[t][rank];
        CAPTURE(troupe::comm::to_string(type));
        for (ReduceOp op : kOps) {
          DeviceBuffer data(mine);
          REQUIRE(wait_for([&](Callback d) {
                    nccl.allreduce(data.get(), data.get(), n * world, type, op, {}, d);
                  }).ok());
          check_same(type, data.download(), reference(type, op, inputs[t]), op == ReduceOp::avg,
                     "allreduce " + std::string(troupe::comm::to_string(op)));
        }
        DeviceBuffer data(mine), out(mine.size());
        REQUIRE(wait_for([&](Callback d) {
                  nccl.broadcast(data.get(), n, type, world - 1, {}, d);
                }).ok());
        check_same(type, first(data.download(), n * es), first(inputs[t][world - 1], n * es), false,
                   "broadcast");
        data.upload(mine);
        REQUIRE(wait_for([&](Callback d) {
                  nccl.allgather(data.get(), out.get(), n, type, {}, d);
                }).ok());
        Bytes gathered;
        for (int r = 0; r < world; ++r)
          gathered.insert(gathered.end(), inputs[t][r].begin(), inputs[t][r].begin() + n * es);
        check_same(type, out.download(), gathered, false, "allgather");
        REQUIRE(wait_for([&](Callback d) {
                  nccl.reduce_scatter(data.get(), out.get(), n, type, ReduceOp::sum, {}, d);
                }).ok());
        const Bytes sum = reference(type, ReduceOp::sum, inputs[t]);
        check_same(type, first(out.download(), n * es),
                   Bytes(sum.begin() + rank * n * es, sum.begin() + (rank + 1) * n * es), false,
                   "reduce_scatter");
        REQUIRE(wait_for([&](Callback d) {
                  nccl.alltoall(data.get(), out.get(), n, type, {}, d);
                }).ok());
        Bytes exchanged;
        for (int r = 0; r < world; ++r)
          exchanged.insert(exchanged.end(), inputs[t][r].begin() + rank * n * es,
                           inputs[t][r].begin() + (rank + 1) * n * es);
        check_same(type, out.download(), exchanged, false, "alltoall");
        // A gossip round on the ring: send to the next rank, receive from the previous one.
        const int next = (rank + 1) % world, previous = (rank + world - 1) % world;
        REQUIRE(wait_for([&](Callback d) {
                  nccl.exchange(data.get(), n, type, {next}, {previous}, {out.get()}, {}, d);
                }).ok());
        check_same(type, first(out.download(), n * es), first(inputs[t][previous], n * es), false,
                   "exchange");
      }
    }));
  for (auto& r : ranks) r.get();
}

#endif  // TROUPE_HAVE_CUDA && TROUPE_HAVE_NCCL
