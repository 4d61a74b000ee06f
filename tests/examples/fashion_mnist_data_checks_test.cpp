// The Fashion-MNIST loader reads each gzip file to its end, so a corrupt middle fails on its CRC
// instead of training on garbage; and a run that would train no step or score nothing is refused
// before it starts.
#include "examples/fashion_mnist/dataset.h"

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/support/idx_files.h"
#include "tests/support/torch_doctest.h"

namespace {

namespace fs = std::filesystem;

/// A fresh folder under the system's temporary folder, removed with everything in it.
struct Folder {
  Folder() {
    std::string pattern = (fs::temp_directory_path() / "troupe-gzip-XXXXXX").string();
    REQUIRE(mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~Folder() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
  std::string file(const std::string& name) const { return (fs::path(path) / name).string(); }
  std::string path;
};

/// A "test" split of `n` images in `folder`.
void write_split(const Folder& folder, uint32_t n, int level = 6) {
  troupe::test::write_split(folder.path, "t10k", n, level);
}

/// Flips the bits of one byte in the middle of `path` (in a stored block: the deflate format
/// stays valid, so only the CRC can tell).
void flip_middle_byte(const std::string& path) {
  std::vector<char> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  REQUIRE(bytes.size() > 100);
  bytes[bytes.size() / 2] ^= 0x5a;
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string load_error(const Folder& folder) {
  try {
    troupe::examples::load_fashion_mnist(folder.path, "test");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

std::string trainable_error(int64_t train, int world, int64_t batch, int64_t test) {
  try {
    troupe::examples::check_trainable("/data", train, world, batch, test);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a gzip file whose middle is corrupt fails on its CRC naming the file") {
  Folder folder;
  write_split(folder, 50, 0);
  const auto valid = troupe::examples::load_fashion_mnist(folder.path, "test");
  CHECK(troupe::examples::size(valid) == 50);
  const std::string images = folder.file("t10k-images-idx3-ubyte.gz");
  flip_middle_byte(images);
  CHECK(load_error(folder) == "fashion-mnist: " + images + ": cannot decompress: " + images +
                                  ": incorrect data check (the file is corrupt)");
}

TEST_CASE("a corrupt gzip file that decodes past what its header announces is refused") {
  // A decoder knocked out of step by a corrupt byte can emit more bytes than the header counts;
  // a loader that stops at the count never reaches the trailer, whose CRC would tell.
  Folder folder;
  write_split(folder, 20, 0);
  const std::string images = folder.file("t10k-images-idx3-ubyte.gz");
  troupe::test::write_gz(images, troupe::test::idx_bytes(0x803, {20, 28, 28}, 30 * 28 * 28, false),
                         0);
  flip_middle_byte(images);
  CHECK(load_error(folder) == "fashion-mnist: " + images +
                                  ": more data than its header announces (expected 15696 bytes "
                                  "after decompression)");
}

TEST_CASE("a gzip file with more data than its header announces is refused") {
  Folder folder;
  write_split(folder, 4);
  const std::string labels = folder.file("t10k-labels-idx1-ubyte.gz");
  troupe::test::write_gz(labels, troupe::test::idx_bytes(0x801, {4}, 5, true));
  CHECK(load_error(folder) ==
        "fashion-mnist: " + labels +
            ": more data than its header announces (expected 12 bytes after decompression)");
}

TEST_CASE("a run that would train no step or score nothing is refused naming the sizes") {
  CHECK(trainable_error(3, 1, 64, 10000) ==
        "fashion-mnist: /data: batch 64 per rank is larger than each rank's shard of 3 training "
        "image(s) (3 over 1 rank(s)), so no step would run (expected a batch of at most 3)");
  CHECK(trainable_error(60000, 8, 7501, 10000).find("shard of 7500 training image(s)") !=
        std::string::npos);
  CHECK(trainable_error(60000, 8, 7500, 10000) == "");
  CHECK(trainable_error(60000, 1, 64, 0) ==
        "fashion-mnist: /data: the test set holds no images, so no accuracy can be measured "
        "(expected at least 1 test image)");
  CHECK(trainable_error(3, 4, 1, 10) ==
        "fashion-mnist: /data: 3 training images cannot be split over 4 rank(s) (expected at "
        "least one image per rank)");
}
