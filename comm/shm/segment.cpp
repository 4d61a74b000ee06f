#include "comm/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "comm/status.h"

namespace troupe::comm {
namespace {

void check_name(const std::string& name) {
  bool ok = name.size() >= 2 && name.size() <= 201 && name[0] == '/';
  for (size_t i = 1; ok && i < name.size(); ++i) {
    const char c = name[i];
    ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.';
  }
  if (!ok)
    throw Error("shared segment name '" + name +
                "': expected '/' then 1 to 200 letters, digits, '-', '_' or '.'");
}

[[noreturn]] void fail(const std::string& name, const char* call, int error) {
  throw Error("shared segment '" + name + "': " + call + " failed: " + std::strerror(error));
}

char* map(const std::string& name, int fd, size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int error = errno;
    ::close(fd);
    fail(name, "mmap", error);
  }
  ::close(fd);
  return static_cast<char*>(p);
}

}  // namespace

std::shared_ptr<SharedSegment> SharedSegment::create(const std::string& name, size_t bytes) {
  check_name(name);
  if (bytes == 0) throw Error("shared segment '" + name + "': size 0 (expected > 0)");
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) fail(name, "shm_open(O_CREAT|O_EXCL)", errno);
  // posix_fallocate, not ftruncate: a full /dev/shm fails here, not with SIGBUS at first touch.
  const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (error != 0) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    fail(name, ("posix_fallocate(" + std::to_string(bytes) + " bytes)").c_str(), error);
  }
  char* data = nullptr;
  try {
    data = map(name, fd, bytes);
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
  return std::shared_ptr<SharedSegment>(new SharedSegment(name, data, bytes, true));
}

std::shared_ptr<SharedSegment> SharedSegment::open(const std::string& name, size_t bytes) {
  check_name(name);
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) fail(name, "shm_open", errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    fail(name, "fstat", error);
  }
  if (static_cast<size_t>(st.st_size) != bytes) {
    ::close(fd);
    throw Error("shared segment '" + name + "' is " + std::to_string(st.st_size) +
                " bytes (expected " + std::to_string(bytes) + ")");
  }
  return std::shared_ptr<SharedSegment>(
      new SharedSegment(name, map(name, fd, bytes), bytes, false));
}

SharedSegment::SharedSegment(std::string name, char* data, size_t size, bool owner)
    : name_(std::move(name)), data_(data), size_(size), linked_(owner) {}

SharedSegment::~SharedSegment() {
  unlink();
  ::munmap(data_, size_);
}

void SharedSegment::unlink() {
  if (!linked_) return;
  linked_ = false;
  ::shm_unlink(name_.c_str());
}

}  // namespace troupe::comm
