#pragma once
/// StateWriter and StateReader: an object's state across steps (error-feedback memory, PowerSGD's
/// Q, a step counter) as bytes, and back. Checkpoints (rank/checkpoint.h) and the healing of a
/// rejoining rank both move training state as these bytes.
///
/// The format is the writer's native byte order (every machine troupe runs on is little-endian),
/// without names or types: a reader reads back exactly what its writer wrote, in order. A vector
/// travels as its length and then its elements in one copy, so a bucket's residual costs one
/// memcpy, not one call per element. A reader never reads past its end: a short or inconsistent
/// state throws comm::Error naming what was being read (`what`) and what was expected.
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/status.h"

namespace troupe::comm {

/// Appends an object's state to a byte string.
class StateWriter {
 public:
  explicit StateWriter(std::string& out) : out_(out) {}

  /// A trivially copyable value (an integer, a double, a flag), as its bytes.
  template <class T>
  void value(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>, "StateWriter::value needs a plain value");
    bytes(&v, sizeof(T));
  }
  /// The length, then the elements.
  template <class T>
  void vector(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>, "StateWriter::vector needs plain elements");
    value<uint64_t>(v.size());
    bytes(v.data(), v.size() * sizeof(T));
  }
  void string(const std::string& s) {
    value<uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  void bytes(const void* data, size_t size) {
    if (size) out_.append(static_cast<const char*>(data), size);
  }
  size_t size() const { return out_.size(); }

 private:
  std::string& out_;
};

/// Reads back what a StateWriter wrote. `what` names the state in errors ("bucket 2 of
/// DistributedModule (topk)").
class StateReader {
 public:
  StateReader(const char* data, size_t size, std::string what)
      : data_(data), size_(size), what_(std::move(what)) {}
  StateReader(const std::string& bytes, std::string what)
      : StateReader(bytes.data(), bytes.size(), std::move(what)) {}

  template <class T>
  T value() {
    static_assert(std::is_trivially_copyable_v<T>, "StateReader::value needs a plain value");
    T v;
    bytes(&v, sizeof(T));
    return v;
  }
  /// A vector of any length.
  template <class T>
  std::vector<T> vector() {
    static_assert(std::is_trivially_copyable_v<T>, "StateReader::vector needs plain elements");
    const auto n = value<uint64_t>();
    if (n > remaining() / (sizeof(T) ? sizeof(T) : 1))
      fail(std::to_string(n) + " elements announced, " + std::to_string(remaining()) +
           " bytes left");
    std::vector<T> v(static_cast<size_t>(n));
    bytes(v.data(), v.size() * sizeof(T));
    return v;
  }
  /// A vector that must have `expected` elements (the size the object has now).
  template <class T>
  std::vector<T> vector(size_t expected, const char* name) {
    auto v = vector<T>();
    if (v.size() != expected)
      fail(std::string(name) + " has " + std::to_string(v.size()) + " elements, expected " +
           std::to_string(expected) + " (another model, bucket layout or algorithm setting?)");
    return v;
  }
  std::string string() {
    const auto n = value<uint64_t>();
    if (n > remaining())
      fail(std::to_string(n) + " bytes of text announced, " + std::to_string(remaining()) +
           " left");
    std::string s(data_ + at_, static_cast<size_t>(n));
    at_ += static_cast<size_t>(n);
    return s;
  }
  void bytes(void* out, size_t size) {
    if (size > remaining())
      fail("needs " + std::to_string(size) + " more bytes, " + std::to_string(remaining()) +
           " left");
    if (size) std::memcpy(out, data_ + at_, size);
    at_ += size;
  }
  /// The next `size` bytes, without copying (valid while the reader's bytes are).
  const char* take(size_t size) {
    if (size > remaining())
      fail("needs " + std::to_string(size) + " more bytes, " + std::to_string(remaining()) +
           " left");
    const char* p = data_ + at_;
    at_ += size;
    return p;
  }
  size_t remaining() const { return size_ - at_; }
  /// Throws unless every byte was read.
  void expect_end() const {
    if (remaining() != 0) fail(std::to_string(remaining()) + " bytes left over after the state");
  }
  const std::string& what() const { return what_; }
  [[noreturn]] void fail(const std::string& problem) const {
    throw Error("state of " + what_ + ": " + problem);
  }

 private:
  const char* data_;
  size_t size_;
  size_t at_ = 0;
  std::string what_;
};

}  // namespace troupe::comm
