#pragma once
/// The communication algorithms a DistributedModule can use for its gradient buckets, with their
/// settings. docs/algorithms.md gives each one's update rule and bytes on the wire.
///
/// Each is a plain struct (aggregate: `troupe::PowerSGD{.rank = 2}`), checked by make_reduction.
/// Compressed algorithms work on float32 gradients, reduce gradients (not weights), and keep their
/// state (error feedback, warm start) per bucket.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <variant>

#include "comm/compression/reduction.h"

namespace troupe::comm {

/// Full-precision allreduce (PyTorch DDP, Horovod).
struct GradientAllReduce {};

/// Gradients cast to float16 (or bfloat16), reduced in that precision, cast back. The scale
/// (1 / world size) is applied before the cast, against overflow. 2x fewer bytes.
struct HalfPrecision {
  bool bfloat16 = false;
};

/// 8-bit min-max quantisation with scatter-gather (Bagua's ByteGrad): each rank quantises the
/// world-size chunks of the bucket, alltoall, each dequantises and reduces its own chunk,
/// re-quantises it, allgather, dequantise. ~4x fewer bytes.
struct ByteGrad {
  /// Elements that share one {min, max} pair.
  size_t block = 4096;
};

/// 4-bit min-max quantisation with fp32 accumulation, in ByteGrad's scatter-gather shape: each
/// rank quantises the world-size chunks of the bucket to 4-bit codes (two per byte, nearest
/// rounding, a {min, max} pair per block), alltoall, each dequantises and sums its own chunk in
/// fp32, re-quantises it, allgather, dequantise. ~8x fewer bytes than float32 (7.8x at block 512).
/// The outer-gradient compressor of Streaming DiLoCo (arXiv 2501.18512).
struct Int4Quantization {
  /// Elements that share one {min, max} pair; even, so that every block starts on a byte.
  size_t block = 512;
};

enum class SignMode {
  scaled,         // sign times the mean |g| of its tensor (EF-SignSGD)
  majority_vote,  // sign of the sum of the ranks' signs (signSGD with majority vote): -1, 0, +1
};

/// One bit per element, packed, exchanged by allgather. 32x fewer bytes per rank sent.
struct SignCompression {
  SignMode mode = SignMode::scaled;
  /// Keep what compression lost and add it to the next step's gradient (scaled mode only).
  bool error_feedback = true;
};

enum class SparseMode {
  top_k,     // each rank's k largest |g|: indices and values, allgather, scatter-add
  random_k,  // the same k random indices on every rank (shared seed): values allreduced
  block,     // the same k contiguous coordinates (wrapping) on every rank: values allreduced
};

/// Sparsification: k coordinates of each bucket per step.
struct Sparsification {
  SparseMode mode = SparseMode::top_k;
  /// k = max(1, ratio * elements) per bucket, unless `count` is set.
  double ratio = 0.01;
  /// k per bucket (capped at its elements); 0 uses `ratio`.
  size_t count = 0;
  bool error_feedback = true;
  /// Seed of random_k / block; every rank must use the same.
  uint64_t seed = 0;
  /// Momentum correction (Deep Gradient Compression) when > 0: momentum is accumulated locally,
  /// before sparsification (u = momentum * u + g, sent from e + u), and the sent coordinates of
  /// u are cleared. The reduced gradient is then already the momentum update: use an optimizer
  /// without momentum. Needs error_feedback; 0 <= momentum < 1.
  double momentum = 0;
};

/// PowerSGD (Vogels et al.): each matrix M ~ P Q^T of rank `rank`; P = M Q allreduced and
/// orthogonalised, Q = M^T P allreduced. 1-D tensors, and matrices that would not shrink by
/// min_compression_rate, are batched and allreduced uncompressed with P.
struct PowerSGD {
  int rank = 2;
  /// Start each step from the previous step's Q instead of a fresh random one.
  bool warm_start = true;
  bool error_feedback = true;
  /// A matrix is compressed only if rows * cols >= rate * (rows + cols) * rank.
  double min_compression_rate = 2.0;
  /// Steps before this one use full allreduce (warm-up).
  uint32_t start_iter = 10;
  /// Seed of the random Q, the same on every rank (torch's global generator is not touched).
  uint64_t seed = 0;
};

using Compression = std::variant<GradientAllReduce, HalfPrecision, ByteGrad, SignCompression,
                                 Sparsification, PowerSGD, Int4Quantization>;

/// Short name of an algorithm and its main setting: "allreduce", "fp16", "powersgd(rank=2)", ...
std::string algorithm_name(const Compression& algorithm);

/// Parses "name" or "name:key=value,key=value" (the CLI's --algorithm). The names and keys are
/// those of comm/compression/settings.h, the table the job file's [algorithm] reads too: allreduce,
/// fp16, bf16, bytegrad, int4, sign, sign-vote, topk, randomk, blockk, powersgd; keys by their
/// struct field names ("ef" is still accepted for error_feedback). Booleans are true/false/1/0.
/// Throws comm::Error naming the algorithm, the key, the value and what is allowed.
Compression parse_compression(const std::string& spec);

/// Throws comm::Error naming the setting, its value and what is allowed.
void validate(const Compression& algorithm);

/// The reduction of one bucket under `algorithm`. Throws comm::Error when the bucket cannot use it
/// (a compressed algorithm on a bucket that is not float32).
std::shared_ptr<Reduction> make_reduction(const Compression& algorithm, const BucketBuffer& bucket);

}  // namespace troupe::comm
