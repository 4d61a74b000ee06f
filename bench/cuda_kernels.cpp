// Throughput of the CUDA kernels of cuda/ (reduce.h, codecs.h) against the copy bandwidth the
// same device reaches in the same run (cudaMemcpyAsync device to device).
//
//   build/bin/bench_cuda_kernels [--elements N] [--repeats R]
//
// Each kernel runs on N float32 elements (default 64 Mi, 256 MiB), R times (default 20) after 3
// warm-up runs, timed with CUDA events; the table gives the median time, the bytes the kernel must
// read and write at the least (its traffic), traffic / time, and that as a share of the copy's
// traffic / time (the goal: >= 70% for the streaming kernels). top_k, gather and
// scatter_add are not streaming kernels (selection passes, random access); their share is printed
// for the record. Where LibTorch has CUDA, at::topk on the same |x| and stream is timed beside
// top_k (the goal: top_k at least as fast).
#include <cuda_runtime.h>

#ifdef TROUPE_HAVE_C10_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/codecs.h"
#include "cuda/reduce.h"

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

template <typename T>
T* device_array(size_t n) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  return static_cast<T*>(p);
}

struct Timer {
  cudaEvent_t start{}, stop{};
  Timer() {
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  // Median milliseconds of `repeats` runs of `body` on `stream`, after three warm-up runs.
  double median_ms(const std::function<void()>& body, cudaStream_t stream, int repeats) {
    for (int i = 0; i < 3; ++i) body();
    check(cudaStreamSynchronize(stream), "warm-up");
    std::vector<float> ms;
    for (int i = 0; i < repeats; ++i) {
      check(cudaEventRecord(start, stream), "cudaEventRecord");
      body();
      check(cudaEventRecord(stop, stream), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float t = 0;
      check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }
};

struct Row {
  std::string kernel;
  double ms;
  double bytes;
  bool streaming;
};

}  // namespace

int main(int argc, char** argv) {
  size_t n = size_t{64} << 20;
  int repeats = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--elements")
      n = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--repeats")
      repeats = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "bench_cuda_kernels: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (n < 1024 || repeats < 1) {
    std::fprintf(stderr,
                 "bench_cuda_kernels: --elements %zu --repeats %d (expected >= 1024, >= 1)\n", n,
                 repeats);
    return 2;
  }
  try {
    if (!troupe::cuda::device_available()) {
      std::fprintf(stderr, "bench_cuda_kernels: no usable CUDA device\n");
      return 1;
    }
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    cudaStream_t stream{};
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    void* s = stream;

    std::vector<float> host(n);
    std::mt19937 gen(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& v : host) v = normal(gen);
    float* a = device_array<float>(n);
    float* b = device_array<float>(n);
    float* c = device_array<float>(n);
    uint16_t* half = device_array<uint16_t>(n);
    const size_t block = 1024;
    // Sized for 8-bit codes, which 4-bit ones fit in.
    uint8_t* codes = device_array<uint8_t>(
        troupe::cuda::minmax_bytes(troupe::cuda::MinMaxBits::eight, n, block));
    uint8_t* bits = device_array<uint8_t>(troupe::cuda::sign_bytes(n));
    float* scalar = device_array<float>(1);
    const size_t k = n / 100;
    uint32_t* indices = device_array<uint32_t>(k);
    float* values = device_array<float>(k);
    check(cudaMemcpy(a, host.data(), n * 4, cudaMemcpyHostToDevice), "upload");
    check(cudaMemcpy(b, host.data(), n * 4, cudaMemcpyHostToDevice), "upload");
    // Spread indices for gather / scatter_add: every 100th element.
    std::vector<uint32_t> spread(k);
    for (size_t j = 0; j < k; ++j) spread[j] = static_cast<uint32_t>(j * 100);
    check(cudaMemcpy(indices, spread.data(), k * 4, cudaMemcpyHostToDevice), "upload");
    // The uploads from pageable memory may still be landing on the legacy stream, which the
    // kernels' non-blocking stream does not wait for.
    check(cudaDeviceSynchronize(), "upload");
    // 100 tensors of equal size for flatten / unflatten (they live in c, the flat buffer is b).
    std::vector<troupe::cuda::TensorSpan> spans;
    const size_t per = n / 100;
    for (size_t t = 0; t < 100; ++t) spans.push_back({c + t * per, per, t * per});

    namespace tc = troupe::cuda;
    const double f = 4.0 * static_cast<double>(n);  // bytes of n floats
    Timer timer;
    std::vector<Row> rows;
    auto add = [&](const std::string& name, double bytes, bool streaming,
                   const std::function<void()>& body) {
      rows.push_back({name, timer.median_ms(body, stream, repeats), bytes, streaming});
    };
    add("copy (cudaMemcpyAsync)", 2 * f, true, [&] {
      check(cudaMemcpyAsync(c, a, n * 4, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
    });
    add("reduce float32 sum", 3 * f, true,
        [&] { tc::reduce(c, a, b, n, tc::DType::float32, tc::Op::sum, s); });
    add("divide float32", 2 * f, true, [&] { tc::divide(c, n, tc::DType::float32, 4, s); });
    add("encode_half", 1.5 * f, true, [&] { tc::encode_half(a, n, 0.25f, half, s); });
    add("decode_half", 1.5 * f, true, [&] { tc::decode_half(half, n, 4.0f, c, s); });
    add("reduce float16 sum", 1.5 * f, true,
        [&] { tc::reduce(half, half, half, n, tc::DType::float16, tc::Op::sum, s); });
    add("encode_bfloat16", 1.5 * f, true, [&] { tc::encode_bfloat16(a, n, 0.25f, half, s); });
    add("decode_bfloat16", 1.5 * f, true, [&] { tc::decode_bfloat16(half, n, 4.0f, c, s); });
    // Min-max traffic: the floats, plus a byte (8 bits) or half a byte (4 bits) per element.
    for (const auto bits : {tc::MinMaxBits::eight, tc::MinMaxBits::four}) {
      const double code = bits == tc::MinMaxBits::eight ? f / 4 : f / 8;
      const std::string width = bits == tc::MinMaxBits::eight ? " (8 bits)" : " (4 bits)";
      add("minmax_encode" + width, f + code, true,
          [&, bits] { tc::minmax_encode(bits, a, n, block, codes, s); });
      add("minmax_decode" + width, f + code, true,
          [&, bits] { tc::minmax_decode(bits, codes, n, block, c, s); });
      add("minmax_decode_add" + width, 2 * f + code, true,
          [&, bits] { tc::minmax_decode_add(bits, codes, n, block, c, s); });
    }
    add("sign_pack", f + f / 32, true, [&] { tc::sign_pack(a, n, bits, s); });
    add("sign_unpack", f + f / 32, true, [&] { tc::sign_unpack(bits, n, 0.5f, c, s); });
    add("sign_unpack_add", 2 * f + f / 32, true, [&] { tc::sign_unpack_add(bits, n, 0.5f, c, s); });
    add("mean_abs", f, true, [&] { tc::mean_abs(a, n, scalar, s); });
    add("sign_error_feedback", 2 * f, true, [&] { tc::sign_error_feedback(a, n, 0.5f, c, s); });
    add("sparse_error_feedback (k = 1%)", 2 * f, true,
        [&] { tc::sparse_error_feedback(a, n, indices, k, c, s); });
    add("flatten (100 tensors)", 2 * f, true,
        [&] { tc::flatten(spans.data(), spans.size(), 4, b, n, s); });
    add("unflatten (100 tensors)", 2 * f, true,
        [&] { tc::unflatten(b, n, spans.data(), spans.size(), 4, s); });
    add("top_k (k = 1%)", f, false, [&] { tc::top_k(a, n, k, indices, s); });
#ifdef TROUPE_HAVE_C10_CUDA
    {
      // |x| computed once, outside the timing (top_k ranks by |x| as it reads x); values and
      // indices, unsorted, on the same stream.
      c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream, 0));
      const auto x = at::from_blob(a, {static_cast<int64_t>(n)},
                                   at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0))
                         .abs();
      add("at::topk on |x| (k = 1%, LibTorch)", f, false,
          [&] { at::topk(x, static_cast<int64_t>(k), 0, /*largest=*/true, /*sorted=*/false); });
    }
#endif
    add("gather (k = 1%)", 3.0 * 4 * static_cast<double>(k), false,
        [&] { tc::gather(a, indices, k, values, s); });
    add("scatter_add (k = 1%)", 4.0 * 4 * static_cast<double>(k), false,
        [&] { tc::scatter_add(indices, values, k, 0.5f, c, s); });

    const double copy_gbs = rows[0].bytes / (rows[0].ms * 1e6);
    std::printf("device: %s; %zu float32 elements; median of %d runs\n\n", prop.name, n, repeats);
    std::printf("| kernel | time (ms) | traffic (MB) | GB/s | share of copy |\n");
    std::printf("|---|---:|---:|---:|---:|\n");
    for (const auto& r : rows) {
      const double gbs = r.bytes / (r.ms * 1e6);
      std::printf("| %s | %.3f | %.1f | %.0f | %.0f%%%s |\n", r.kernel.c_str(), r.ms, r.bytes / 1e6,
                  gbs, 100.0 * gbs / copy_gbs, r.streaming ? "" : " (not streaming)");
    }
    for (void* p :
         {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(c),
          static_cast<void*>(half), static_cast<void*>(codes), static_cast<void*>(bits),
          static_cast<void*>(scalar), static_cast<void*>(indices), static_cast<void*>(values)})
      cudaFree(p);
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_kernels: %s\n", e.what());
    return 1;
  }
  return 0;
}
