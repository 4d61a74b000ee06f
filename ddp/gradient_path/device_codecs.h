#pragma once
// Compression on the device, for the host-staging path (host_staging.cpp). Built with CUDA only.
//
// One DeviceCodec per bucket. On the staging copy stream, after the gradients' ready events, it
// encodes the float32 bucket into codes in device memory of its own (its area) with cuda/codecs.h's
// kernels; only the part of the area that this rank sends is copied to pinned host memory; there
// the exchange (comm/compression/coded.h) runs the algorithm's collectives on the codes (and, for
// min-max, the host arithmetic between them, on the rank's 1/W share of codes); the part the
// exchange gathered is copied back and decoded into the bucket on the device. The kernels are
// byte for byte comm/codecs' encodings and the exchange is the algorithm's own CPU reduction
// without its encoding and decoding, so the bucket ends with the bits that the algorithm's CPU
// reduction gives the same gradients (PowerSGD aside: to rounding), and a checkpoint moves
// between a CPU and a GPU run.
//
//   fp16 / bf16   area: the bucket's half-precision image; x / denominator is cast on encode,
//                 the host sums the images (flat allreduce, float16/bfloat16), decode casts back
//   sign          area: every rank's message (per-tensor scale, then bits); encode adds the
//                 error memory (device), writes the scale (mean |x|) and the bits into this rank's
//                 message and updates the error; the host allgathers in place; decode sums every
//                 rank's message per tensor (sign() of the sum with majority vote)
//   8/4-bit       area: the codes sent (W chunk slots) and the codes gathered (W slots); encode
//   min-max       zeroes the padding and encodes every chunk; the host alltoalls, decodes and sums
//                 its chunk, scales, re-encodes and allgathers; decode writes every chunk
//   top-k         area: every rank's record (k indices, k values); encode zeroes the padding, adds
//                 the error memory, selects (radix select), gathers the values and zeroes the sent
//                 coordinates of the error; the host allgathers in place; decode zeroes the bucket
//                 and scatter-adds every rank's values times 1 / denominator, rank after rank
//                 (without momentum correction: that stages the float32 bucket)
//   PowerSGD      two rounds a step: area: P (and the plain tensors), Q, and a copy of the bucket
//                 for the warm-up's allreduce; round 0 adds the memory and projects (P = M Q) with
//                 torch ops on the copy stream, the host sums P; round 1 orthogonalises P (Gram-
//                 Schmidt in double), writes the plain tensors and back-projects (Q^T = P^T M), the
//                 host sums Q; decode expands P Q^T, updates the memory and keeps Q / W (warm
//                 start). cuBLAS's sums, so the CPU's bits only to rounding.
// A codec of several rounds runs them one after the other: each round's device work, download,
// exchange (its stages keyed after the rounds before it) and upload.
#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/compression/algorithms.h"
#include "ddp/staging.h"

namespace troupe {

/// One round of a step's device work and exchange.
struct CodecRound {
  uint32_t step = 0;       // the training step (PowerSGD's warm-up)
  double denominator = 1;  // the step's sum is divided by it
  int index = 0;           // 0 .. rounds(step) - 1
};

class DeviceCodec : public std::enable_shared_from_this<DeviceCodec> {
 public:
  virtual ~DeviceCodec() = default;

  /// The codes in device memory; the exchange runs on a host mirror of the same layout.
  void* area() const { return area_.data_ptr(); }
  size_t area_bytes() const { return static_cast<size_t>(area_.nbytes()); }

  /// Rounds of device work, download, exchange and upload in step `step`: 1, or PowerSGD's 2
  /// (its P is orthogonalised on the device between two allreduces).
  virtual int rounds(uint32_t step) const {
    (void)step;
    return 1;
  }
  /// The parts of the area copied to the host before a round's exchange and back after it.
  virtual actors::HostStaging::Span sent(const CodecRound& round) const {
    (void)round;
    return sent_;
  }
  virtual actors::HostStaging::Span gathered(const CodecRound& round) const {
    (void)round;
    return gathered_;
  }
  /// Enqueues on `stream` the device work before a round's download: in round 0 the encoding of
  /// the bucket (its gradients are ready: the stream waited on their events); in a later round
  /// the work on what the round before gathered (copied back, completed).
  virtual void encode(void* stream, const CodecRound& round) = 0;
  /// Enqueues on `stream`, after the last round's codes were copied back, their decoding into
  /// the bucket.
  virtual void decode(void* stream, const CodecRound& last) = 0;
  /// The denominator the exchange runs with: 1 where the encoding divided already.
  virtual double exchange_denominator(double denominator) const { return denominator; }

  /// The bucket's comm::Reduction for the host: the exchange over `host` (the area's mirror,
  /// `host_buffer` the bucket as the transport path sees it), whose state (for checkpoints) is the
  /// codec's own on the device. Its stages are those of the round begin_round() named.
  std::shared_ptr<comm::Reduction> host_reduction(const comm::BucketBuffer& host_buffer,
                                                  void* host);
  /// The round whose exchange runs next (the staging path calls this before it runs it).
  void begin_round(int index) { round_ = index; }

 protected:
  DeviceCodec(std::string name, bool flat) : name_(std::move(name)), flat_(flat) {}
  /// The exchange; with several rounds, its stages() give the stages of round *current_round().
  virtual std::shared_ptr<comm::Reduction> exchange(const comm::BucketBuffer& host_buffer,
                                                    void* host) = 0;
  /// Where the round begin_round() named is kept (for an exchange to read when its stages run).
  const int* current_round() const { return &round_; }
  /// The state across steps, in the format of the algorithm's CPU reduction; none by default.
  virtual void save_state(comm::StateWriter& out) const { (void)out; }
  virtual void load_state(comm::StateReader& in) { (void)in; }
  /// The part of it every rank holds equal (PowerSGD's Qs); none by default.
  virtual void save_shared_state(comm::StateWriter& out) const { (void)out; }
  virtual void load_shared_state(comm::StateReader& in) { (void)in; }

  torch::Tensor area_;  // on the bucket's device
  actors::HostStaging::Span sent_, gathered_;

 private:
  friend class CodecReduction;
  std::string name_;  // the algorithm's reduction's name: "fp16", "sign", "bytegrad", ...
  bool flat_;         // the exchange runs over every rank at once, never by host
  int round_ = 0;
};

/// "" when `algorithm` compresses on the device, else why not ("topk has no device codec").
std::string device_codec_support(const comm::Compression& algorithm);

/// The codec of `algorithm` for `bucket` (float32 on a CUDA device; its tensors as the bucket has
/// them), this rank `rank` of `world_size`. Its area is allocated on the bucket's device.
std::shared_ptr<DeviceCodec> make_device_codec(const comm::Compression& algorithm,
                                               const comm::BucketBuffer& bucket,
                                               const torch::Device& device, int rank,
                                               int world_size);

}  // namespace troupe
