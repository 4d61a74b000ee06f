// ByteGrad (Bagua, 8-bit min-max codes) and Int4Quantization (4-bit min-max codes with fp32
// sums), comm/codecs/minmax.h: one scatter-gather reduction over the min-max codec of either
// width, so that every element crosses the wire twice as a code whatever the world size (an
// allgather of every rank's codes would send (W - 1) codes per element instead):
//   stage 1: quantise the world-size chunks of the bucket, alltoall (rank j gets everyone's chunk
//   j) stage 2: dequantise and sum the chunks received in fp32, scale, re-quantise, allgather end:
//   dequantise every chunk into the bucket
// Every rank, its own chunk included, decodes the same bytes, so the buckets agree bit for bit.
#include <utility>
#include <vector>

#include "comm/codecs/minmax.h"
#include "comm/compression/reductions.h"

namespace troupe::comm {

namespace {

class QuantizedScatterGather final : public Reduction {
 public:
  QuantizedScatterGather(std::string name, MinMaxBits bits, size_t block,
                         const BucketBuffer& bucket)
      : name_(std::move(name)), bits_(bits), block_(block), bucket_(bucket) {}
  std::string name() const override { return name_; }

  std::vector<std::function<Schedule()>> stages(const ReduceStep& step) override {
    const int world = step.group.world_size;
    const size_t largest =
        (bucket_.count + static_cast<size_t>(world) - 1) / static_cast<size_t>(world);
    // Every chunk's encoding gets the same slot, in whole int32 words (the collectives' unit).
    stride_words_ = (minmax_bytes(bits_, largest, block_) + 3) / 4;
    const size_t slot = stride_words_ * 4;
    // Sized once (the world does not change between steps); every slot is rewritten each step.
    send_.resize(slot * static_cast<size_t>(world));
    received_.resize(slot * static_cast<size_t>(world));
    gathered_.resize(slot * static_cast<size_t>(world));
    auto* data = static_cast<float*>(bucket_.data);
    return {
        [this, step, data, slot] {
          zero_padding(bucket_);
          for (int j = 0; j < step.group.world_size; ++j) {
            const Range r = block_range(bucket_.count, step.group.world_size, j);
            minmax_encode(bits_, data + r.begin, r.size(), block_,
                          send_.data() + slot * static_cast<size_t>(j));
          }
          return alltoall_schedule(step.group, send_.data(), received_.data(), stride_words_,
                                   DataType::int32);
        },
        [this, step, data, slot] {
          const int me = step.group.rank;
          const Range mine = block_range(bucket_.count, step.group.world_size, me);
          sum_.assign(mine.size(), 0.0f);
          for (int j = 0; j < step.group.world_size; ++j)
            minmax_decode_add(bits_, received_.data() + slot * static_cast<size_t>(j), mine.size(),
                              block_, sum_.data());
          const auto factor = static_cast<float>(step.scale);
          if (factor != 1.0f)
            for (float& v : sum_) v *= factor;
          uint8_t* own = gathered_.data() + slot * static_cast<size_t>(me);
          minmax_encode(bits_, sum_.data(), sum_.size(), block_, own);
          auto schedule = allgather_schedule(step.group, own, gathered_.data(), stride_words_,
                                             DataType::int32, step.collectives);
          schedule.finally = [this, step, data, slot] {
            for (int j = 0; j < step.group.world_size; ++j) {
              const Range r = block_range(bucket_.count, step.group.world_size, j);
              minmax_decode(bits_, gathered_.data() + slot * static_cast<size_t>(j), r.size(),
                            block_, data + r.begin);
            }
          };
          return schedule;
        },
    };
  }

 private:
  std::string name_;
  MinMaxBits bits_;  // the codes' width: the codec is chosen once per chunk, not per element
  size_t block_;
  BucketBuffer bucket_;
  size_t stride_words_ = 0;
  std::vector<uint8_t> send_, received_, gathered_;
  std::vector<float> sum_;
};

}  // namespace

std::shared_ptr<Reduction> make_byte_grad_reduction(const ByteGrad& config,
                                                    const BucketBuffer& bucket) {
  return std::make_shared<QuantizedScatterGather>("bytegrad", MinMaxBits::eight, config.block,
                                                  bucket);
}

std::shared_ptr<Reduction> make_int4_reduction(const Int4Quantization& config,
                                               const BucketBuffer& bucket) {
  return std::make_shared<QuantizedScatterGather>("int4", MinMaxBits::four, config.block, bucket);
}

}  // namespace troupe::comm
