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
// reduction gives the same gradients, and a checkpoint moves between a CPU and a GPU run.
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
#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/compression/algorithms.h"
#include "ddp/staging.h"

namespace troupe {

class DeviceCodec : public std::enable_shared_from_this<DeviceCodec> {
 public:
  virtual ~DeviceCodec() = default;

  /// The codes in device memory; the exchange runs on a host mirror of the same layout.
  void* area() const { return area_.data_ptr(); }
  size_t area_bytes() const { return static_cast<size_t>(area_.nbytes()); }
  /// The parts of the area copied to the host before the exchange and back after it.
  actors::HostStaging::Span sent() const { return sent_; }
  actors::HostStaging::Span gathered() const { return gathered_; }

  /// Enqueues on `stream` the encoding of the bucket for a step whose sum is divided by
  /// `denominator` (the gradients are ready: the stream waited on their events).
  virtual void encode(void* stream, double denominator) = 0;
  /// Enqueues on `stream`, after the gathered codes were copied back, their decoding into the
  /// bucket.
  virtual void decode(void* stream, double denominator) = 0;
  /// The denominator the exchange runs with: 1 where the encoding divided already.
  virtual double exchange_denominator(double denominator) const { return denominator; }

  /// The bucket's comm::Reduction for the host: the exchange over `host` (the area's mirror,
  /// `host_buffer` the bucket as the transport path sees it), whose state (for checkpoints) is the
  /// codec's own on the device.
  std::shared_ptr<comm::Reduction> host_reduction(const comm::BucketBuffer& host_buffer,
                                                  void* host);

 protected:
  DeviceCodec(std::string name, bool flat) : name_(std::move(name)), flat_(flat) {}
  virtual std::shared_ptr<comm::Reduction> exchange(const comm::BucketBuffer& host_buffer,
                                                    void* host) = 0;
  /// The state across steps, in the format of the algorithm's CPU reduction; none by default.
  virtual void save_state(comm::StateWriter& out) const { (void)out; }
  virtual void load_state(comm::StateReader& in) { (void)in; }

  torch::Tensor area_;  // uint8, on the bucket's device
  actors::HostStaging::Span sent_, gathered_;

 private:
  friend class CodecReduction;
  std::string name_;  // the algorithm's reduction's name: "fp16", "sign", "bytegrad", ...
  bool flat_;         // the exchange runs over every rank at once, never by host
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
