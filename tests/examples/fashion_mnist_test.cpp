#include "examples/fashion_mnist/dataset.h"
#include "examples/fashion_mnist/models.h"

#include <stdlib.h>
#include <torch/torch.h>
#include <zlib.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

// Debian's LibTorch logs through glog, whose CHECK macros would replace doctest's: doctest comes
// after every torch header and takes the names back.
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>

namespace {

namespace fs = std::filesystem;
using troupe::examples::BatchIterator;
using troupe::examples::FashionMnist;

const char* const kDataDir = "/usr/share/datasets/fashion-mnist";

const FashionMnist& train_set() {
  static const FashionMnist set = troupe::examples::load_fashion_mnist(kDataDir, "train");
  return set;
}

const FashionMnist& test_set() {
  static const FashionMnist set = troupe::examples::load_fashion_mnist(kDataDir, "test");
  return set;
}

/// A fresh directory under the system's temporary folder, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "troupe-fashion-mnist-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

/// An IDX header: the magic number, then one big-endian 32-bit size per dimension.
std::vector<uint8_t> idx_header(uint32_t magic, const std::vector<uint32_t>& dims) {
  std::vector<uint32_t> fields{magic};
  fields.insert(fields.end(), dims.begin(), dims.end());
  std::vector<uint8_t> bytes;
  for (uint32_t value : fields) {
    for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(uint8_t(value >> shift));
  }
  return bytes;
}

/// An IDX header followed by `payload` bytes of value 7.
std::vector<uint8_t> idx_file(uint32_t magic, const std::vector<uint32_t>& dims, size_t payload) {
  std::vector<uint8_t> bytes = idx_header(magic, dims);
  bytes.insert(bytes.end(), payload, uint8_t{7});
  return bytes;
}

void write_gz(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  REQUIRE(file != nullptr);
  REQUIRE(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())) ==
          static_cast<int>(bytes.size()));
  REQUIRE(gzclose(file) == Z_OK);
}

std::vector<uint8_t> read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void write_raw(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

/// A well-formed "test" split of `n` images in `dir`.
void write_valid_split(const TempDir& dir, uint32_t n) {
  write_gz(dir.file("t10k-images-idx3-ubyte.gz"), idx_file(0x803, {n, 28, 28}, n * 28 * 28));
  write_gz(dir.file("t10k-labels-idx1-ubyte.gz"), idx_file(0x801, {n}, n));
}

/// The message of the error loading split "test" from `dir` throws, or "" when it loads.
std::string load_error(const TempDir& dir) {
  try {
    troupe::examples::load_fashion_mnist(dir.path(), "test");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// A set whose label is each example's index and whose every pixel holds that index too, so any
/// image or label seen later tells which example it was.
FashionMnist numbered_set(int64_t n) {
  torch::Tensor ids = torch::arange(n, torch::kInt64);
  return {ids.to(torch::kFloat32).view({n, 1, 1, 1}).expand({n, 1, 28, 28}).contiguous(), ids};
}

/// The labels (example ids) of every batch of `epoch`, in order.
std::vector<int64_t> epoch_ids(BatchIterator& batches, int64_t epoch) {
  std::vector<int64_t> ids;
  batches.begin(epoch);
  torch::Tensor x;
  torch::Tensor y;
  while (batches.next(x, y)) {
    REQUIRE(torch::equal(x.select(1, 0).select(1, 0).select(1, 0).to(torch::kInt64), y));
    for (int64_t i = 0; i < y.size(0); ++i) ids.push_back(y[i].item<int64_t>());
  }
  return ids;
}

}  // namespace

TEST_CASE("the real train and test splits load as 28x28 images with every class 0..9 present") {
  for (const auto& entry :
       {std::pair<const FashionMnist*, int64_t>{&train_set(), 60000}, {&test_set(), 10000}}) {
    const FashionMnist* set = entry.first;
    const int64_t expected = entry.second;
    CAPTURE(expected);
    CHECK(set->images.sizes() == torch::IntArrayRef{expected, 1, 28, 28});
    CHECK(set->images.dtype() == torch::kFloat32);
    CHECK(set->labels.sizes() == torch::IntArrayRef{expected});
    CHECK(set->labels.dtype() == torch::kInt64);
    CHECK(set->labels.min().item<int64_t>() == 0);
    CHECK(set->labels.max().item<int64_t>() == 9);
    torch::Tensor per_class = torch::bincount(set->labels, {}, 10);
    CHECK(per_class.min().item<int64_t>() > 0);
  }
  // Fashion-MNIST is balanced, and the normalisation centres the training pixels.
  CHECK(torch::bincount(train_set().labels).eq(6000).all().item<bool>());
  CHECK(std::abs(train_set().images.mean().item<double>()) < 0.01);
  CHECK(std::abs(train_set().images.std().item<double>() - 1.0) < 0.01);
}

TEST_CASE("an unknown split or a missing file is an error naming it") {
  TempDir dir;
  CHECK(contains(load_error(dir), dir.file("t10k-images-idx3-ubyte.gz")));
  CHECK(contains(load_error(dir), "cannot open"));
  write_gz(dir.file("t10k-images-idx3-ubyte.gz"), idx_file(0x803, {2, 28, 28}, 2 * 28 * 28));
  CHECK(contains(load_error(dir), dir.file("t10k-labels-idx1-ubyte.gz")));
  CHECK_THROWS_WITH_AS(troupe::examples::load_fashion_mnist(dir.path(), "validation"),
                       doctest::Contains("validation"), std::runtime_error);
}

TEST_CASE("a corrupt file gives an error naming the file and what is wrong with it") {
  TempDir dir;
  const std::string images = dir.file("t10k-images-idx3-ubyte.gz");
  const std::string labels = dir.file("t10k-labels-idx1-ubyte.gz");
  write_valid_split(dir, 3);
  REQUIRE(load_error(dir) == "");

  SUBCASE("a wrong magic number") {
    write_gz(images, idx_file(0x801, {3, 28, 28}, 3 * 28 * 28));
    const std::string error = load_error(dir);
    CHECK(contains(error, images));
    CHECK(contains(error, "magic number 0x00000801"));
  }
  SUBCASE("images that are not 28x28") {
    write_gz(images, idx_file(0x803, {3, 28, 27}, 3 * 28 * 27));
    const std::string error = load_error(dir);
    CHECK(contains(error, images));
    CHECK(contains(error, "28x27"));
  }
  SUBCASE("fewer pixels than the header announces") {
    write_gz(images, idx_file(0x803, {3, 28, 28}, 2 * 28 * 28 + 5));
    const std::string error = load_error(dir);
    CHECK(contains(error, images));
    CHECK(contains(error, "truncated"));
  }
  SUBCASE("a header cut short") {
    write_gz(labels, idx_header(0x801, {}));
    const std::string error = load_error(dir);
    CHECK(contains(error, labels));
    CHECK(contains(error, "truncated"));
  }
  SUBCASE("a compressed stream cut short") {
    std::vector<uint8_t> bytes = read_raw(images);
    bytes.resize(bytes.size() / 2);
    write_raw(images, bytes);
    const std::string error = load_error(dir);
    CHECK(contains(error, images));
  }
  SUBCASE("a label outside 0..9") {
    std::vector<uint8_t> bytes = idx_file(0x801, {3}, 3);
    bytes.back() = 10;
    write_gz(labels, bytes);
    const std::string error = load_error(dir);
    CHECK(contains(error, labels));
    CHECK(contains(error, "label 10 at index 2"));
  }
  SUBCASE("fewer labels than images") {
    write_gz(labels, idx_file(0x801, {2}, 2));
    const std::string error = load_error(dir);
    CHECK(contains(error, labels));
    CHECK(contains(error, "2 labels"));
    CHECK(contains(error, "3 images"));
  }
}

TEST_CASE("shards of 3 ranks are disjoint, equal-sized and cover all but the remainder") {
  const int64_t n = 1001;
  const FashionMnist all = numbered_set(n);
  std::set<int64_t> seen;
  for (int rank = 0; rank < 3; ++rank) {
    const FashionMnist mine = troupe::examples::shard(all, rank, 3, 42);
    REQUIRE(mine.labels.size(0) == n / 3);
    REQUIRE(mine.images.size(0) == n / 3);
    CHECK(torch::equal(mine.images.select(1, 0).select(1, 0).select(1, 0).to(torch::kInt64),
                       mine.labels));
    for (int64_t i = 0; i < mine.labels.size(0); ++i) {
      CHECK(seen.insert(mine.labels[i].item<int64_t>()).second);
    }
    // Every rank computes the same permutation from the same seed.
    CHECK(torch::equal(troupe::examples::shard(all, rank, 3, 42).labels, mine.labels));
  }
  CHECK(seen.size() == size_t(n - n % 3));
  CHECK(*seen.begin() >= 0);
  CHECK(*seen.rbegin() < n);
  CHECK_FALSE(torch::equal(troupe::examples::shard(all, 0, 3, 43).labels,
                           troupe::examples::shard(all, 0, 3, 42).labels));
  CHECK_THROWS_AS(troupe::examples::shard(all, 3, 3, 42), std::invalid_argument);
}

TEST_CASE(
    "the batch iterator repeats an epoch's order, reshuffles the next, and leaves torch's RNG "
    "alone") {
  const FashionMnist all = numbered_set(1000);
  BatchIterator batches(all, 64, 7);
  CHECK(batches.batches_per_epoch() == 15);

  torch::manual_seed(123);
  const std::vector<int64_t> epoch0 = epoch_ids(batches, 0);
  const std::vector<int64_t> epoch0_again = epoch_ids(batches, 0);
  BatchIterator other(all, 64, 7);
  const std::vector<int64_t> epoch0_other = epoch_ids(other, 0);
  const std::vector<int64_t> epoch1 = epoch_ids(batches, 1);
  (void)troupe::examples::shard(all, 1, 2, 7);
  const torch::Tensor after = torch::rand({8});
  torch::manual_seed(123);
  CHECK(torch::equal(after, torch::rand({8})));

  CHECK(epoch0.size() == 15 * 64);
  CHECK(std::set<int64_t>(epoch0.begin(), epoch0.end()).size() == epoch0.size());
  CHECK(epoch0 == epoch0_again);
  CHECK(epoch0 == epoch0_other);
  CHECK(epoch1.size() == epoch0.size());
  CHECK(epoch1 != epoch0);
  BatchIterator other_seed(all, 64, 8);
  CHECK(epoch_ids(other_seed, 0) != epoch0);

  torch::Tensor x;
  torch::Tensor y;
  BatchIterator unstarted(all, 64, 7);
  CHECK_THROWS_AS(unstarted.next(x, y), std::logic_error);
}

TEST_CASE("the models name their parameters and return log-probabilities over 10 classes") {
  troupe::examples::CnnNet cnn;
  std::vector<std::string> names;
  for (const auto& item : cnn->named_parameters()) names.push_back(item.key());
  CHECK(names == std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight",
                                          "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight",
                                          "fc2.bias"});

  const auto count = [](const torch::nn::Module& module) {
    int64_t n = 0;
    for (const torch::Tensor& p : module.parameters()) n += p.numel();
    return n;
  };
  CHECK(count(*cnn) == 206922);
  troupe::examples::MlpNet large({784, 2048, 2048, 1024, 10});
  CHECK(count(*large) == 7912458);
  CHECK(large->named_parameters().contains("fc4.bias"));

  troupe::examples::MlpNet small;
  const torch::Tensor x = test_set().images.narrow(0, 0, 5);
  for (const torch::Tensor& out : {cnn->forward(x), small->forward(x)}) {
    CHECK(out.sizes() == torch::IntArrayRef{5, 10});
    CHECK(torch::allclose(out.exp().sum(1), torch::ones({5})));
  }
  CHECK_THROWS_AS(troupe::examples::MlpNet(std::vector<int64_t>{784}), std::invalid_argument);
}

TEST_CASE("the CNN reaches 85% test accuracy after one epoch of SGD on one process") {
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  torch::manual_seed(0);
  troupe::examples::CnnNet net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  BatchIterator batches(train_set(), 64, 1);

  const auto start = std::chrono::steady_clock::now();
  batches.begin(0);
  torch::Tensor x;
  torch::Tensor y;
  while (batches.next(x, y)) {
    sgd.zero_grad();
    torch::nll_loss(net->forward(x), y).backward();
    sgd.step();
  }
  const double train_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double acc = troupe::examples::accuracy(
      *net, [&](const torch::Tensor& images) { return net->forward(images); }, test_set());
  torch::set_num_threads(threads);

  MESSAGE("one epoch (", batches.batches_per_epoch(), " steps of 64, 1 thread) took ", train_s,
          " s; test accuracy ", acc);
  CHECK(net->is_training());
  CHECK(acc >= 0.85);
}
