#pragma once
// SIGSTOP a child process and wait until it has stopped. kill() returns before the child's
// threads have stopped, so a test that goes on at once can still be answered by one of them.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <chrono>
#include <thread>

namespace troupe::test {

/// Stops child `pid` (SIGSTOP) and waits, at most 10 s, for the kernel's report (waitpid,
/// WUNTRACED) that every one of its threads has stopped; fails the test otherwise.
inline void stop_process(pid_t pid) {
  REQUIRE(::kill(pid, SIGSTOP) == 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int status = 0;
  pid_t got = 0;
  while ((got = ::waitpid(pid, &status, WUNTRACED | WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE_MESSAGE((got == pid && WIFSTOPPED(status)),
                  "process " << pid << " did not report stopped within 10 s of SIGSTOP");
}

}  // namespace troupe::test
