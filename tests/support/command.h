#pragma once
// Test support: runs a shell command and keeps its exit status and everything it printed
// (stdout and stderr together), as the process tests check the tools' messages.
#include <cstdio>
#include <string>

namespace troupe::test {

struct Output {
  int status;        // as pclose returns it (-1 when the command could not be started)
  std::string text;  // stdout and stderr, interleaved as printed
};

inline Output run(const std::string& command) {
  Output out{-1, {}};
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.text.append(buf, n);
  out.status = pclose(pipe);
  return out;
}

}  // namespace troupe::test
