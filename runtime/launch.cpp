#include "runtime/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iterator>
#include <optional>
#include <sstream>

#include "comm/status.h"

extern char** environ;

namespace troupe {
namespace {

using comm::Error;
using Clock = std::chrono::steady_clock;

constexpr double kStartTimeoutSec = 10;   // fork to exec of one rank
constexpr double kReapAfterKillSec = 5;   // SIGKILL to reaped
constexpr double kDrainAfterKillSec = 1;  // output still buffered in pipes after SIGKILL
constexpr int kTickMs = 20;               // how often exits are polled while ranks run
constexpr size_t kMaxLine = 64 * 1024;    // longer lines are forwarded in pieces
const char* const kRankVars[] = {"RANK",             "WORLD_SIZE",  "LOCAL_RANK",
                                 "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};

Clock::duration span(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

Clock::time_point after(double seconds) { return Clock::now() + span(seconds); }

std::string seconds_text(double seconds) {
  std::ostringstream s;
  s << seconds << " s";
  return s.str();
}

/// A pipe whose ends are close-on-exec and above 2, so dup2 onto 0..2 in the child never clobbers.
void make_pipe(int fds[2]) {
  if (pipe2(fds, O_CLOEXEC) != 0) throw Error(std::string("pipe2 failed: ") + strerror(errno));
  for (int i = 0; i < 2; ++i) {
    if (fds[i] > 2) continue;
    int moved = fcntl(fds[i], F_DUPFD_CLOEXEC, 3);
    close(fds[i]);
    fds[i] = moved;
  }
}

void close_fd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

/// Where the launcher's SIGINT/SIGTERM handler writes the signal number (-1: no launch owns it).
std::atomic<int> g_signal_fd{-1};

extern "C" void on_launcher_signal(int sig) {
  int saved = errno;
  int fd = g_signal_fd.load();
  unsigned char byte = static_cast<unsigned char>(sig);
  if (fd >= 0) (void)!write(fd, &byte, 1);
  errno = saved;
}

/// While alive, SIGINT and SIGTERM sent to the launcher become bytes on read_fd() (self-pipe), so
/// the poll loop can stop the ranks. Only the first of concurrent launches takes the signals.
class SignalCatcher {
 public:
  SignalCatcher() {
    make_pipe(fds_);
    fcntl(fds_[0], F_SETFL, O_NONBLOCK);
    fcntl(fds_[1], F_SETFL, O_NONBLOCK);
    int expected = -1;
    owner_ = g_signal_fd.compare_exchange_strong(expected, fds_[1]);
    if (!owner_) return;
    struct sigaction action {};
    action.sa_handler = on_launcher_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~SignalCatcher() {
    if (owner_) {
      sigaction(SIGINT, &old_int_, nullptr);
      sigaction(SIGTERM, &old_term_, nullptr);
      g_signal_fd.store(-1);
    }
    close_fd(fds_[0]);
    close_fd(fds_[1]);
  }
  SignalCatcher(const SignalCatcher&) = delete;
  SignalCatcher& operator=(const SignalCatcher&) = delete;
  int read_fd() const { return fds_[0]; }
  /// The signal received, or 0.
  int take() {
    unsigned char byte = 0;
    return read(fds_[0], &byte, 1) == 1 ? byte : 0;
  }

 private:
  int fds_[2] = {-1, -1};
  bool owner_ = false;
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

/// execvp's lookup done in the parent (so nothing unsafe runs between fork and exec): the path
/// to execute, or nullopt when `program` does not exist.
std::optional<std::string> resolve_program(const std::string& program, const std::string& path) {
  if (program.empty()) return std::nullopt;
  if (program.find('/') != std::string::npos) {
    if (access(program.c_str(), F_OK) == 0) return program;
    return std::nullopt;
  }
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t end = std::min(path.find(':', pos), path.size());
    std::string dir = path.substr(pos, end - pos);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    struct stat info {};
    if (stat(candidate.c_str(), &info) == 0 && S_ISREG(info.st_mode) &&
        access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    pos = end + 1;
  }
  return std::nullopt;
}

bool is_rank_var(const std::string& name) {
  return std::any_of(std::begin(kRankVars), std::end(kRankVars),
                     [&](const char* var) { return name == var; });
}

/// All that a child needs, prepared before fork: after fork only async-signal-safe calls run.
struct ChildSetup {
  const char* path;
  char* const* argv;
  char* const* envp;
  int stdin_fd, stdout_fd, stderr_fd, exec_error_fd;
  pid_t parent;
  sigset_t mask;
};

[[noreturn]] void exec_child(const ChildSetup& setup) {
  setpgid(0, 0);
#ifdef __linux__
  // A launcher killed with SIGKILL cannot stop its ranks; the kernel does it for it.
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != setup.parent) _exit(1);
#endif
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGPIPE, SIGCHLD, SIGXFSZ}) sigaction(sig, &fallback, nullptr);
  sigprocmask(SIG_SETMASK, &setup.mask, nullptr);
  if (dup2(setup.stdin_fd, 0) >= 0 && dup2(setup.stdout_fd, 1) >= 0 &&
      dup2(setup.stderr_fd, 2) >= 0) {
    execve(setup.path, setup.argv, setup.envp);
  }
  int error = errno;
  (void)!write(setup.exec_error_fd, &error, sizeof error);
  _exit(error == ENOENT ? 127 : 126);
}

/// Runs one launch: the ranks, their pipes, and the stop sequence.
class Launcher {
 public:
  Launcher(const LaunchOptions& options, std::ostream& out, std::ostream& err)
      : options_(options), out_(out), err_(err), ranks_(options.nprocs) {}

  ~Launcher() {
    // Only reached with ranks alive when something threw: leave no orphans or zombies.
    for (Rank& rank : ranks_) {
      if (rank.running) {
        kill(-rank.pid, SIGKILL);
        waitpid(rank.pid, nullptr, 0);
      }
      for (Output& output : rank.outputs) close_fd(output.fd);
    }
  }
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  LaunchResult run(const std::string& path, int port);

 private:
  struct Output {
    int fd = -1;
    std::string partial;
  };
  struct Rank {
    pid_t pid = -1;
    bool running = false;
    int exit_code = -1;
    bool exec_failed = false;  // exits by itself at once; a signal would mask its status
    Output outputs[2];  // stdout, stderr
  };

  std::vector<std::string> child_env(int rank, int port) const;
  bool start_rank(int rank, const std::string& path, int port, int stdin_fd);
  void forward(int rank, int which, const char* data, size_t size);
  void emit(int rank, int which, const char* data, size_t size);
  void end_output(int rank, int which);
  void reap();
  void begin_stop(std::string reason, int exit_code, int failed_rank);
  void signal_groups(int sig);
  bool any_running() const;
  bool any_output_open() const;

  const LaunchOptions& options_;
  std::ostream& out_;
  std::ostream& err_;
  std::vector<Rank> ranks_;
  LaunchResult result_;
  bool stopping_ = false;
  std::string reason_;
  std::vector<int> stopped_;
  Clock::time_point kill_at_;
};

std::vector<std::string> Launcher::child_env(int rank, int port) const {
  std::vector<std::string> env;
  auto overridden = [&](const std::string& name) {
    return is_rank_var(name) ||
           std::any_of(options_.extra_env.begin(), options_.extra_env.end(),
                       [&](const auto& kv) { return kv.first == name; });
  };
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string text = *entry;
    if (!overridden(text.substr(0, text.find('=')))) env.push_back(text);
  }
  for (const auto& [name, value] : options_.extra_env) {
    if (!is_rank_var(name)) env.push_back(name + "=" + value);
  }
  const std::string values[] = {std::to_string(rank),          std::to_string(options_.nprocs),
                                std::to_string(rank),          std::to_string(options_.nprocs),
                                options_.master_addr,          std::to_string(port)};
  for (size_t i = 0; i < std::size(kRankVars); ++i) env.push_back(kRankVars[i] + ("=" + values[i]));
  return env;
}

bool Launcher::start_rank(int r, const std::string& path, int port, int stdin_fd) {
  std::vector<std::string> env = child_env(r, port);
  std::vector<char*> envp, argv;
  for (std::string& entry : env) envp.push_back(entry.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = options_.command;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);

  int out_pipe[2], err_pipe[2], exec_pipe[2];
  make_pipe(out_pipe);
  make_pipe(err_pipe);
  make_pipe(exec_pipe);
  ChildSetup setup{path.c_str(), argv.data(), envp.data(), stdin_fd, out_pipe[1], err_pipe[1],
                   exec_pipe[1], getpid(), {}};
  // Block every signal across fork so the child never runs the launcher's handler.
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &setup.mask);
  pid_t pid = fork();
  if (pid == 0) exec_child(setup);
  int fork_error = errno;
  pthread_sigmask(SIG_SETMASK, &setup.mask, nullptr);
  close(out_pipe[1]);
  close(err_pipe[1]);
  close(exec_pipe[1]);
  Rank& rank = ranks_[r];
  if (pid < 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    close(exec_pipe[0]);
    begin_stop("could not start rank " + std::to_string(r) + ": fork failed: " +
                   strerror(fork_error), 126, r);
    return false;
  }
  setpgid(pid, pid);  // also done by the child; whichever runs first wins the race
  rank.pid = pid;
  rank.running = true;
  rank.outputs[0].fd = out_pipe[0];
  rank.outputs[1].fd = err_pipe[0];

  // exec closes the write end (EOF); a failed exec writes its errno first.
  auto deadline = after(kStartTimeoutSec);
  int exec_errno = 0;
  ssize_t got = -1;
  while (Clock::now() < deadline) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd pfd{exec_pipe[0], POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(left)) <= 0) continue;
    got = read(exec_pipe[0], &exec_errno, sizeof exec_errno);
    if (got >= 0 || errno != EINTR) break;
  }
  close(exec_pipe[0]);
  if (got == 0) return true;
  if (got == static_cast<ssize_t>(sizeof exec_errno)) {
    rank.exec_failed = true;
    begin_stop("rank " + std::to_string(r) + " could not execute '" + path + "': " +
                   strerror(exec_errno), exec_errno == ENOENT ? 127 : 126, r);
  } else {
    begin_stop("rank " + std::to_string(r) + " did not start within " +
                   seconds_text(kStartTimeoutSec), 126, r);
  }
  return false;
}

void Launcher::emit(int rank, int which, const char* data, size_t size) {
  std::ostream& os = which == 0 ? out_ : err_;
  os << "[rank " << rank << "] ";
  os.write(data, static_cast<std::streamsize>(size));
  os << '\n';
}

void Launcher::forward(int rank, int which, const char* data, size_t size) {
  std::ostream& os = which == 0 ? out_ : err_;
  if (!options_.prefix_output) {
    os.write(data, static_cast<std::streamsize>(size));
    os.flush();
    return;
  }
  std::string& partial = ranks_[rank].outputs[which].partial;
  partial.append(data, size);
  size_t begin = 0;
  for (size_t nl; (nl = partial.find('\n', begin)) != std::string::npos; begin = nl + 1) {
    emit(rank, which, partial.data() + begin, nl - begin);
  }
  partial.erase(0, begin);
  if (partial.size() >= kMaxLine) {
    emit(rank, which, partial.data(), partial.size());
    partial.clear();
  }
  os.flush();
}

void Launcher::end_output(int rank, int which) {
  Output& output = ranks_[rank].outputs[which];
  if (!output.partial.empty()) {
    emit(rank, which, output.partial.data(), output.partial.size());
    output.partial.clear();
    (which == 0 ? out_ : err_).flush();
  }
  close_fd(output.fd);
}

void Launcher::reap() {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    Rank& rank = ranks_[r];
    if (!rank.running) continue;
    int status = 0;
    pid_t pid = waitpid(rank.pid, &status, WNOHANG);
    if (pid == 0 || (pid < 0 && errno == EINTR)) continue;
    rank.running = false;
    if (pid < 0) {
      rank.exit_code = 0;  // ECHILD: reaped elsewhere (SIGCHLD ignored); the status is lost
      continue;
    }
    std::string what = "rank " + std::to_string(r);
    if (WIFSIGNALED(status)) {
      rank.exit_code = 128 + WTERMSIG(status);
      what += " was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
              strsignal(WTERMSIG(status)) + ")";
    } else {
      rank.exit_code = WEXITSTATUS(status);
      what += " exited with status " + std::to_string(rank.exit_code);
    }
    if (rank.exit_code != 0 && !stopping_) begin_stop(what, rank.exit_code, static_cast<int>(r));
  }
}

void Launcher::begin_stop(std::string reason, int exit_code, int failed_rank) {
  stopping_ = true;
  reason_ = std::move(reason);
  result_.exit_code = exit_code;
  result_.failed_rank = failed_rank;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (ranks_[r].running && static_cast<int>(r) != failed_rank) stopped_.push_back(r);
  }
  signal_groups(SIGTERM);
  kill_at_ = after(options_.grace_sec);
}

void Launcher::signal_groups(int sig) {
  // A rank whose pipes are still open after it exited left descendants behind in its group.
  for (const Rank& rank : ranks_) {
    bool open = rank.outputs[0].fd >= 0 || rank.outputs[1].fd >= 0;
    if (rank.pid > 0 && !rank.exec_failed && (rank.running || open)) kill(-rank.pid, sig);
  }
}

bool Launcher::any_running() const {
  return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
}

bool Launcher::any_output_open() const {
  return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
    return r.outputs[0].fd >= 0 || r.outputs[1].fd >= 0;
  });
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

LaunchResult Launcher::run(const std::string& path, int port) {
  SignalCatcher signals;
  int stdin_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (stdin_fd >= 0 && stdin_fd <= 2) {
    int moved = fcntl(stdin_fd, F_DUPFD_CLOEXEC, 3);
    close(stdin_fd);
    stdin_fd = moved;
  }
  if (stdin_fd < 0) throw Error(std::string("cannot open /dev/null: ") + strerror(errno));
  std::optional<Clock::time_point> timeout_at;
  if (options_.timeout_sec > 0) timeout_at = after(options_.timeout_sec);
  for (int r = 0; r < options_.nprocs && !stopping_; ++r) start_rank(r, path, port, stdin_fd);
  close(stdin_fd);

  std::optional<Clock::time_point> killed_at, drain_until;
  std::vector<int> unreaped;
  std::vector<char> buffer(kMaxLine);
  while (true) {
    auto now = Clock::now();
    bool running = any_running();
    if (!running && !any_output_open()) break;
    if (!running && !drain_until) {
      drain_until = stopping_ ? std::max(now, kill_at_) + span(kDrainAfterKillSec)
                              : after(options_.grace_sec);
    }
    if (drain_until && now >= *drain_until) break;
    if (!stopping_ && timeout_at && now >= *timeout_at) {
      begin_stop("timed out after " + seconds_text(options_.timeout_sec), 124, -1);
    }
    if (stopping_ && !killed_at && now >= kill_at_) {
      signal_groups(SIGKILL);
      killed_at = now;
    }
    if (killed_at && running && now >= *killed_at + span(kReapAfterKillSec)) {
      for (size_t r = 0; r < ranks_.size(); ++r) {
        if (!ranks_[r].running) continue;
        unreaped.push_back(r);
        ranks_[r].running = false;  // abandoned: waiting longer would break the deadline
      }
      break;
    }

    std::vector<pollfd> fds{{signals.read_fd(), POLLIN, 0}};
    std::vector<std::pair<int, int>> owners{{-1, -1}};
    for (size_t r = 0; r < ranks_.size(); ++r) {
      for (int which = 0; which < 2; ++which) {
        if (ranks_[r].outputs[which].fd < 0) continue;
        fds.push_back({ranks_[r].outputs[which].fd, POLLIN, 0});
        owners.emplace_back(r, which);
      }
    }
    std::vector<Clock::time_point> deadlines;
    if (running) deadlines.push_back(now + std::chrono::milliseconds(kTickMs));
    if (!stopping_ && timeout_at) deadlines.push_back(*timeout_at);
    if (stopping_ && !killed_at) deadlines.push_back(kill_at_);
    if (killed_at) deadlines.push_back(*killed_at + span(kReapAfterKillSec));
    if (drain_until) deadlines.push_back(*drain_until);
    auto next = *std::min_element(deadlines.begin(), deadlines.end());
    auto wait_ms = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
    int ready = poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(wait_ms, 0)));

    for (size_t i = 0; ready > 0 && i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      if (i == 0) {
        int sig = signals.take();
        if (sig != 0 && !stopping_) {
          begin_stop(std::string("launcher received ") + (sig == SIGINT ? "SIGINT" : "SIGTERM"),
                     128 + sig, -1);
        } else if (sig != 0) {
          kill_at_ = Clock::now();  // a second signal: do not wait out the grace period
        }
        continue;
      }
      auto [r, which] = owners[i];
      ssize_t got = read(fds[i].fd, buffer.data(), buffer.size());
      if (got > 0) {
        forward(r, which, buffer.data(), static_cast<size_t>(got));
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        end_output(r, which);
      }
    }
    reap();
  }

  for (size_t r = 0; r < ranks_.size(); ++r) {
    for (int which = 0; which < 2; ++which) end_output(static_cast<int>(r), which);
    result_.rank_exit_codes.push_back(ranks_[r].exit_code);
  }
  if (!stopping_) {
    result_.message = "all " + std::to_string(options_.nprocs) + " ranks exited with status 0";
    return result_;
  }
  result_.message = reason_;
  if (!stopped_.empty()) result_.message += "; stopped ranks " + rank_list(stopped_);
  std::vector<int> not_started;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (ranks_[r].pid < 0) not_started.push_back(r);
  }
  if (!not_started.empty()) result_.message += "; ranks " + rank_list(not_started) + " not started";
  if (!unreaped.empty()) {
    result_.message += "; ranks " + rank_list(unreaped) + " did not exit within " +
                       seconds_text(kReapAfterKillSec) + " of SIGKILL";
  }
  return result_;
}

void check_options(const LaunchOptions& o) {
  auto bad = [](const std::string& what, const std::string& expected) {
    throw Error("LaunchOptions." + what + " (expected " + expected + ")");
  };
  if (o.nprocs < 1) bad("nprocs=" + std::to_string(o.nprocs) + " is not positive", "at least 1");
  if (o.command.empty()) bad("command is empty", "a program and its arguments");
  if (o.master_addr.empty()) bad("master_addr is empty", "a host name or IP address");
  if (o.master_port < 0 || o.master_port > 65535) {
    bad("master_port=" + std::to_string(o.master_port) + " is out of range",
        "0..65535, 0 to pick a free port");
  }
  if (!(o.timeout_sec >= 0)) {
    bad("timeout_sec=" + std::to_string(o.timeout_sec) + " is invalid", "0 or more seconds");
  }
  if (!(o.grace_sec >= 0)) {
    bad("grace_sec=" + std::to_string(o.grace_sec) + " is invalid", "0 or more seconds");
  }
}

}  // namespace

LaunchResult launch(const LaunchOptions& options, std::ostream& out, std::ostream& err) {
  check_options(options);
  const char* inherited_path = std::getenv("PATH");
  std::string search_path = inherited_path ? inherited_path : "/usr/local/bin:/usr/bin:/bin";
  for (const auto& [name, value] : options.extra_env) {
    if (name == "PATH") search_path = value;
  }
  std::optional<std::string> path = resolve_program(options.command[0], search_path);
  if (!path) {
    LaunchResult result;
    result.exit_code = 127;
    result.rank_exit_codes.assign(options.nprocs, -1);
    result.message = "cannot start '" + options.command[0] + "': " +
                     (options.command[0].find('/') == std::string::npos
                          ? "not found in PATH (expected an executable file)"
                          : "no such file (expected an executable file)");
    return result;
  }
  int port = options.master_port != 0 ? options.master_port : pick_free_port();
  Launcher launcher(options, out, err);
  return launcher.run(*path, port);
}

int pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("pick_free_port: socket() failed: ") + strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof address;
  bool ok = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  int error = errno;
  close(fd);
  if (!ok) {
    throw Error(std::string("pick_free_port: binding 127.0.0.1:0 failed: ") + strerror(error));
  }
  return ntohs(address.sin_port);
}

}  // namespace troupe
