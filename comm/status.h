#pragma once
/// Status and Error: how comm/ reports the outcome of an operation.
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

namespace troupe::comm {

/// The outcome of a transport operation or a collective. Cheap to copy when ok.
/// `peer` names the rank the failure is about (-1 when none).
class Status {
 public:
  Status() = default;
  static Status success() { return Status(); }
  static Status failure(std::string message, int peer = -1) {
    Status s;
    s.ok_ = false;
    s.message_ = std::move(message);
    s.peer_ = peer;
    return s;
  }
  bool ok() const { return ok_; }
  const std::string& message() const { return message_; }
  int peer() const { return peer_; }

 private:
  bool ok_ = true;
  std::string message_;
  int peer_ = -1;
};

/// Thrown by the blocking APIs; the message names the thing, the value and what was expected.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, int peer = -1) : std::runtime_error(what), peer_(peer) {}
  /// The rank the error is about, or -1.
  int peer() const { return peer_; }

 private:
  int peer_;
};

/// A number as error messages show it: the shortest form that reads back ("0.01", "1e-05", "2").
inline std::string number_text(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.10g", value);
  return text;
}

}  // namespace troupe::comm
