#pragma once
// Test support: small Fashion-MNIST-shaped data sets written as the gzip-compressed IDX files the
// example reads (examples/fashion_mnist/dataset.h), with pseudo-random pixels and labels.
#include <zlib.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe::test {

/// An IDX file: the big-endian magic number and sizes, then `payload` bytes from a fixed
/// pseudo-random sequence (taken mod 10 when `labels`).
inline std::vector<uint8_t> idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims,
                                      size_t payload, bool labels) {
  std::vector<uint8_t> bytes;
  std::vector<uint32_t> fields{magic};
  fields.insert(fields.end(), dims.begin(), dims.end());
  for (uint32_t value : fields)
    for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(uint8_t(value >> shift));
  uint32_t x = 12345;
  for (size_t i = 0; i < payload; ++i) {
    x = x * 1103515245u + 12345u;
    bytes.push_back(uint8_t(labels ? (x >> 16) % 10 : x >> 16));
  }
  return bytes;
}

/// Writes `bytes` gzip-compressed at `level` (0: stored blocks, whose bytes a corruption changes
/// without breaking the deflate format, so that only the CRC can tell).
inline void write_gz(const std::string& path, const std::vector<uint8_t>& bytes, int level = 6) {
  gzFile file = gzopen(path.c_str(), ("wb" + std::to_string(level)).c_str());
  if (file == nullptr) throw std::runtime_error("cannot create " + path);
  const bool written = gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())) ==
                       static_cast<int>(bytes.size());
  if (gzclose(file) != Z_OK || !written) throw std::runtime_error("cannot write " + path);
}

/// The two files of split `prefix` ("train" or "t10k") with `n` images in folder `dir`.
inline void write_split(const std::string& dir, const std::string& prefix, uint32_t n,
                        int level = 6) {
  write_gz(dir + "/" + prefix + "-images-idx3-ubyte.gz",
           idx_bytes(0x803, {n, 28, 28}, size_t{n} * 28 * 28, false), level);
  write_gz(dir + "/" + prefix + "-labels-idx1-ubyte.gz", idx_bytes(0x801, {n}, n, true), level);
}

}  // namespace troupe::test
