// The device codecs of the host-staging path: see device_codecs.h.
#include "ddp/gradient_path/device_codecs.h"

#include <cstring>
#include <variant>

#include "comm/codecs/sign.h"
#include "comm/compression/coded.h"
#include "comm/status.h"
#include "cuda/codecs.h"
#include "cuda/reduce.h"
#include "cuda/stream.h"

namespace troupe {

// The exchange, with the codec's state on the device.
class CodecReduction final : public comm::Reduction {
 public:
  CodecReduction(std::shared_ptr<DeviceCodec> codec, std::shared_ptr<comm::Reduction> exchange)
      : codec_(std::move(codec)), exchange_(std::move(exchange)) {}
  std::string name() const override { return codec_->name_; }
  std::vector<std::function<comm::Schedule()>> stages(const comm::ReduceStep& step) override {
    if (!codec_->flat_) return exchange_->stages(step);
    comm::ReduceStep flat = step;
    flat.collectives.hosts.clear();
    return exchange_->stages(flat);
  }
  void save_state(comm::StateWriter& out) const override { codec_->save_state(out); }
  void load_state(comm::StateReader& in) override { codec_->load_state(in); }

 private:
  std::shared_ptr<DeviceCodec> codec_;
  std::shared_ptr<comm::Reduction> exchange_;
};

std::shared_ptr<comm::Reduction> DeviceCodec::host_reduction(const comm::BucketBuffer& host_buffer,
                                                             void* host) {
  return std::make_shared<CodecReduction>(shared_from_this(), exchange(host_buffer, host));
}

namespace {

torch::Tensor device_bytes(size_t bytes, const torch::Device& device) {
  return torch::zeros({static_cast<int64_t>(bytes)},
                      torch::TensorOptions().dtype(torch::kUInt8).device(device));
}

// A device float32 tensor's values on the host (none for an undefined one). When a state is
// saved or loaded the last step's device work has completed: its reduction ended after the
// decode, and the encode came before it.
std::vector<float> host_copy(const torch::Tensor& device) {
  if (!device.defined()) return {};
  const auto host = device.to(torch::kCPU);
  return std::vector<float>(host.data_ptr<float>(), host.data_ptr<float>() + host.numel());
}

// The reverse, into `device` (as many elements).
void device_copy(std::vector<float>& host, torch::Tensor& device) {
  if (host.empty()) return;
  device.copy_(torch::from_blob(host.data(), {static_cast<int64_t>(host.size())}, torch::kFloat));
}

// ---- fp16 / bf16 ----------------------------------------------------------------------------

class CastCodec final : public DeviceCodec {
 public:
  CastCodec(const comm::HalfPrecision& config, const comm::BucketBuffer& bucket,
            const torch::Device& device)
      : DeviceCodec(config.bfloat16 ? "bf16" : "fp16", /*flat=*/true),
        bfloat16_(config.bfloat16),
        bucket_(static_cast<float*>(bucket.data)),
        count_(bucket.count) {
    area_ = device_bytes(count_ * sizeof(uint16_t), device);
  }

  void encode(void* stream, double denominator) override {
    // The scale before the cast, against overflow (comm's HalfPrecision).
    const auto scale = static_cast<float>(1.0 / denominator);
    if (bfloat16_)
      cuda::encode_bfloat16(bucket_, count_, scale, image(), stream);
    else
      cuda::encode_half(bucket_, count_, scale, image(), stream);
  }
  void decode(void* stream, double denominator) override {
    (void)denominator;
    if (bfloat16_)
      cuda::decode_bfloat16(image(), count_, 1.0f, bucket_, stream);
    else
      cuda::decode_half(image(), count_, 1.0f, bucket_, stream);
  }
  double exchange_denominator(double denominator) const override {
    (void)denominator;
    return 1.0;
  }

 protected:
  // A plain sum of the images.
  std::shared_ptr<comm::Reduction> exchange(const comm::BucketBuffer& host_buffer,
                                            void* host) override {
    comm::BucketBuffer images = host_buffer;
    images.data = host;
    images.type = bfloat16_ ? comm::DataType::bfloat16 : comm::DataType::float16;
    return comm::make_reduction(comm::GradientAllReduce{}, images);
  }

 private:
  uint16_t* image() const { return static_cast<uint16_t*>(area()); }

  bool bfloat16_;
  float* bucket_;
  size_t count_;
};

// ---- sign -----------------------------------------------------------------------------------

class SignCodec final : public DeviceCodec {
 public:
  SignCodec(const comm::SignCompression& config, const comm::BucketBuffer& bucket,
            const torch::Device& device, int rank, int world_size)
      : DeviceCodec(config.mode == comm::SignMode::scaled ? "sign" : "sign(majority vote)",
                    /*flat=*/false),
        config_(config),
        bucket_(bucket),
        message_(bucket),
        rank_(rank),
        world_size_(world_size) {
    const size_t all = message_.bytes * static_cast<size_t>(world_size);
    // Every scale starts at 1: majority vote never writes its scales (comm's Sign sends 1).
    std::vector<uint8_t> initial(all, 0);
    const float one = 1.0f;
    for (int r = 0; r < world_size; ++r)
      for (size_t i = 0; i < bucket.tensors.size(); ++i)
        std::memcpy(initial.data() + message_.bytes * static_cast<size_t>(r) + i * sizeof(float),
                    &one, sizeof(float));
    area_ = torch::from_blob(initial.data(), {static_cast<int64_t>(all)}, torch::kUInt8).to(device);
    sent_ = {message_.bytes * static_cast<size_t>(rank), message_.bytes};
    gathered_ = {0, all};
    if (config.error_feedback)
      error_ = torch::zeros({static_cast<int64_t>(bucket.count)},
                            torch::TensorOptions().dtype(torch::kFloat).device(device));
  }

  void encode(void* stream, double denominator) override {
    (void)denominator;  // applied on decode, to every rank's scale
    auto* data = static_cast<float*>(bucket_.data);
    uint8_t* mine = bytes() + message_.bytes * static_cast<size_t>(rank_);
    const bool scaled = config_.mode == comm::SignMode::scaled;
    for (size_t i = 0; i < bucket_.tensors.size(); ++i) {
      const auto& t = bucket_.tensors[i];
      float* x = data + t.offset;
      auto* scale = reinterpret_cast<float*>(mine + i * sizeof(float));
      float* e = error_.defined() ? error_.data_ptr<float>() + t.offset : nullptr;
      if (e) cuda::reduce(x, x, e, t.count, cuda::DType::float32, cuda::Op::sum, stream);
      if (scaled) cuda::mean_abs(x, t.count, scale, stream);
      cuda::sign_pack(x, t.count, mine + message_.bits_at[i], stream);
      if (e) cuda::sign_error_feedback(x, t.count, cuda::Scale(scale), e, stream);
    }
  }

  void decode(void* stream, double denominator) override {
    auto* data = static_cast<float*>(bucket_.data);
    const bool vote = config_.mode == comm::SignMode::majority_vote;
    const auto step_scale = static_cast<float>(1.0 / denominator);
    for (size_t i = 0; i < bucket_.tensors.size(); ++i) {
      const auto& t = bucket_.tensors[i];
      float* x = data + t.offset;
      cuda::zero_async(x, t.count * sizeof(float), stream);
      for (int r = 0; r < world_size_; ++r) {
        const uint8_t* from = bytes() + message_.bytes * static_cast<size_t>(r);
        const cuda::Scale s =
            vote
                ? cuda::Scale(1.0f)
                : cuda::Scale(reinterpret_cast<const float*>(from + i * sizeof(float)), step_scale);
        cuda::sign_unpack_add(from + message_.bits_at[i], t.count, s, x, stream);
      }
      if (vote) cuda::sign_in_place(x, t.count, stream);
    }
  }

 protected:
  std::shared_ptr<comm::Reduction> exchange(const comm::BucketBuffer& host_buffer,
                                            void* host) override {
    return comm::make_sign_exchange(config_, host_buffer, world_size_, host);
  }

  // As comm's Sign: the error memory, empty without error feedback. The last step's device work
  // has completed (a reduction ends after its decode, and its encode came before it).
  void save_state(comm::StateWriter& out) const override {
    std::vector<float> error;
    if (error_.defined()) {
      const auto host = error_.to(torch::kCPU);
      error.assign(host.data_ptr<float>(), host.data_ptr<float>() + host.numel());
    }
    out.vector(error);
  }
  void load_state(comm::StateReader& in) override {
    const size_t n = error_.defined() ? static_cast<size_t>(error_.numel()) : 0;
    auto error = in.vector<float>(n, "the error-feedback memory");
    if (n) error_.copy_(torch::from_blob(error.data(), {static_cast<int64_t>(n)}, torch::kFloat));
  }

 private:
  uint8_t* bytes() const { return static_cast<uint8_t*>(area()); }

  comm::SignCompression config_;
  comm::BucketBuffer bucket_;
  comm::SignMessage message_;
  int rank_;
  int world_size_;
  torch::Tensor error_;  // float32 on the device; undefined without error feedback
};

// ---- 8-bit / 4-bit min-max ------------------------------------------------------------------

class MinMaxCodec final : public DeviceCodec {
 public:
  MinMaxCodec(comm::MinMaxCodes codes, const comm::BucketBuffer& bucket,
              const torch::Device& device, int world_size)
      : DeviceCodec(codes.bits == comm::MinMaxBits::eight ? "bytegrad" : "int4",
                    /*flat=*/false),
        codes_(codes),
        bits_(codes.bits == comm::MinMaxBits::eight ? cuda::MinMaxBits::eight
                                                    : cuda::MinMaxBits::four),
        bucket_(bucket),
        padding_(comm::padding_of(bucket)),
        world_size_(world_size),
        slot_(comm::minmax_slot_bytes(codes.bits, codes.block, bucket.count, world_size)) {
    const size_t all = slot_ * static_cast<size_t>(world_size);
    area_ = device_bytes(2 * all, device);
    sent_ = {0, all};
    gathered_ = {all, all};
  }

  void encode(void* stream, double denominator) override {
    (void)denominator;  // applied by the exchange, to this rank's summed chunk
    auto* data = static_cast<float*>(bucket_.data);
    for (const comm::Range& gap : padding_)
      cuda::zero_async(data + gap.begin, gap.size() * sizeof(float), stream);
    for (int j = 0; j < world_size_; ++j) {
      const comm::Range r = comm::block_range(bucket_.count, world_size_, j);
      if (r.size())
        cuda::minmax_encode(bits_, data + r.begin, r.size(), codes_.block, slot(j), stream);
    }
  }

  void decode(void* stream, double denominator) override {
    (void)denominator;
    auto* data = static_cast<float*>(bucket_.data);
    for (int j = 0; j < world_size_; ++j) {
      const comm::Range r = comm::block_range(bucket_.count, world_size_, j);
      if (r.size())
        cuda::minmax_decode(bits_, slot(world_size_ + j), r.size(), codes_.block, data + r.begin,
                            stream);
    }
  }

 protected:
  std::shared_ptr<comm::Reduction> exchange(const comm::BucketBuffer& host_buffer,
                                            void* host) override {
    auto* bytes = static_cast<uint8_t*>(host);
    return comm::make_minmax_exchange(codes_, host_buffer, world_size_, bytes + sent_.offset,
                                      bytes + gathered_.offset);
  }

 private:
  // Slot `j` of the area: chunk j's codes sent for j < W, chunk j - W's gathered sum after.
  uint8_t* slot(int j) const {
    return static_cast<uint8_t*>(area()) + slot_ * static_cast<size_t>(j);
  }

  comm::MinMaxCodes codes_;
  cuda::MinMaxBits bits_;
  comm::BucketBuffer bucket_;
  std::vector<comm::Range> padding_;
  int world_size_;
  size_t slot_;
};

// ---- top-k sparsification --------------------------------------------------------------------

class TopKCodec final : public DeviceCodec {
 public:
  TopKCodec(const comm::Sparsification& config, const comm::BucketBuffer& bucket,
            const torch::Device& device, int rank, int world_size)
      : DeviceCodec("sparse", /*flat=*/false),
        config_(config),
        bucket_(bucket),
        padding_(comm::padding_of(bucket)),
        k_(comm::sparse_k(config, bucket.count)),
        rank_(rank),
        world_size_(world_size) {
    const size_t record = 2 * k_ * sizeof(uint32_t);
    area_ = device_bytes(record * static_cast<size_t>(world_size), device);
    sent_ = {record * static_cast<size_t>(rank), record};
    gathered_ = {0, record * static_cast<size_t>(world_size)};
    if (config.error_feedback)
      error_ = torch::zeros({static_cast<int64_t>(bucket.count)},
                            torch::TensorOptions().dtype(torch::kFloat).device(device));
  }

  void encode(void* stream, double denominator) override {
    (void)denominator;  // applied on decode
    auto* data = static_cast<float*>(bucket_.data);
    const size_t n = bucket_.count;
    for (const comm::Range& gap : padding_)
      cuda::zero_async(data + gap.begin, gap.size() * sizeof(float), stream);
    float* e = error_.defined() ? error_.data_ptr<float>() : nullptr;
    if (e) cuda::reduce(data, data, e, n, cuda::DType::float32, cuda::Op::sum, stream);
    uint32_t* indices = record(rank_);
    cuda::top_k(data, n, k_, indices, stream);
    cuda::gather(data, indices, k_, values(indices), stream);
    if (e) cuda::sparse_error_feedback(data, n, indices, k_, e, stream);
  }

  void decode(void* stream, double denominator) override {
    auto* data = static_cast<float*>(bucket_.data);
    const auto scale = static_cast<float>(1.0 / denominator);
    cuda::zero_async(data, bucket_.count * sizeof(float), stream);
    for (int r = 0; r < world_size_; ++r) {
      const uint32_t* indices = record(r);
      cuda::scatter_add(indices, values(indices), k_, scale, data, stream);
    }
  }

 protected:
  std::shared_ptr<comm::Reduction> exchange(const comm::BucketBuffer& host_buffer,
                                            void* host) override {
    return comm::make_top_k_exchange(config_, host_buffer, world_size_, host);
  }

  // As comm's Sparse: the error memory (empty without error feedback), then the momentum
  // correction's velocity (always empty here: the device codec runs without it).
  void save_state(comm::StateWriter& out) const override {
    out.vector(host_copy(error_));
    out.vector(std::vector<float>());
  }
  void load_state(comm::StateReader& in) override {
    const size_t n = error_.defined() ? static_cast<size_t>(error_.numel()) : 0;
    auto error = in.vector<float>(n, "the error-feedback memory");
    in.vector<float>(0, "the momentum-correction velocity");
    device_copy(error, error_);
  }

 private:
  // Rank r's record: k indices, then k values.
  uint32_t* record(int r) const {
    return static_cast<uint32_t*>(area()) + 2 * k_ * static_cast<size_t>(r);
  }
  float* values(const uint32_t* record) const {
    return reinterpret_cast<float*>(const_cast<uint32_t*>(record) + k_);
  }

  comm::Sparsification config_;
  comm::BucketBuffer bucket_;
  std::vector<comm::Range> padding_;
  size_t k_;
  int rank_;
  int world_size_;
  torch::Tensor error_;  // float32 on the device; undefined without error feedback
};

}  // namespace

std::string device_codec_support(const comm::Compression& algorithm) {
  if (std::holds_alternative<comm::HalfPrecision>(algorithm) ||
      std::holds_alternative<comm::SignCompression>(algorithm) || comm::minmax_codes(algorithm))
    return "";
  return comm::algorithm_name(algorithm) + " has no device codec";
}

std::shared_ptr<DeviceCodec> make_device_codec(const comm::Compression& algorithm,
                                               const comm::BucketBuffer& bucket,
                                               const torch::Device& device, int rank,
                                               int world_size) {
  if (bucket.type != comm::DataType::float32)
    throw comm::Error("bucket " + std::to_string(bucket.index) + " holds " +
                      comm::to_string(bucket.type) + ": the device codecs encode float32");
  if (const auto* half = std::get_if<comm::HalfPrecision>(&algorithm))
    return std::make_shared<CastCodec>(*half, bucket, device);
  if (const auto* sign = std::get_if<comm::SignCompression>(&algorithm))
    return std::make_shared<SignCodec>(*sign, bucket, device, rank, world_size);
  if (const auto codes = comm::minmax_codes(algorithm))
    return std::make_shared<MinMaxCodec>(*codes, bucket, device, world_size);
  if (const auto* sparse = std::get_if<comm::Sparsification>(&algorithm);
      sparse && device_codec_support(algorithm).empty())
    return std::make_shared<TopKCodec>(*sparse, bucket, device, rank, world_size);
  throw comm::Error(device_codec_support(algorithm));
}

}  // namespace troupe
