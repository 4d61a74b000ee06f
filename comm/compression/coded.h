#pragma once
/// The exchanges of compressed reductions whose encoding and decoding run elsewhere: on the GPU,
/// in ddp's staging path that compresses on the device (ddp/gradient_path/device_codecs.h). The
/// device writes its messages in the layouts below with cuda/codecs.h's kernels (byte for byte
/// comm/codecs/' encodings), only those bytes are copied to host memory, and the reductions made
/// here run the algorithm's collectives (and any host arithmetic between them) on them, exactly
/// as the algorithm's own reduction does (the CPU reductions are these same exchanges with the
/// CPU codecs around them). The result is copied back and decoded on the device.
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/codecs/minmax.h"
#include "comm/compression/algorithms.h"

namespace troupe::comm {

/// Sign compression's message for one bucket: one float32 scale per tensor (the tensor's mean
/// |x|, or 1 with majority vote), then each tensor's sign bits (comm/codecs/sign.h) from a byte
/// boundary, the whole padded to int32 words (the collectives' unit).
struct SignMessage {
  std::vector<size_t> bits_at;  // byte offset of tensor t's bits
  size_t bytes = 0;             // a multiple of 4
  explicit SignMessage(const BucketBuffer& bucket);
};

/// The exchange of SignCompression among `world_size` ranks: `messages` (world_size x
/// SignMessage(bucket).bytes, in memory the caller keeps) holds this rank's message at rank x bytes
/// when the stages start, and every rank's, in rank order, when they end (an allgather in place).
/// Decoding is the caller's: the bucket's tensor t is then the sum over ranks r of (r's scale t,
/// times ReduceStep::scale unless majority vote) x (r's signs of t), in rank order, and sign() of
/// that sum with majority vote.
std::shared_ptr<Reduction> make_sign_exchange(const SignCompression& config,
                                              const BucketBuffer& bucket, int world_size,
                                              void* messages);

/// ByteGrad's and Int4Quantization's codes: the bucket is split into world-size chunks
/// (block_range), and each chunk's min-max encoding gets a slot of this many bytes (a multiple of
/// 4), the largest chunk's.
size_t minmax_slot_bytes(MinMaxBits bits, size_t block, size_t count, int world_size);

/// The elements of `bucket` outside every tensor (alignment padding), as ranges in order: what
/// is zeroed before a min-max encoding, so that no stale value there joins a block's min or max.
std::vector<Range> padding_of(const BucketBuffer& bucket);

/// The codes of ByteGrad (8-bit) and Int4Quantization (4-bit).
struct MinMaxCodes {
  MinMaxBits bits = MinMaxBits::eight;
  size_t block = 0;
};
/// `algorithm`'s codes when it is ByteGrad or Int4Quantization, else nullopt.
std::optional<MinMaxCodes> minmax_codes(const Compression& algorithm);

/// The exchange of ByteGrad's or Int4Quantization's `codes` among `world_size` ranks: `send`
/// (world slots)
/// holds this rank's encoding of chunk j in slot j when the stages start (the bucket's padding
/// zeroed first); the stages alltoall them, decode and sum this rank's chunk in float32, multiply
/// it by ReduceStep::scale, re-encode it and allgather, so that `gathered` (world slots) holds
/// chunk j's encoded sum in slot j when they end, every rank the same bytes. Decoding slot j
/// into chunk j is the caller's. Both buffers are the caller's and stay alive.
std::shared_ptr<Reduction> make_minmax_exchange(MinMaxCodes codes, const BucketBuffer& bucket,
                                                int world_size, void* send, void* gathered);

/// Top-k sparsification's k for a bucket of `count` elements: max(1, ratio x count), or `count`,
/// at most count.
size_t sparse_k(const Sparsification& config, size_t count);

/// The exchange of Sparsification in top_k mode (another mode throws comm::Error): `records`
/// (world_size x 2 sparse_k words, in memory the caller keeps) holds this rank's record at
/// rank x 2k words when the stages start: its k indices (uint32, ascending, as comm::top_k
/// gives them), then their k values (float32; with error feedback and momentum correction
/// applied before the selection, the padding zeroed). When they end it holds every rank's, in
/// rank order. Decoding is the caller's: the bucket is zero, then each rank's values times
/// ReduceStep::scale are scatter-added, rank after rank.
std::shared_ptr<Reduction> make_top_k_exchange(const Sparsification& config,
                                               const BucketBuffer& bucket, int world_size,
                                               void* records);

/// PowerSGD's split of a bucket, as its reduction makes it: the tensors it compresses (a rows x
/// cols matrix of rank r each: its P, rows x r, at p_at of the P buffer, and its Q^T, r x cols,
/// at q_at of the Q buffer) and those it allreduces as they are (after every P, at `at`).
/// PowerSGD's exchange is two float32 sums (the P buffer, then the Q buffer) and, before
/// start_iter, an allreduce of the whole bucket: ddp's device codec runs them itself.
struct PowerSgdLayout {
  struct Matrix {
    size_t tensor = 0;
    size_t rows = 0, cols = 0, r = 0;
    size_t p_at = 0, q_at = 0;
  };
  struct Plain {
    size_t tensor = 0;
    size_t at = 0;
  };
  std::vector<Matrix> matrices;
  std::vector<Plain> plain;
  size_t p_count = 0, q_count = 0;  // floats in the P and Q buffers
  PowerSgdLayout(const PowerSGD& config, const BucketBuffer& bucket);
};

/// The Q^T (m.r x m.cols floats into `qt`) that matrix `m` starts step `step` from, the same on
/// every rank: with warm start the first step's (later steps keep the last one's), else a fresh
/// draw per step.
void power_sgd_qt(const PowerSGD& config, const BucketBuffer& bucket,
                  const PowerSgdLayout::Matrix& m, uint32_t step, float* qt);

/// Every exchange's stages throw comm::Error when run in a world of another size than it was
/// made for (its buffers were sized for that one).

}  // namespace troupe::comm
