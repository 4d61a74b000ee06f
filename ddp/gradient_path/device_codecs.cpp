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

#ifdef TROUPE_HAVE_C10_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace troupe {

// The exchange, with the codec's state on the device.
class CodecReduction final : public comm::Reduction {
 public:
  CodecReduction(std::shared_ptr<DeviceCodec> codec, std::shared_ptr<comm::Reduction> exchange)
      : codec_(std::move(codec)), exchange_(std::move(exchange)) {}
  std::string name() const override { return codec_->name_; }
  // Round r's stages come after r empty ones: each round's messages travel under keys of their own
  // (the transport path keys a stage by its place in the list).
  std::vector<std::function<comm::Schedule()>> stages(const comm::ReduceStep& step) override {
    comm::ReduceStep flat = step;
    if (codec_->flat_) flat.collectives.hosts.clear();
    std::vector<std::function<comm::Schedule()>> stages(static_cast<size_t>(codec_->round_),
                                                        [] { return comm::Schedule{}; });
    for (auto& stage : exchange_->stages(flat)) stages.push_back(std::move(stage));
    return stages;
  }
  void save_state(comm::StateWriter& out) const override { codec_->save_state(out); }
  void load_state(comm::StateReader& in) override { codec_->load_state(in); }
  void save_shared_state(comm::StateWriter& out) const override { codec_->save_shared_state(out); }
  void load_shared_state(comm::StateReader& in) override { codec_->load_shared_state(in); }

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

  void encode(void* stream, const CodecRound& round) override {
    // The scale before the cast, against overflow (comm's HalfPrecision).
    const auto scale = static_cast<float>(1.0 / round.denominator);
    if (bfloat16_)
      cuda::encode_bfloat16(bucket_, count_, scale, image(), stream);
    else
      cuda::encode_half(bucket_, count_, scale, image(), stream);
  }
  void decode(void* stream, const CodecRound& round) override {
    (void)round;
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

  void encode(void* stream, const CodecRound& round) override {
    (void)round;  // the step's scale is applied on decode, to every rank's scale
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

  void decode(void* stream, const CodecRound& round) override {
    auto* data = static_cast<float*>(bucket_.data);
    const bool vote = config_.mode == comm::SignMode::majority_vote;
    const auto step_scale = static_cast<float>(1.0 / round.denominator);
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

  void encode(void* stream, const CodecRound& round) override {
    (void)round;  // the step's scale is applied by the exchange, to this rank's summed chunk
    auto* data = static_cast<float*>(bucket_.data);
    for (const comm::Range& gap : padding_)
      cuda::zero_async(data + gap.begin, gap.size() * sizeof(float), stream);
    for (int j = 0; j < world_size_; ++j) {
      const comm::Range r = comm::block_range(bucket_.count, world_size_, j);
      if (r.size())
        cuda::minmax_encode(bits_, data + r.begin, r.size(), codes_.block, slot(j), stream);
    }
  }

  void decode(void* stream, const CodecRound& round) override {
    (void)round;
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

  void encode(void* stream, const CodecRound& round) override {
    (void)round;  // the step's scale is applied on decode
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

  void decode(void* stream, const CodecRound& round) override {
    auto* data = static_cast<float*>(bucket_.data);
    const auto scale = static_cast<float>(1.0 / round.denominator);
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

// ---- PowerSGD -------------------------------------------------------------------------------
// Torch ops (matrix products, Gram-Schmidt), enqueued on the staging streams: the two allreduces
// of P and of Q run on the host between them, so a step has two rounds. The layout, the first Qs
// and every setting are comm's PowerSGD's; the arithmetic is cuBLAS's and torch's, so the result
// matches the CPU reduction to rounding, not bit for bit.

#ifdef TROUPE_HAVE_C10_CUDA

// Torch ops called inside `work` are enqueued on `stream` (the staging path's) instead of torch's
// current stream, which the trainer's kernels use.
template <class F>
void on_stream(void* stream, const torch::Device& device, F&& work) {
  c10::cuda::CUDAStreamGuard guard(
      c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), device.index()));
  work();
}

// The host side: the whole bucket's allreduce before start_iter, then each round's float32 sum.
class PowerSgdExchange final : public comm::Reduction {
 public:
  PowerSgdExchange(const comm::PowerSGD& config, const comm::BucketBuffer& warm, float* p,
                   size_t p_count, float* q, size_t q_count, const int* round)
      : config_(config),
        warm_(comm::make_reduction(comm::GradientAllReduce{}, warm)),
        p_(p),
        p_count_(p_count),
        q_(q),
        q_count_(q_count),
        round_(round) {}
  std::string name() const override { return "powersgd"; }
  std::vector<std::function<comm::Schedule()>> stages(const comm::ReduceStep& step) override {
    if (step.step < config_.start_iter) return warm_->stages(step);
    float* data = *round_ == 0 ? p_ : q_;
    const size_t count = *round_ == 0 ? p_count_ : q_count_;
    return {[step, data, count] {
      return comm::allreduce_schedule(step.group, data, count, comm::DataType::float32,
                                      comm::ReduceOp::sum, step.collectives);
    }};
  }

 private:
  comm::PowerSGD config_;
  std::shared_ptr<comm::Reduction> warm_;
  float* p_;
  size_t p_count_;
  float* q_;
  size_t q_count_;
  const int* round_;
};

class PowerSgdCodec final : public DeviceCodec {
 public:
  PowerSgdCodec(const comm::PowerSGD& config, const comm::BucketBuffer& bucket,
                const torch::Device& device, int world_size)
      : DeviceCodec("powersgd", /*flat=*/true),
        config_(config),
        bucket_(bucket),
        layout_(config, bucket),
        device_(device),
        world_size_(world_size) {
    const auto floats = torch::TensorOptions().dtype(torch::kFloat).device(device);
    // The area: P (and the plain tensors), Q, and the whole bucket for the warm-up's allreduce.
    area_ = torch::zeros({static_cast<int64_t>(layout_.p_count + layout_.q_count + bucket.count)},
                         floats);
    p_span_ = {0, layout_.p_count * sizeof(float)};
    q_span_ = {p_span_.bytes, layout_.q_count * sizeof(float)};
    warm_span_ = {q_span_.offset + q_span_.bytes, bucket.count * sizeof(float)};
    // Every matrix's Q^T, one after the other (at q_at), from comm's seeds.
    std::vector<float> qts(layout_.q_count);
    for (const auto& m : layout_.matrices)
      comm::power_sgd_qt(config, bucket, m, 0, qts.data() + m.q_at);
    qts_host_ = torch::from_blob(qts.data(), {static_cast<int64_t>(qts.size())}, torch::kFloat)
                    .clone()
                    .pin_memory();
    qts_ = qts_host_.to(device);
    if (config.error_feedback) error_ = torch::zeros({static_cast<int64_t>(bucket.count)}, floats);
  }

  int rounds(uint32_t step) const override { return step < config_.start_iter ? 1 : 2; }
  actors::HostStaging::Span sent(const CodecRound& round) const override {
    if (round.step < config_.start_iter) return warm_span_;
    return round.index == 0 ? p_span_ : q_span_;
  }
  actors::HostStaging::Span gathered(const CodecRound& round) const override { return sent(round); }

  void encode(void* stream, const CodecRound& round) override {
    on_stream(stream, device_, [&] {
      if (round.step < config_.start_iter)
        warm().copy_(bucket());
      else if (round.index == 0)
        project(round.step);
      else
        back_project(round);
    });
  }

  // x := P Q^T * scale; the memory M becomes M - P Q^T / world; with warm start Q^T / world is
  // the next step's Q^T.
  void decode(void* stream, const CodecRound& round) override {
    on_stream(stream, device_, [&] {
      if (round.step < config_.start_iter) {
        bucket().copy_(warm());
        return;
      }
      const auto factor = static_cast<float>(1.0 / round.denominator);
      const float inv = 1.0f / static_cast<float>(world_size_);
      for (const auto& m : layout_.matrices) {
        auto out = tensor(m.tensor);
        const auto q = q_of(m);
        torch::mm_out(out, p_of(m), q);
        out.mul_(factor);
        if (error_.defined())
          error(m.tensor).sub_(out, 1.0f / (static_cast<float>(world_size_) * factor));
        if (config_.warm_start) qt_of(m).copy_(q).mul_(inv);
      }
    });
  }

 protected:
  std::shared_ptr<comm::Reduction> exchange(const comm::BucketBuffer& host_buffer,
                                            void* host) override {
    auto* floats = static_cast<float*>(host);
    comm::BucketBuffer warm = host_buffer;
    warm.data = floats + warm_span_.offset / sizeof(float);
    return std::make_shared<PowerSgdExchange>(config_, warm, floats, layout_.p_count,
                                              floats + q_span_.offset / sizeof(float),
                                              layout_.q_count, current_round());
  }

  // As comm's PowerSGD: the memory (settled: the device's is never deferred), then the Qs.
  void save_state(comm::StateWriter& out) const override {
    out.vector(host_copy(error_));
    save_shared_state(out);
  }
  void load_state(comm::StateReader& in) override {
    const size_t n = error_.defined() ? static_cast<size_t>(error_.numel()) : 0;
    auto error = in.vector<float>(n, "the error-feedback memory");
    auto qts = read_qts(in);
    device_copy(error, error_);
    device_copy(qts, qts_);
  }
  void save_shared_state(comm::StateWriter& out) const override {
    const auto qts = host_copy(qts_);
    out.value<uint64_t>(layout_.matrices.size());
    for (const auto& m : layout_.matrices)
      out.vector(std::vector<float>(qts.begin() + static_cast<ptrdiff_t>(m.q_at),
                                    qts.begin() + static_cast<ptrdiff_t>(m.q_at + m.r * m.cols)));
  }
  void load_shared_state(comm::StateReader& in) override {
    auto qts = read_qts(in);
    device_copy(qts, qts_);
  }

 private:
  // Round 0: M = gradient + memory (into the memory), P = M Q for each matrix; the plain tensors
  // beside the Ps.
  void project(uint32_t step) {
    if (!config_.warm_start) {
      // A fresh Q per step, drawn on the host (comm's seeds) into pinned memory: the last
      // step's copy from it has completed (its reduction ended after this stream's work).
      auto* qts = qts_host_.data_ptr<float>();
      for (const auto& m : layout_.matrices)
        comm::power_sgd_qt(config_, bucket_, m, step, qts + m.q_at);
      qts_.copy_(qts_host_, /*non_blocking=*/true);
    }
    for (const auto& m : layout_.matrices) {
      torch::Tensor mat = tensor(m.tensor);
      if (error_.defined()) mat = error(m.tensor).add_(mat);
      auto p = p_of(m);
      torch::mm_out(p, mat, qt_of(m).t());
    }
    for (const auto& u : layout_.plain) plain_of(u).copy_(tensor(u.tensor).view({-1}));
  }

  // Round 1, with the summed P back: the plain tensors' result; each P made orthonormal and
  // Q^T = P^T M.
  void back_project(const CodecRound& round) {
    const auto factor = static_cast<float>(1.0 / round.denominator);
    for (const auto& u : layout_.plain) tensor(u.tensor).view({-1}).copy_(plain_of(u)).mul_(factor);
    for (const auto& m : layout_.matrices) {
      auto p = p_of(m);
      orthogonalize(p);
      auto q = q_of(m);
      torch::mm_out(q, p.t(), error_.defined() ? error(m.tensor) : tensor(m.tensor));
    }
  }

  // Modified Gram-Schmidt in double, each earlier column removed twice, a column whose norm
  // falls below 1e-8 set to zero: comm::orthogonalize_columns's rule, with no host round trip.
  static void orthogonalize(torch::Tensor p) {
    auto d = p.to(torch::kDouble);
    for (int64_t i = 0; i < d.size(1); ++i) {
      auto column = d.select(1, i);
      for (int pass = 0; pass < 2; ++pass)
        for (int64_t j = 0; j < i; ++j) {
          auto earlier = d.select(1, j);
          column.sub_(earlier * earlier.dot(column));
        }
      const auto norm = column.norm();
      column.mul_(torch::where(norm < 1e-8, torch::zeros_like(norm), norm.reciprocal()));
    }
    p.copy_(d);
  }

  torch::Tensor floats_at(size_t offset, size_t count) const {
    return area_.narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(count));
  }
  torch::Tensor warm() const { return floats_at(warm_span_.offset / sizeof(float), bucket_.count); }
  torch::Tensor p_of(const comm::PowerSgdLayout::Matrix& m) const {
    return floats_at(m.p_at, m.rows * m.r)
        .view({static_cast<int64_t>(m.rows), static_cast<int64_t>(m.r)});
  }
  torch::Tensor q_of(const comm::PowerSgdLayout::Matrix& m) const {
    return floats_at(layout_.p_count + m.q_at, m.r * m.cols)
        .view({static_cast<int64_t>(m.r), static_cast<int64_t>(m.cols)});
  }
  torch::Tensor plain_of(const comm::PowerSgdLayout::Plain& u) const {
    return floats_at(u.at, bucket_.tensors[u.tensor].count);
  }
  torch::Tensor qt_of(const comm::PowerSgdLayout::Matrix& m) const {
    return qts_.narrow(0, static_cast<int64_t>(m.q_at), static_cast<int64_t>(m.r * m.cols))
        .view({static_cast<int64_t>(m.r), static_cast<int64_t>(m.cols)});
  }
  // The whole bucket, and tensor t of it (of the memory) as its rows x cols matrix.
  torch::Tensor bucket() const {
    return torch::from_blob(bucket_.data, {static_cast<int64_t>(bucket_.count)},
                            torch::TensorOptions().dtype(torch::kFloat).device(device_));
  }
  torch::Tensor matrix_of(const torch::Tensor& flat, size_t t) const {
    const auto& slot = bucket_.tensors[t];
    return flat.narrow(0, static_cast<int64_t>(slot.offset), static_cast<int64_t>(slot.count))
        .view({static_cast<int64_t>(slot.rows), static_cast<int64_t>(slot.cols())});
  }
  torch::Tensor tensor(size_t t) const { return matrix_of(bucket(), t); }
  torch::Tensor error(size_t t) const { return matrix_of(error_, t); }

  std::vector<float> read_qts(comm::StateReader& in) const {
    const auto count = in.value<uint64_t>();
    if (count != layout_.matrices.size())
      in.fail(std::to_string(count) + " compressed matrices, expected " +
              std::to_string(layout_.matrices.size()));
    std::vector<float> qts(layout_.q_count);
    for (const auto& m : layout_.matrices) {
      auto qt = in.vector<float>(m.r * m.cols, "a Q matrix");
      std::copy(qt.begin(), qt.end(), qts.begin() + static_cast<ptrdiff_t>(m.q_at));
    }
    return qts;
  }

  comm::PowerSGD config_;
  comm::BucketBuffer bucket_;
  comm::PowerSgdLayout layout_;
  torch::Device device_;
  int world_size_;
  actors::HostStaging::Span p_span_, q_span_, warm_span_;
  torch::Tensor qts_;       // every matrix's Q^T (device)
  torch::Tensor qts_host_;  // pinned: fresh Qs without warm start
  torch::Tensor error_;     // the memory (device); undefined without error feedback
};

#endif

}  // namespace

std::string device_codec_support(const comm::Compression& algorithm) {
  if (const auto* sparse = std::get_if<comm::Sparsification>(&algorithm)) {
    if (sparse->mode != comm::SparseMode::top_k)
      return comm::algorithm_name(algorithm) + " has no device codec (top-k has)";
    if (sparse->momentum > 0)
      return comm::algorithm_name(algorithm) +
             ": top-k with momentum correction has no device codec";
    return "";
  }
  if (std::holds_alternative<comm::PowerSGD>(algorithm)) {
#ifdef TROUPE_HAVE_C10_CUDA
    return "";
#else
    return "powersgd's device codec runs torch ops on the staging streams, which needs "
           "LibTorch's c10_cuda (not found at build time)";
#endif
  }
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
#ifdef TROUPE_HAVE_C10_CUDA
  if (const auto* power = std::get_if<comm::PowerSGD>(&algorithm))
    return std::make_shared<PowerSgdCodec>(*power, bucket, device, world_size);
#endif
  throw comm::Error(device_codec_support(algorithm));
}

}  // namespace troupe
