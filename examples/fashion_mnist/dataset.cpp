#include "fashion_mnist/dataset.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

namespace troupe::examples {
namespace {

constexpr uint32_t kLabelsMagic = 0x00000801;  // unsigned bytes, 1 dimension
constexpr uint32_t kImagesMagic = 0x00000803;  // unsigned bytes, 3 dimensions
constexpr uint32_t kSide = 28;
constexpr int64_t kClasses = 10;
constexpr double kMean = 0.2860;
constexpr double kStd = 0.3530;

std::string hex(uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", value);
  return text;
}

/// A gzip file opened for reading; every error names the file.
class GzFile {
 public:
  explicit GzFile(std::string path) : path_(std::move(path)) {
    errno = 0;
    file_ = gzopen(path_.c_str(), "rb");
    if (file_ == nullptr) {
      fail(std::string("cannot open: ") + (errno != 0 ? std::strerror(errno) : "out of memory"));
    }
  }
  ~GzFile() {
    if (file_ != nullptr) gzclose(file_);
  }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("fashion-mnist: " + path_ + ": " + what);
  }

  /// Reads up to `n` bytes; fewer only at the end of the data. Throws on a corrupt stream.
  size_t read(void* dst, size_t n) {
    size_t done = 0;
    while (done < n) {
      const auto chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 20));
      const int got = gzread(file_, static_cast<char*>(dst) + done, chunk);
      if (got < 0) {
        int code = 0;
        fail(std::string("cannot decompress: ") + gzerror(file_, &code) + " (the file is corrupt)");
      }
      if (got == 0) break;
      done += static_cast<size_t>(got);
    }
    return done;
  }

  /// A big-endian 32-bit header field called `what`.
  uint32_t read_u32(const char* what) {
    unsigned char bytes[4];
    if (read(bytes, 4) != 4) fail(std::string("truncated header: no ") + what);
    return (uint32_t{bytes[0]} << 24) | (uint32_t{bytes[1]} << 16) | (uint32_t{bytes[2]} << 8) |
           uint32_t{bytes[3]};
  }

  /// Reads on to the end of the file, so that the CRC and length in the trailer of each gzip
  /// stream are checked (a corrupt middle otherwise passes as data): throws when that check fails
  /// or when bytes follow the `expected` ones the header announced.
  void read_to_end(uint64_t expected) {
    unsigned char extra = 0;
    if (read(&extra, 1) != 0) {
      fail("more data than its header announces (expected " + std::to_string(expected) +
           " bytes after decompression)");
    }
  }

  /// Exactly `n` bytes of `what`. Grows the buffer as data arrives, so a corrupt header that
  /// claims billions of items fails as truncated instead of allocating for them up front.
  std::vector<uint8_t> read_exactly(uint64_t n, const char* what) {
    std::vector<uint8_t> data;
    constexpr uint64_t kChunk = 8u << 20;
    while (data.size() < n) {
      const uint64_t offset = data.size();
      const uint64_t want = std::min<uint64_t>(n - offset, kChunk);
      data.resize(offset + want);
      const size_t got = read(data.data() + offset, want);
      if (got < want) {
        fail("truncated data: expected " + std::to_string(n) + " bytes of " + what + ", found " +
             std::to_string(offset + got));
      }
    }
    return data;
  }

 private:
  std::string path_;
  gzFile file_ = nullptr;
};

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

/// uint8 [N, 28, 28] from an idx3-ubyte.gz file.
torch::Tensor read_images(const std::string& path) {
  GzFile file(path);
  const uint32_t magic = file.read_u32("magic number");
  if (magic != kImagesMagic) {
    file.fail("bad magic number " + hex(magic) + ", expected " + hex(kImagesMagic) +
              " (IDX images: unsigned bytes, 3 dimensions)");
  }
  const uint32_t count = file.read_u32("image count");
  const uint32_t rows = file.read_u32("row count");
  const uint32_t cols = file.read_u32("column count");
  if (rows != kSide || cols != kSide) {
    file.fail("images are " + std::to_string(rows) + "x" + std::to_string(cols) + ", expected " +
              std::to_string(kSide) + "x" + std::to_string(kSide));
  }
  std::vector<uint8_t> pixels = file.read_exactly(uint64_t{count} * rows * cols, "pixels");
  file.read_to_end(16 + pixels.size());
  return torch::from_blob(pixels.data(), {int64_t{count}, int64_t{rows}, int64_t{cols}},
                          torch::kUInt8)
      .clone();
}

/// int64 [N] from an idx1-ubyte.gz file.
torch::Tensor read_labels(const std::string& path) {
  GzFile file(path);
  const uint32_t magic = file.read_u32("magic number");
  if (magic != kLabelsMagic) {
    file.fail("bad magic number " + hex(magic) + ", expected " + hex(kLabelsMagic) +
              " (IDX labels: unsigned bytes, 1 dimension)");
  }
  const uint32_t count = file.read_u32("label count");
  std::vector<uint8_t> labels = file.read_exactly(count, "labels");
  file.read_to_end(8 + labels.size());
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] >= kClasses) {
      file.fail("label " + std::to_string(labels[i]) + " at index " + std::to_string(i) +
                " is outside 0.." + std::to_string(kClasses - 1));
    }
  }
  return torch::from_blob(labels.data(), {int64_t{count}}, torch::kUInt8).to(torch::kInt64);
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// CPUGeneratorImpl seeds its mt19937 from the low 32 bits only, so (seed, stream) is mixed into
// them rather than combined in a way that would let nearby seeds collide.
torch::Generator generator_for(uint64_t seed, uint64_t stream) {
  return at::make_generator<at::CPUGeneratorImpl>(splitmix64(seed ^ splitmix64(stream)));
}

constexpr uint64_t kShardStream = 0x5348415244ull;  // "SHARD"; epochs use streams 0, 1, ...

torch::Tensor permutation(int64_t n, uint64_t seed, uint64_t stream) {
  return torch::randperm(n, generator_for(seed, stream), torch::kInt64);
}

}  // namespace

FashionMnist load_fashion_mnist(const std::string& dir, const std::string& split) {
  std::string prefix;
  if (split == "train") {
    prefix = "train";
  } else if (split == "test") {
    prefix = "t10k";
  } else {
    throw std::runtime_error("fashion-mnist: unknown split \"" + split +
                             "\", expected \"train\" or \"test\"");
  }
  const std::string images_path = join(dir, prefix + "-images-idx3-ubyte.gz");
  const std::string labels_path = join(dir, prefix + "-labels-idx1-ubyte.gz");
  torch::Tensor pixels = read_images(images_path);
  torch::Tensor labels = read_labels(labels_path);
  if (labels.size(0) != pixels.size(0)) {
    throw std::runtime_error("fashion-mnist: " + labels_path + " holds " +
                             std::to_string(labels.size(0)) + " labels but " + images_path +
                             " holds " + std::to_string(pixels.size(0)) + " images");
  }
  torch::Tensor images = pixels.unsqueeze(1).to(torch::kFloat32).div_(255.0).sub_(kMean).div_(kStd);
  return {images, labels};
}

void check_trainable(const std::string& dir, int64_t train_images, int world, int64_t batch,
                     int64_t test_images) {
  const std::string where = "fashion-mnist: " + dir + ": ";
  if (test_images < 1) {
    throw std::invalid_argument(where +
                                "the test set holds no images, so no accuracy can be "
                                "measured (expected at least 1 test image)");
  }
  const int64_t per_rank = world > 0 ? train_images / world : 0;
  if (per_rank < 1) {
    throw std::invalid_argument(where + std::to_string(train_images) +
                                " training images cannot be split over " + std::to_string(world) +
                                " rank(s) (expected at least one image per rank)");
  }
  if (batch > per_rank) {
    throw std::invalid_argument(where + "batch " + std::to_string(batch) +
                                " per rank is larger than each rank's shard of " +
                                std::to_string(per_rank) + " training image(s) (" +
                                std::to_string(train_images) + " over " + std::to_string(world) +
                                " rank(s)), so no step would run (expected a batch of "
                                "at most " +
                                std::to_string(per_rank) + ")");
  }
}

int64_t size(const FashionMnist& data) { return data.labels.defined() ? data.labels.size(0) : 0; }

FashionMnist shard(const FashionMnist& all, int rank, int world, uint64_t seed) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw std::invalid_argument("shard: rank " + std::to_string(rank) + " of world " +
                                std::to_string(world) + ", expected 0 <= rank < world");
  }
  const int64_t n = size(all);
  const int64_t per_rank = n / world;
  if (per_rank == 0) {
    throw std::invalid_argument("shard: " + std::to_string(n) + " examples cannot be split over " +
                                std::to_string(world) + " ranks");
  }
  torch::Tensor mine = permutation(n, seed, kShardStream).narrow(0, rank * per_rank, per_rank);
  return {all.images.index_select(0, mine), all.labels.index_select(0, mine)};
}

BatchIterator::BatchIterator(const FashionMnist& data, int64_t batch, uint64_t seed)
    : images_(data.images), labels_(data.labels), batch_(batch), seed_(seed) {
  if (batch < 1) {
    throw std::invalid_argument("BatchIterator: batch " + std::to_string(batch) +
                                ", expected at least 1");
  }
  if (!images_.defined() || !labels_.defined() || images_.size(0) != labels_.size(0)) {
    throw std::invalid_argument("BatchIterator: images and labels differ in count");
  }
}

void BatchIterator::begin(int64_t epoch) {
  order_ = permutation(labels_.size(0), seed_, static_cast<uint64_t>(epoch));
  position_ = 0;
}

bool BatchIterator::next(torch::Tensor& x, torch::Tensor& y) {
  if (!order_.defined()) throw std::logic_error("BatchIterator::next called before begin(epoch)");
  if (position_ + batch_ > order_.size(0)) return false;
  torch::Tensor indices = order_.narrow(0, position_, batch_);
  position_ += batch_;
  x = images_.index_select(0, indices);
  y = labels_.index_select(0, indices);
  return true;
}

void BatchIterator::skip(int64_t batches) {
  if (!order_.defined()) throw std::logic_error("BatchIterator::skip called before begin(epoch)");
  if (batches < 0 || position_ + batches * batch_ > order_.size(0))
    throw std::invalid_argument(
        "BatchIterator::skip(" + std::to_string(batches) + "): the epoch has " +
        std::to_string((order_.size(0) - position_) / batch_) + " batches left");
  position_ += batches * batch_;
}

int64_t BatchIterator::batches_per_epoch() const { return labels_.size(0) / batch_; }

double accuracy(const Forward& forward, const FashionMnist& data, int64_t batch) {
  const int64_t n = size(data);
  if (n == 0 || batch < 1) {
    throw std::invalid_argument("accuracy: " + std::to_string(n) + " examples in batches of " +
                                std::to_string(batch) +
                                ", expected a non-empty set and batch >= 1");
  }
  torch::NoGradGuard no_grad;
  int64_t correct = 0;
  for (int64_t start = 0; start < n; start += batch) {
    const int64_t count = std::min(batch, n - start);
    torch::Tensor predicted = forward(data.images.narrow(0, start, count)).argmax(1);
    correct += predicted.eq(data.labels.narrow(0, start, count)).sum().item<int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(n);
}

double accuracy(torch::nn::Module& module, const Forward& forward, const FashionMnist& data,
                int64_t batch) {
  const bool was_training = module.is_training();
  module.eval();
  struct Restore {
    torch::nn::Module& module;
    bool training;
    ~Restore() { module.train(training); }
  } restore{module, was_training};
  return accuracy(forward, data, batch);
}

}  // namespace troupe::examples
