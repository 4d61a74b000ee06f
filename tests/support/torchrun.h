#pragma once
// Test support: torchrun (of the torch troupe is built against) and the Python it runs (its #!
// line), for the tests that talk to PyTorch's own launcher and TCPStore; both "" where PyTorch is
// not installed.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace troupe::test {

/// The first executable `name` in PATH, or "".
inline std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (dir.empty()) continue;
    const std::string candidate = dir + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

/// torchrun's path: the one CMake found beside the LibTorch troupe is built against, else the
/// first on PATH, else "".
inline std::string torchrun() {
#ifdef TROUPE_TORCHRUN
  if (access(TROUPE_TORCHRUN, X_OK) == 0) return TROUPE_TORCHRUN;
#endif
  return find_on_path("torchrun");
}

/// The interpreter of torchrun's #! line (the Python that has torch), or "".
inline std::string torch_python() {
  const std::string script = torchrun();
  if (script.empty()) return "";
  std::ifstream in(script);
  std::string line;
  if (!std::getline(in, line) || line.rfind("#!", 0) != 0) return "";
  std::stringstream words(line.substr(2));
  std::string interpreter;
  words >> interpreter;
  if (interpreter.size() >= 8 && interpreter.substr(interpreter.size() - 8) == "/bin/env")
    words >> interpreter;
  return interpreter;
}

}  // namespace troupe::test
