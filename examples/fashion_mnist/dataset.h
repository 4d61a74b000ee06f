#pragma once
/// Fashion-MNIST for the examples: read straight from the gzip-compressed IDX files, split into
/// disjoint per-rank shards, iterated in batches reshuffled per epoch, and scored by accuracy.
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace troupe::examples {

/// A set of labelled images: `images` float [N, 1, 28, 28] normalised as
/// (x / 255 - 0.2860) / 0.3530, `labels` int64 [N] in 0..9.
struct FashionMnist {
  torch::Tensor images;
  torch::Tensor labels;
};

/// Reads split "train" (60000 images) or "test" (10000, the t10k-* files) from `dir`, which holds
/// the four *-idx?-ubyte.gz files as distributed. Throws std::runtime_error naming the file and
/// what is wrong with it: missing or unreadable, bad magic number, dimensions other than 28x28,
/// truncated data, data past what the header announces, a gzip stream whose CRC or length does
/// not match (each file is read to its end so that the check runs), a label outside 0..9, or a
/// label count different from the image count.
FashionMnist load_fashion_mnist(const std::string& dir, const std::string& split);

/// Refuses, before any training, a run that would train no step or score nothing: throws
/// std::invalid_argument naming `dir` and the sizes when the test set is empty, when the
/// `train_images` cannot give each of `world` ranks an image, or when `batch` is larger than one
/// rank's shard (the last partial batch is dropped, so such a run would train zero steps).
void check_trainable(const std::string& dir, int64_t train_images, int world, int64_t batch,
                     int64_t test_images);

/// The number of examples in `data`.
int64_t size(const FashionMnist& data);

/// Rank `rank`'s shard of `all` out of `world`: a contiguous 1/world slice of one fixed
/// permutation drawn from `seed`, so ranks that pass the same seed get disjoint shards of equal
/// size that together cover the set except the last size % world examples of the permutation.
/// Does not touch torch's global random generator. Throws std::invalid_argument when rank is not
/// in 0..world-1 or the set has fewer examples than ranks.
FashionMnist shard(const FashionMnist& all, int rank, int world, uint64_t seed);

/// Full batches of a set, in an order reshuffled every epoch. The order of epoch e depends only on
/// (seed, e), so it is reproducible and the same on every rank; it is drawn from a private
/// torch::Generator, never from torch's global one. The last partial batch is dropped.
///
///   BatchIterator batches(train, 64, seed);
///   for (int epoch = 0; epoch < epochs; ++epoch) {
///     batches.begin(epoch);
///     torch::Tensor x, y;
///     while (batches.next(x, y)) { ... }
///   }
class BatchIterator {
 public:
  /// Iterates `data` (shared, not copied) in batches of `batch` examples. Throws
  /// std::invalid_argument when batch < 1 or images and labels differ in count.
  BatchIterator(const FashionMnist& data, int64_t batch, uint64_t seed);

  /// Starts epoch `epoch`: draws its order and rewinds to the first batch.
  void begin(int64_t epoch);

  /// The next batch of the epoch into `x` [batch, 1, 28, 28] and `y` [batch]; false when the
  /// epoch has no full batch left. Throws std::logic_error before the first begin().
  bool next(torch::Tensor& x, torch::Tensor& y);

  /// Passes over the next `batches` batches of the epoch (where a resumed run continues). Throws
  /// std::logic_error before the first begin(), std::invalid_argument past the epoch's end.
  void skip(int64_t batches);

  /// Full batches in one epoch: size / batch.
  int64_t batches_per_epoch() const;

 private:
  torch::Tensor images_;
  torch::Tensor labels_;
  int64_t batch_;
  uint64_t seed_;
  torch::Tensor order_;
  int64_t position_ = 0;
};

/// A model seen as a function from a batch of images to log-probabilities [batch, 10].
using Forward = std::function<torch::Tensor(const torch::Tensor&)>;

/// The fraction of `data` that `forward` classifies correctly (argmax of its output equals the
/// label), evaluated in batches of `batch` without autograd. The caller chooses the model's mode;
/// the overload below switches a module to eval mode for the evaluation.
/// Throws std::invalid_argument for an empty set or batch < 1.
double accuracy(const Forward& forward, const FashionMnist& data, int64_t batch = 1000);

/// accuracy() with `module` in eval mode, its training mode restored afterwards.
/// `forward` calls that module, e.g. [&](const torch::Tensor& x) { return net->forward(x); }.
double accuracy(torch::nn::Module& module, const Forward& forward, const FashionMnist& data,
                int64_t batch = 1000);

}  // namespace troupe::examples
