#pragma once
/// SharedSegment: a POSIX shared-memory object (shm_open + mmap), created by one process and
/// mapped by the others of the same host.
///
/// The creator may unlink the name as soon as every peer has mapped it: the memory lives on
/// while any mapping does, and nothing is left in /dev/shm if a process dies later.
#include <cstddef>
#include <memory>
#include <string>

namespace troupe::comm {

class SharedSegment {
 public:
  /// Creates `name` ("/" then up to 200 letters, digits, '-', '_' or '.') of `bytes` bytes,
  /// zero-filled, and maps it. Throws comm::Error naming the segment, the call and errno's text
  /// (e.g. when the name exists already or /dev/shm is full).
  static std::shared_ptr<SharedSegment> create(const std::string& name, size_t bytes);
  /// Maps an existing segment, which must be exactly `bytes` long (else comm::Error naming the
  /// segment, its size and the size expected).
  static std::shared_ptr<SharedSegment> open(const std::string& name, size_t bytes);

  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  /// Removes the name (created segments only; again or on a mapped one: nothing).
  void unlink();

  char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  SharedSegment(std::string name, char* data, size_t size, bool owner);

  std::string name_;
  char* data_;
  size_t size_;
  bool linked_;  // created here and not unlinked yet
};

}  // namespace troupe::comm
