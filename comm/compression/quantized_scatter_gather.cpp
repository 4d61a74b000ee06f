// ByteGrad (Bagua, 8-bit min-max codes) and Int4Quantization (4-bit min-max codes with fp32
// sums), comm/codecs/minmax.h: one scatter-gather reduction over the min-max codec of either
// width, so that every element crosses the wire twice as a code whatever the world size (an
// allgather of every rank's codes would send (W - 1) codes per element instead):
//   stage 1: quantise the world-size chunks of the bucket, alltoall (rank j gets everyone's chunk
//   j) stage 2: dequantise and sum the chunks received in fp32, scale, re-quantise, allgather end:
//   dequantise every chunk into the bucket
// Every rank, its own chunk included, decodes the same bytes, so the buckets agree bit for bit.
// The exchange alone (coded.h) leaves the first quantisation and the last dequantisation to its
// caller (the GPU's kernels), with the codes sent and gathered in the caller's memory.
#include <utility>
#include <vector>

#include "comm/codecs/minmax.h"
#include "comm/compression/coded.h"
#include "comm/compression/reductions.h"
#include "comm/status.h"

namespace troupe::comm {

size_t minmax_slot_bytes(MinMaxBits bits, size_t block, size_t count, int world_size) {
  const auto world = static_cast<size_t>(world_size);
  const size_t largest = (count + world - 1) / world;
  return (minmax_bytes(bits, largest, block) + 3) / 4 * 4;
}

std::optional<MinMaxCodes> minmax_codes(const Compression& algorithm) {
  if (const auto* b = std::get_if<ByteGrad>(&algorithm))
    return MinMaxCodes{MinMaxBits::eight, b->block};
  if (const auto* q = std::get_if<Int4Quantization>(&algorithm))
    return MinMaxCodes{MinMaxBits::four, q->block};
  return std::nullopt;
}

namespace {

class QuantizedScatterGather final : public Reduction {
 public:
  // `send` null: the reduction encodes and decodes on the CPU, its codes in its own memory. Else
  // only the exchange, over `send` and `gathered` (for `world_size` ranks).
  QuantizedScatterGather(MinMaxCodes codes, const BucketBuffer& bucket, int world_size = 0,
                         uint8_t* send = nullptr, uint8_t* gathered = nullptr)
      : codes_(codes),
        bucket_(bucket),
        world_size_(world_size),
        external_send_(send),
        external_gathered_(gathered) {}
  std::string name() const override {
    return codes_.bits == MinMaxBits::eight ? "bytegrad" : "int4";
  }

  std::vector<std::function<Schedule()>> stages(const ReduceStep& step) override {
    const int world = step.group.world_size;
    const size_t slot = minmax_slot_bytes(codes_.bits, codes_.block, bucket_.count, world);
    const size_t all = slot * static_cast<size_t>(world);
    uint8_t* send = external_send_;
    uint8_t* gathered = external_gathered_;
    if (send) {
      if (world != world_size_)
        throw Error(name() + " exchange of bucket " + std::to_string(bucket_.index) +
                    ": made for " + std::to_string(world_size_) + " ranks, run among " +
                    std::to_string(world));
    } else {
      // Sized once (the world does not change between steps); every slot is rewritten each step.
      send_.resize(all);
      gathered_.resize(all);
      send = send_.data();
      gathered = gathered_.data();
    }
    received_.resize(all);
    auto* data = static_cast<float*>(bucket_.data);
    const size_t words = slot / 4;
    return {
        [this, step, data, slot, send, words] {
          if (!external_send_) {
            zero_padding(bucket_);
            for (int j = 0; j < step.group.world_size; ++j) {
              const Range r = block_range(bucket_.count, step.group.world_size, j);
              minmax_encode(codes_.bits, data + r.begin, r.size(), codes_.block,
                            send + slot * static_cast<size_t>(j));
            }
          }
          return alltoall_schedule(step.group, send, received_.data(), words, DataType::int32);
        },
        [this, step, data, slot, gathered, words] {
          const int me = step.group.rank;
          const Range mine = block_range(bucket_.count, step.group.world_size, me);
          sum_.assign(mine.size(), 0.0f);
          for (int j = 0; j < step.group.world_size; ++j)
            minmax_decode_add(codes_.bits, received_.data() + slot * static_cast<size_t>(j),
                              mine.size(), codes_.block, sum_.data());
          const auto factor = static_cast<float>(step.scale);
          if (factor != 1.0f)
            for (float& v : sum_) v *= factor;
          uint8_t* own = gathered + slot * static_cast<size_t>(me);
          minmax_encode(codes_.bits, sum_.data(), sum_.size(), codes_.block, own);
          auto schedule = allgather_schedule(step.group, own, gathered, words, DataType::int32,
                                             step.collectives);
          if (!external_send_)
            schedule.finally = [this, step, data, slot, gathered] {
              for (int j = 0; j < step.group.world_size; ++j) {
                const Range r = block_range(bucket_.count, step.group.world_size, j);
                minmax_decode(codes_.bits, gathered + slot * static_cast<size_t>(j), r.size(),
                              codes_.block, data + r.begin);
              }
            };
          return schedule;
        },
    };
  }

 private:
  MinMaxCodes codes_;  // the codes' width: the codec is chosen once per chunk, not per element
  BucketBuffer bucket_;
  int world_size_;
  uint8_t* external_send_;
  uint8_t* external_gathered_;
  std::vector<uint8_t> send_, received_, gathered_;
  std::vector<float> sum_;
};

}  // namespace

std::shared_ptr<Reduction> make_byte_grad_reduction(const ByteGrad& config,
                                                    const BucketBuffer& bucket) {
  return std::make_shared<QuantizedScatterGather>(MinMaxCodes{MinMaxBits::eight, config.block},
                                                  bucket);
}

std::shared_ptr<Reduction> make_int4_reduction(const Int4Quantization& config,
                                               const BucketBuffer& bucket) {
  return std::make_shared<QuantizedScatterGather>(MinMaxCodes{MinMaxBits::four, config.block},
                                                  bucket);
}

std::shared_ptr<Reduction> make_minmax_exchange(MinMaxCodes codes, const BucketBuffer& bucket,
                                                int world_size, void* send, void* gathered) {
  if (!send || !gathered || world_size < 1)
    throw Error("min-max exchange of bucket " + std::to_string(bucket.index) +
                ": needs the memory of the codes sent and gathered and a world of at least one "
                "rank (got " +
                std::to_string(world_size) + ")");
  return std::make_shared<QuantizedScatterGather>(
      codes, bucket, world_size, static_cast<uint8_t*>(send), static_cast<uint8_t*>(gathered));
}

}  // namespace troupe::comm
