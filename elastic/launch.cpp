#include "elastic/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>

#include "comm/status.h"
#include "comm/wire/rendezvous_wire.h"
#include "elastic/membership.h"
#include "elastic/membership_link.h"
#include "rank/compute_threads.h"
#include "rank/env.h"

extern char** environ;

namespace troupe {
namespace {

using comm::Error;
using Clock = std::chrono::steady_clock;

constexpr double kReapAfterKillSec = 5;  // SIGKILL to reaped and the pipes closed
constexpr int kTickMs = 20;              // how often exits are polled while ranks run
constexpr size_t kMaxLine = 64 * 1024;   // longer lines are forwarded in pieces
constexpr Clock::time_point kNever = Clock::time_point::max();
// torchrun's, in the order of rank_env()'s values.
const std::vector<std::string> kRankVars = {
    "RANK",        "WORLD_SIZE",       "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK",  "GROUP_WORLD_SIZE", "ROLE_RANK",  "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT"};

Clock::duration as_duration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

std::string seconds_text(double seconds) {
  std::ostringstream s;
  s << seconds << " s";
  return s.str();
}

/// "rank 2", "ranks 0, 1, 3", or past 8 ranks "ranks 0, 1, 2, 3, 4, 5, 6, 7, ... (4095 in all)".
std::string ranks_text(const std::vector<int>& ranks) {
  constexpr size_t kShown = 8;
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < kShown; ++i)
    text += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > kShown) text += ", ... (" + std::to_string(ranks.size()) + " in all)";
  return text;
}

/// Moves `fd` above 2 (keeping close-on-exec), so dup2 onto 0..2 in a child never clobbers it.
int above_stdio(int fd) {
  if (fd < 0 || fd > 2) return fd;
  int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  close(fd);
  return moved;
}

void make_pipe(int fds[2], int flags = 0) {
  if (pipe2(fds, O_CLOEXEC | flags) != 0) throw Error(std::string("pipe2: ") + strerror(errno));
  fds[0] = above_stdio(fds[0]);
  fds[1] = above_stdio(fds[1]);
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

/// One launch: the ranks, their pipes, the launcher's signals, and the stop sequence.
class Launcher {
 public:
  Launcher(const LaunchOptions& options, std::ostream& out, std::ostream& err)
      : options_(options), streams_{&out, &err}, ranks_(options.nprocs + options.spares) {
    job_id_ = make_job_id();
    // SIGINT/SIGTERM become bytes on a pipe that the poll loop watches; only the first of
    // concurrent launches takes them.
    make_pipe(signal_pipe_, O_NONBLOCK);
    int expected = -1;
    owns_signals_ = g_signal_fd.compare_exchange_strong(expected, signal_pipe_[1]);
    if (!owns_signals_) return;
    struct sigaction action {};
    action.sa_handler = on_launcher_signal;
    action.sa_flags = SA_RESTART;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_actions_[0]);
    sigaction(SIGTERM, &action, &old_actions_[1]);
  }

  ~Launcher() {
    // Ranks still run here only when something threw: leave no orphans or zombies.
    for (Rank& rank : ranks_) {
      if (rank.running) kill(-rank.pid, SIGKILL);
      if (rank.running) waitpid(rank.pid, nullptr, 0);
      close_fd(rank.fds[0]);
      close_fd(rank.fds[1]);
    }
    if (owns_signals_) {
      sigaction(SIGINT, &old_actions_[0], nullptr);
      sigaction(SIGTERM, &old_actions_[1], nullptr);
      g_signal_fd.store(-1);
    }
    close_fd(signal_pipe_[0]);
    close_fd(signal_pipe_[1]);
  }

  LaunchResult run(int port);

 private:
  /// Elastic: node 0's membership service and, with several nodes, the link between the nodes'
  /// launchers (node 0's hub, the others' relays).
  void start_membership(int port);
  void link_nodes(int port, std::chrono::milliseconds membership_timeout);

  /// Forwards the ranks' output and reaps them until neither ranks nor their output remain, or
  /// until the stop sequence gives up on them.
  void supervise();
  bool local_running() const;
  /// Node 0 of several: whether a rank of another node lives.
  bool remote_alive() const;
  /// Whether a rank runs here, or (node 0 of several) the other nodes still need the service.
  bool running();
  /// The job's timeout, the membership's news and the stop sequence's phases, at `now`.
  void check_deadlines(Clock::time_point now);
  /// What one poll watches: the signal pipe first, then each descriptor's owner (slot and
  /// stdout/stderr, a membership socket's slot, or a membership link's tag).
  struct PollSet {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, int>> owners;
  };
  PollSet poll_set() const;
  /// Waits for the next event or deadline and handles what became ready.
  void poll_once(Clock::time_point now, std::vector<char>& buffer);
  /// SIGINT or SIGTERM reached the launcher: the first starts the stop sequence, a second ends
  /// its grace period.
  void on_signal(Clock::time_point now);

  /// After the ranks: forwards their last partial lines, records their exit codes and the ranks
  /// never started; returns how many waiting spares were stopped.
  int close_outputs(std::vector<int>& not_started);
  /// The rank slots of this node that finished with status 0.
  int finished_here() const;
  /// Elastic, a node other than 0: the result as its relay to node 0's service saw the job.
  LaunchResult node_result(int dismissed);
  /// Elastic, node 0 (or the only node): the result as the membership service saw the job.
  LaunchResult service_result(int dismissed);
  /// An elastic launch's result: `what` with the spares stopped and the slots lost; a launch not
  /// `ok` fails, and one whose membership `stopped` says why first.
  LaunchResult elastic_result(std::string what, int dismissed, bool ok, bool stopped,
                              const std::string& stop_reason);
  /// Not elastic: every rank's status, or the first failure and what became of the other ranks.
  LaunchResult local_result(const std::vector<int>& not_started);

  /// Elastic: restarts slot `r` when the launch allows it; false when it does not.
  bool restart(int r);

  struct Rank {
    pid_t pid = -1;
    bool running = false;
    bool dismissed = false;  // a spare stopped because no rank runs any more
    int exit_code = -1;
    int fds[2] = {-1, -1};  // stdout, stderr
    std::string partial[2];
    bool output_open() const { return fds[0] >= 0 || fds[1] >= 0; }
  };

  std::vector<std::string> child_env(int rank, int port) const {
    auto overridden = [&](const std::string& name) {
      return std::count(kRankVars.begin(), kRankVars.end(), name) > 0 ||
             (name == "TROUPE_JOB_ID" && !job_id_.empty()) ||
             std::any_of(options_.extra_env.begin(), options_.extra_env.end(),
                         [&](const auto& kv) { return kv.first == name; });
    };
    std::vector<std::string> env;
    for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
      std::string text = *entry;
      if (!overridden(text.substr(0, text.find('=')))) env.push_back(text);
    }
    for (const auto& [name, value] : options_.extra_env) {
      if (std::count(kRankVars.begin(), kRankVars.end(), name) == 0 &&
          !(name == "TROUPE_JOB_ID" && !job_id_.empty()))  // job_id_ below, once
        env.push_back(name + "=" + value);
    }
    // Spares have slots of their own: RANK is the launch slot (elastic::NodeShape::slot(): with
    // several nodes every node's ranks come first, then every node's spares) and WORLD_SIZE
    // counts every slot.
    LaunchOptions all_slots = options_;
    all_slots.nprocs += options_.spares;
    for (const auto& [name, value] : rank_env(all_slots, rank, port)) {
      if (options_.spares > 0 && (name == "RANK" || name == "ROLE_RANK"))
        env.push_back(name + "=" + std::to_string(global(rank)));
      else if (options_.spares > 0 && (name == "WORLD_SIZE" || name == "ROLE_WORLD_SIZE"))
        env.push_back(name + "=" + std::to_string(shape().slots()));
      else
        env.push_back(name + "=" + value);
    }
    // One launch per host cannot agree on a secret it makes: with several nodes the user exports
    // one (rank 0 warns when its rendezvous is open).
    if (options_.nnodes == 1 && !overridden("TROUPE_JOB_SECRET") &&
        !std::getenv("TROUPE_JOB_SECRET"))
      env.push_back("TROUPE_JOB_SECRET=" + job_secret_);
    if (!job_id_.empty()) env.push_back("TROUPE_JOB_ID=" + job_id_);
    return env;
  }

  // The job's id (LaunchOptions::job_id): given, else from the environment, else one made for a
  // launch of one node.
  // (Set in the constructor: options_ is declared below.)
  std::string job_id_;
  std::string make_job_id() const {
    if (!options_.job_id.empty()) return options_.job_id;
    for (const auto& [name, value] : options_.extra_env)
      if (name == "TROUPE_JOB_ID") return value;
    if (const char* env = std::getenv("TROUPE_JOB_ID"); env && *env) return std::string(env);
    return options_.nnodes == 1 ? actors::wire::random_secret(16) : std::string();
  }

  // The job's secret when the launcher's environment has none: one per launch, so only its ranks
  // can join its rendezvous.
  const std::string job_secret_ = actors::wire::random_secret();

  /// What the user calls local rank `r`: its RANK.
  int global(int r) const { return shape().slot(options_.node_rank, r); }
  elastic::NodeShape shape() const {
    return {options_.nnodes, options_.nprocs, options_.node_rank, options_.spares};
  }

  void start_rank(int r, int port, bool spare = false);
  /// Elastic: attaches slot `r`'s process to the membership and adds what it reads to `env`;
  /// returns the process's end of the membership socket.
  int attach_membership(int r, bool spare, std::vector<std::string>& env);
  /// Slot `r`'s program could not be executed (`error`, an errno, `why`): the launch fails.
  void cannot_start(int r, int error, const std::string& why);
  int slot_count() const { return static_cast<int>(ranks_.size()); }
  /// Elastic with spares: once no rank (a process a generation took) runs, stops the spares.
  void dismiss_spares();

  void forward(int r, int which, const char* data, size_t size, bool eof) {
    std::ostream& os = *streams_[which];
    std::string& partial = ranks_[r].partial[which];
    auto emit = [&](const char* line, size_t length) {
      os << "[rank " << global(r) << "] ";
      os.write(line, static_cast<std::streamsize>(length)) << '\n';
    };
    if (!options_.prefix_output) {
      os.write(data, static_cast<std::streamsize>(size));
    } else {
      partial.append(data, size);
      size_t begin = 0;
      for (size_t nl; (nl = partial.find('\n', begin)) != std::string::npos; begin = nl + 1) {
        emit(partial.data() + begin, nl - begin);
      }
      partial.erase(0, begin);
      if (!partial.empty() && (eof || partial.size() >= kMaxLine))
        emit(partial.data(), partial.size());
      if (eof || partial.size() >= kMaxLine) partial.clear();
    }
    os.flush();
    if (eof) close_fd(ranks_[r].fds[which]);
  }

  void reap() {
    for (int r = 0; r < slot_count(); ++r) {
      Rank& rank = ranks_[r];
      int status = 0;  // stays 0 (exit 0) on ECHILD: reaped elsewhere when SIGCHLD is ignored
      pid_t pid = rank.running ? waitpid(rank.pid, &status, WNOHANG) : 0;
      if (pid == 0 || (pid < 0 && errno == EINTR)) continue;
      rank.running = false;
      std::string what = options_.elastic ? "rank slot " : "rank ";
      what += std::to_string(global(r));
      if (WIFSIGNALED(status)) {
        rank.exit_code = 128 + WTERMSIG(status);
        what += " was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
                strsignal(WTERMSIG(status)) + ")";
      } else {
        rank.exit_code = WEXITSTATUS(status);
        what += " exited with status " + std::to_string(rank.exit_code);
      }
      if (rank.dismissed) {
        if (membership_) membership_->on_exit(global(r), what);
        if (relay_) relay_->on_exit(r, rank.exit_code, what);
        continue;
      }
      if (options_.elastic) {
        if (membership_) membership_->on_exit(global(r), what);
        if (relay_) relay_->on_exit(r, rank.exit_code, what);
        if (rank.exit_code == 0) finished_ = true;
        if (rank.exit_code != 0 && !stopping_ && !restart(r)) {
          reason_ += (reason_.empty() ? "" : "; ") + what;
        }
        continue;
      }
      if (rank.exit_code != 0 && !stopping_) {
        fail(what, rank.exit_code, global(r), options_.stop_on_failure);
      }
    }
  }

  /// Records a failure of global rank `failed_rank` (-1: none; the first failure sets the
  /// result's code and rank) and, when `stop`, starts stopping every rank.
  void fail(const std::string& reason, int exit_code, int failed_rank, bool stop = true) {
    reason_ += (reason_.empty() ? "" : "; ") + reason;
    if (result_.exit_code == 0) {
      result_.exit_code = exit_code;
      result_.failed_rank = failed_rank;
    }
    if (!stop) return;
    stopping_ = true;
    for (int r = 0; r < slot_count(); ++r) {
      if (ranks_[r].running && global(r) != failed_rank) stopped_.push_back(global(r));
    }
    signal_groups(SIGTERM);
    kill_at_ = Clock::now() + as_duration(options_.grace_sec);
  }

  void signal_groups(int sig) {
    // A rank whose pipes are still open after it exited left descendants behind in its group.
    for (const Rank& rank : ranks_) {
      if (rank.pid > 0 && (rank.running || rank.output_open())) {
        kill(-rank.pid, sig);
      }
    }
  }

  const LaunchOptions& options_;
  std::ostream* streams_[2];
  std::vector<Rank> ranks_;
  int signal_pipe_[2] = {-1, -1};
  bool owns_signals_ = false;
  struct sigaction old_actions_[2] = {};
  LaunchResult result_;
  bool stopping_ = false;
  // Elastic: the membership service, the rendezvous port, restarts used, whether a rank finished.
  std::unique_ptr<elastic::MembershipServer> membership_;
  // Several nodes: node 0 serves the membership to the others' launchers (hub_); another node
  // relays its ranks' sockets to node 0's (relay_).
  std::unique_ptr<elastic::MembershipHub> hub_;
  std::unique_ptr<elastic::MembershipRelay> relay_;
  bool job_stopped() const {
    return (membership_ && membership_->stopped()) || (relay_ && relay_->stopped());
  }
  int port_ = 0;
  int restarts_ = 0;
  std::vector<int> restarts_of_;
  bool finished_ = false;
  bool lost_reported_ = false;
  bool dismiss_sent_ = false;  // node 0 told the other nodes to stop their waiting spares
  std::string reason_;
  std::vector<int> stopped_;
  // Phases: running (until timeout_at_), SIGTERM sent (until kill_at_), SIGKILL sent (until
  // give_up_at_). Once no rank runs, descendants may still hold the pipes: drain until
  // drain_until_, or until give_up_at_ when stopping.
  Clock::time_point timeout_at_ = kNever;
  Clock::time_point kill_at_ = kNever;
  Clock::time_point give_up_at_ = kNever;
  Clock::time_point drain_until_ = kNever;
  // Node 0 of several serves the other nodes until their launchers said bye: while a rank of
  // theirs lives, and then at most a grace period (their launchers end their ranks by then).
  Clock::time_point bye_by_ = kNever;
  std::vector<int> unreaped_;  // abandoned: still running when the stop sequence gave up
};

/// The file that exec would run for `program`: itself when it holds a '/', else the first
/// executable regular file of that name in the launcher's PATH (or /bin:/usr/bin without one).
/// Empty, with `error` set (ENOENT or EACCES), when there is none.
std::string find_program(const std::string& program, int& error) {
  error = 0;
  auto usable = [&](const std::string& path) {
    struct stat info {};
    if (stat(path.c_str(), &info) != 0) return false;
    if (!S_ISREG(info.st_mode) || access(path.c_str(), X_OK) != 0) {
      error = EACCES;
      return false;
    }
    return true;
  };
  if (program.find('/') != std::string::npos) {
    if (usable(program)) return program;
    if (error == 0) error = ENOENT;
    return "";
  }
  const char* env_path = std::getenv("PATH");
  const std::string path = env_path != nullptr ? env_path : "/bin:/usr/bin";
  for (size_t begin = 0; begin <= path.size();) {
    size_t end = path.find(':', begin);
    if (end == std::string::npos) end = path.size();
    const std::string dir = end > begin ? path.substr(begin, end - begin) : ".";
    const std::string candidate = dir + "/" + program;
    if (usable(candidate)) {
      error = 0;
      return candidate;
    }
    begin = end + 1;
  }
  if (error == 0) error = ENOENT;
  return "";
}

/// A starting rank's pipes, each read end first: its stdout, its stderr, and the one on which its
/// exec reports a failure.
struct StartPipes {
  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  int exec[2] = {-1, -1};
};

/// The CPUs this process may run on, in ascending order.
std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

/// LaunchOptions::bind_cores: slot `slot` of `slots` gets the slot-th run of allowed / slots of
/// the launcher's CPUs (check_options made sure there are at least as many as slots).
cpu_set_t slot_cores(int slot, int slots) {
  const std::vector<int> cpus = allowed_cpus();
  const size_t per_slot = cpus.size() / static_cast<size_t>(slots);
  cpu_set_t set;
  CPU_ZERO(&set);
  for (size_t i = 0; i < per_slot; ++i)
    CPU_SET(cpus[static_cast<size_t>(slot) * per_slot + i], &set);
  return set;
}

/// The forked child of start_rank, until exec: only async-signal-safe calls. It takes its own
/// process group (so stopping it reaches its descendants), default signal handling, and stdin
/// from /dev/null (a background group reading the terminal would stop).
[[noreturn]] void exec_rank(const std::string& file, char* const* argv, char* const* envp,
                            const StartPipes& pipes, int membership_fd, pid_t launcher,
                            const cpu_set_t* cores) {
  struct sigaction defaults {};
  defaults.sa_handler = SIG_DFL;
  sigemptyset(&defaults.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGPIPE, SIGCHLD, SIGXFSZ}) sigaction(sig, &defaults, nullptr);
  setpgid(0, 0);
  // Die with the launcher: a SIGKILLed launcher cannot stop its ranks, and they would run on as
  // orphans. The signal comes when the thread that forked exits, which launch() outlives; a
  // launcher that died before prctl is seen by getppid().
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher) _exit(128 + SIGKILL);
  if (membership_fd >= 0) fcntl(membership_fd, F_SETFD, 0);  // the rank keeps its end
  const int null_fd = open("/dev/null", O_RDONLY);
  if (null_fd < 0 || dup2(null_fd, 0) < 0 || dup2(pipes.out[1], 1) < 0 ||
      dup2(pipes.err[1], 2) < 0 || (cores && sched_setaffinity(0, sizeof *cores, cores) != 0)) {
    const int e = errno;
    (void)!write(pipes.exec[1], &e, sizeof e);
    _exit(126);
  }
  execve(file.c_str(), argv, envp);
  const int e = errno;
  (void)!write(pipes.exec[1], &e, sizeof e);
  _exit(e == ENOENT ? 127 : 126);
}

/// The errno that a child's failed exec wrote on `fd` (closed here); none when the exec succeeded.
std::optional<int> exec_error(int& fd) {
  int error = 0;
  ssize_t got = 0;
  do {
    got = read(fd, &error, sizeof error);
  } while (got < 0 && errno == EINTR);
  close_fd(fd);
  if (got != static_cast<ssize_t>(sizeof error)) return std::nullopt;
  return error;
}

void Launcher::start_rank(int r, int port, bool spare) {
  Rank& rank = ranks_[r];
  const std::string& program = options_.command[0];
  int error = 0;
  const std::string file = find_program(program, error);
  if (file.empty()) {
    bool searched = error == ENOENT && program.find('/') == std::string::npos;
    cannot_start(r, error, searched ? "not found in PATH" : strerror(error));
    return;
  }
  // Everything the child needs is built before fork: between fork and exec it may only make
  // async-signal-safe calls (another thread may hold malloc's lock).
  std::vector<std::string> env = child_env(r, port), args = options_.command;
  const int membership_fd = options_.elastic ? attach_membership(r, spare, env) : -1;
  std::vector<char*> envp, argv;
  for (std::string& entry : env) envp.push_back(entry.data());
  for (std::string& arg : args) argv.push_back(arg.data());
  envp.push_back(nullptr);
  argv.push_back(nullptr);
  std::optional<cpu_set_t> cores;
  if (options_.bind_cores) cores = slot_cores(r, slot_count());
  StartPipes pipes;
  make_pipe(pipes.out);
  make_pipe(pipes.err);
  make_pipe(pipes.exec);  // close-on-exec: EOF means the exec succeeded, an int its errno
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int fork_error = errno;
    for (int* fds : {pipes.out, pipes.err, pipes.exec}) {
      close_fd(fds[0]);
      close_fd(fds[1]);
    }
    throw Error("cannot start rank " + std::to_string(global(r)) +
                ": fork: " + strerror(fork_error));
  }
  if (pid == 0)
    exec_rank(file, argv.data(), envp.data(), pipes, membership_fd, launcher,
              cores ? &*cores : nullptr);
  setpgid(pid, pid);  // also here, so that a stop sent at once reaches the group
  if (membership_) membership_->started(global(r));
  if (relay_) relay_->started(r);
  close_fd(pipes.out[1]);
  close_fd(pipes.err[1]);
  close_fd(pipes.exec[1]);
  if (const std::optional<int> failed = exec_error(pipes.exec[0])) {
    // No rank runs a program that could not be executed: reap the child and report it.
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    close_fd(pipes.out[0]);
    close_fd(pipes.err[0]);
    cannot_start(r, *failed, strerror(*failed));
    return;
  }
  rank.pid = pid;
  rank.running = true;
  rank.fds[0] = pipes.out[0];
  rank.fds[1] = pipes.err[0];
}

int Launcher::attach_membership(int r, bool spare, std::vector<std::string>& env) {
  const int membership_fd =
      relay_ ? relay_->attach(r, spare) : membership_->attach(global(r), spare);
  env.push_back("TROUPE_ELASTIC_FD=" + std::to_string(membership_fd));
  // The service's round, from which a rank derives how long it waits for a generation.
  env.push_back("TROUPE_MEMBERSHIP_TIMEOUT_MS=" +
                std::to_string(static_cast<long long>(options_.membership_timeout_sec * 1000)));
  if (spare) {
    // A week without a job deadline: a spare outlives no launcher (it dies with it), but its
    // wait still ends.
    const double wait = options_.timeout_sec > 0 ? options_.timeout_sec : 7 * 24 * 3600.0;
    env.push_back("TROUPE_ELASTIC_SPARE=" +
                  std::to_string(static_cast<long long>(std::ceil(wait))));
  }
  env.push_back("TROUPE_RESTART_COUNT=" + std::to_string(restarts_of_[static_cast<size_t>(r)]));
  return membership_fd;
}

void Launcher::cannot_start(int r, int error, const std::string& why) {
  ranks_[r].exit_code = error == ENOENT ? 127 : 126;
  fail("cannot start '" + options_.command[0] + "' for rank " + std::to_string(global(r)) + ": " +
           why + " (expected an executable file)",
       ranks_[r].exit_code, global(r));
}

bool Launcher::restart(int r) {
  if (restarts_ >= options_.max_restarts || finished_ || job_stopped() ||
      (relay_ && relay_->lost()))
    return false;
  ++restarts_;
  const int count = ++restarts_of_[static_cast<size_t>(r)];
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  *streams_[1] << "troupe launch: restarting rank slot " << global(r) << " (restart " << restarts_
               << " of " << options_.max_restarts << "; this slot's " << count << ")"
               << (options_.spares > 0 ? " as a spare" : "") << " at unix ms " << ms << "\n";
  streams_[1]->flush();
  for (int which = 0; which < 2; ++which)  // the dead process's last partial lines, then its pipes
    if (ranks_[static_cast<size_t>(r)].fds[which] >= 0) forward(r, which, "", 0, true);
  start_rank(r, port_, options_.spares > 0);
  return ranks_[static_cast<size_t>(r)].running;
}

void Launcher::dismiss_spares() {
  if (!options_.elastic) return;
  if (membership_) {
    // A rank of any node still runs (or, on one node, a process that is not a waiting spare).
    if (membership_->rank_alive()) return;
    for (int r = 0; r < slot_count(); ++r)
      if (ranks_[static_cast<size_t>(r)].running && !membership_->standby(global(r)) &&
          !membership_->expelled(global(r)))
        return;
    if (hub_ && !dismiss_sent_) hub_->dismiss();  // the other nodes' spares too
    dismiss_sent_ = true;
  } else if (!relay_ || !relay_->dismissed()) {
    return;  // node 0's service says when no rank of the job runs
  }
  std::vector<int> dismissed;
  for (int r = 0; r < slot_count(); ++r) {
    Rank& rank = ranks_[static_cast<size_t>(r)];
    if (!rank.running || rank.dismissed) continue;
    // A waiting spare, or a member dropped for not joining in time (stopped, or cut off): the
    // job is over without it, so it is not waited for.
    const bool spare = membership_ ? membership_->standby(global(r)) : relay_->standby(r);
    const bool expelled = membership_ ? membership_->expelled(global(r)) : relay_->expelled(r);
    if (!spare && !expelled) continue;
    if (!spare) {
      *streams_[1] << "troupe launch: the job is over: stopping rank slot " << global(r)
                   << ", dropped from the job for not joining a generation in time\n";
      rank.dismissed = true;
      kill(-rank.pid, SIGKILL);
      continue;
    }
    rank.dismissed = true;
    dismissed.push_back(global(r));
    kill(-rank.pid, SIGKILL);
  }
  if (dismissed.empty()) return;  // stopped already, not reaped yet
  *streams_[1] << "troupe launch: no rank runs: stopping the waiting spare"
               << (dismissed.size() == 1 ? " in slot " : "s in slots ");
  for (size_t i = 0; i < dismissed.size(); ++i) *streams_[1] << (i ? ", " : "") << dismissed[i];
  *streams_[1] << "\n";
  streams_[1]->flush();
}

LaunchResult Launcher::run(int port) {
  port_ = port;
  restarts_of_.assign(static_cast<size_t>(slot_count()), 0);
  if (options_.elastic) start_membership(port);
  timeout_at_ =
      options_.timeout_sec > 0 ? Clock::now() + as_duration(options_.timeout_sec) : kNever;
  for (int r = 0; r < slot_count() && !stopping_; ++r) start_rank(r, port, r >= options_.nprocs);
  supervise();
  std::vector<int> not_started;
  const int dismissed = close_outputs(not_started);
  if (relay_) return node_result(dismissed);
  if (membership_) return service_result(dismissed);
  return local_result(not_started);
}

void Launcher::start_membership(int port) {
  const std::chrono::milliseconds membership_timeout(
      static_cast<int64_t>(options_.membership_timeout_sec * 1000));
  if (options_.node_rank == 0) {
    // Slots span the nodes: node i's local rank r is slot i * nprocs + r (its RANK); the spares'
    // slots follow every node's ranks (elastic::NodeShape::slot()).
    membership_ = std::make_unique<elastic::MembershipServer>(shape().slots(), options_.min_ranks,
                                                              membership_timeout, *streams_[1],
                                                              options_.nnodes * options_.nprocs);
    if (options_.nnodes > 1) {
      std::vector<int> nodes;
      for (int s = 0; s < shape().slots(); ++s) nodes.push_back(shape().node_of(s));
      membership_->set_slot_nodes(std::move(nodes));
    }
  }
  if (options_.nnodes > 1) link_nodes(port, membership_timeout);
}

void Launcher::link_nodes(int port, std::chrono::milliseconds membership_timeout) {
  const elastic::NodeShape shape = this->shape();
  std::string secret;
  for (const auto& [name, value] : options_.extra_env)
    if (name == "TROUPE_JOB_SECRET") secret = value;
  if (const char* env = std::getenv("TROUPE_JOB_SECRET"); secret.empty() && env) secret = env;
  const auto silence = elastic::node_silence(membership_timeout);
  if (job_id_.empty()) {
    *streams_[1] << "troupe: warning: node " << options_.node_rank << " of an elastic job of "
                 << options_.nnodes << " nodes has no job id (--job-id, TROUPE_JOB_ID): "
                 << "another job that shares its TROUPE_JOB_SECRET and master address could "
                    "take its place; give every node of a job the same --job-id\n";
    streams_[1]->flush();
  }
  if (options_.node_rank == 0) {
    elastic::HandshakeLimits limits;
    limits.hello_within =
        std::min<std::chrono::milliseconds>(limits.hello_within, membership_timeout);
    limits.in_all = std::max(limits.in_all, 2 * options_.nnodes);
    hub_ = std::make_unique<elastic::MembershipHub>(*membership_, shape, options_.master_addr, port,
                                                    secret, *streams_[1], job_id_, limits, silence);
  } else {
    relay_ = std::make_unique<elastic::MembershipRelay>(shape, options_.master_addr, port, secret,
                                                        membership_timeout, job_id_, silence);
  }
}

bool Launcher::local_running() const {
  return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
}

bool Launcher::remote_alive() const {
  if (!hub_) return false;
  for (int s = 0; s < shape().slots(); ++s)
    if (shape().node_of(s) != 0 && membership_->alive(s)) return true;
  return false;
}

bool Launcher::running() {
  if (local_running()) return true;
  if (!hub_ || !hub_->connected()) return false;
  if (remote_alive()) {
    bye_by_ = kNever;
    return true;
  }
  if (bye_by_ == kNever)
    bye_by_ = Clock::now() + as_duration(options_.grace_sec + kReapAfterKillSec);
  if (Clock::now() < bye_by_) return true;
  hub_->drop_all("no bye within " + seconds_text(options_.grace_sec + kReapAfterKillSec) +
                 " of its ranks' end");
  return false;
}

void Launcher::supervise() {
  std::vector<char> buffer(kMaxLine);
  while (running() ||
         std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.output_open(); })) {
    auto now = Clock::now();
    if (!running() && drain_until_ == kNever) {
      drain_until_ = stopping_ ? kNever : now + as_duration(options_.grace_sec);
    }
    if (now >= drain_until_ || (!running() && now >= give_up_at_)) break;
    check_deadlines(now);
    if (running() && now >= give_up_at_) {
      for (int r = 0; r < slot_count(); ++r) {
        if (ranks_[r].running) unreaped_.push_back(global(r));
        ranks_[r].running = false;  // abandoned: waiting longer would break the deadline
      }
      break;
    }
    poll_once(now, buffer);
    reap();
    dismiss_spares();
  }
}

void Launcher::check_deadlines(Clock::time_point now) {
  if (!stopping_ && now >= timeout_at_) {
    fail("timed out after " + seconds_text(options_.timeout_sec), 124, -1);
  }
  if (membership_) membership_->tick();
  if (hub_) hub_->tick();
  if (relay_) relay_->tick();
  if (job_stopped() && !stopping_) {
    // Every member was told to stop; those that do not end in the grace period are stopped.
    const std::string why = membership_ ? membership_->stop_reason() : relay_->stop_reason();
    if (hub_) hub_->stopped(why);
    fail("elastic membership: " + why, 1, -1, false);
    kill_at_ = std::min(kill_at_, now + as_duration(options_.grace_sec));
    stopping_ = true;
  }
  if (relay_ && relay_->lost() && !lost_reported_) {
    // Node 0's launcher is gone: nothing can form a generation; this node's ranks end.
    lost_reported_ = true;
    fail(relay_->lost_reason(), 1, -1, !stopping_);
  }
  if (give_up_at_ == kNever && now >= kill_at_) {
    signal_groups(SIGKILL);
    give_up_at_ = now + as_duration(kReapAfterKillSec);
  }
}

Launcher::PollSet Launcher::poll_set() const {
  PollSet set{{{signal_pipe_[0], POLLIN, 0}}, {{-1, -1}}};
  for (int r = 0; r < slot_count(); ++r) {
    for (int which = 0; which < 2; ++which) {
      if (ranks_[r].fds[which] < 0) continue;
      set.fds.push_back({ranks_[r].fds[which], POLLIN, 0});
      set.owners.emplace_back(r, which);
    }
  }
  if (membership_) {
    std::vector<int> slots;
    membership_->add_poll_fds(set.fds, slots);
    for (int slot : slots) set.owners.emplace_back(slot, 2);  // 2: the membership socket
  }
  if (hub_ || relay_) {
    std::vector<int> tags;
    if (hub_) hub_->add_poll_fds(set.fds, tags);
    if (relay_) relay_->add_poll_fds(set.fds, tags);
    for (int tag : tags) set.owners.emplace_back(tag, 3);  // 3: the membership link
  }
  return set;
}

void Launcher::poll_once(Clock::time_point now, std::vector<char>& buffer) {
  PollSet set = poll_set();
  std::vector<pollfd>& fds = set.fds;
  auto next =
      std::min({running() ? now + std::chrono::milliseconds(kTickMs) : kNever,
                stopping_ ? kNever : timeout_at_, give_up_at_ == kNever ? kill_at_ : give_up_at_,
                drain_until_, membership_ ? membership_->next_deadline() : kNever,
                hub_ ? hub_->next_deadline() : kNever, relay_ ? relay_->next_deadline() : kNever});
  auto wait_ms = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
  poll(fds.data(), fds.size(), static_cast<int>(std::clamp<long long>(wait_ms, 0, 1000)));

  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    if (i == 0) {
      on_signal(now);
      continue;
    }
    auto [r, which] = set.owners[i];
    if (which == 2) {
      membership_->on_readable(r);
      continue;
    }
    if (which == 3) {
      if (hub_) hub_->on_ready(r, fds[i].revents);
      if (relay_) relay_->on_ready(r, fds[i].revents);
      continue;
    }
    ssize_t got = read(fds[i].fd, buffer.data(), buffer.size());
    if (got >= 0 || (errno != EINTR && errno != EAGAIN)) {
      forward(r, which, buffer.data(), got > 0 ? static_cast<size_t>(got) : 0, got <= 0);
    }
  }
}

void Launcher::on_signal(Clock::time_point now) {
  unsigned char sig = 0;
  if (read(signal_pipe_[0], &sig, 1) != 1) return;
  if (stopping_) {
    kill_at_ = now;  // a second signal: do not wait out the grace period
  } else {
    fail(std::string("launcher received ") + (sig == SIGINT ? "SIGINT" : "SIGTERM"), 128 + sig, -1);
  }
}

int Launcher::close_outputs(std::vector<int>& not_started) {
  int dismissed = 0;
  for (int r = 0; r < slot_count(); ++r) {
    if (ranks_[r].dismissed) ++dismissed;
    for (int which = 0; which < 2; ++which) {
      if (ranks_[r].fds[which] >= 0) forward(r, which, "", 0, true);
    }
    result_.rank_exit_codes.push_back(ranks_[r].exit_code);
    if (ranks_[r].pid < 0 && global(r) != result_.failed_rank) not_started.push_back(global(r));
  }
  return dismissed;
}

int Launcher::finished_here() const {
  return static_cast<int>(
      std::count(result_.rank_exit_codes.begin(), result_.rank_exit_codes.end(), 0));
}

LaunchResult Launcher::node_result(int dismissed) {
  // Another node of an elastic job: it succeeded when its service stayed, the job did not stop,
  // and a rank of this node finished.
  relay_->finish(std::chrono::milliseconds(static_cast<int64_t>(options_.grace_sec * 1000)));
  const int finished = finished_here();
  std::string what = "node " + std::to_string(options_.node_rank) + ": " +
                     std::to_string(finished) + " of " + std::to_string(slot_count()) +
                     " rank slots finished with status 0 after " + std::to_string(restarts_) +
                     " restarts (membership service at " + relay_->where() + ")";
  const bool ok = !relay_->stopped() && !relay_->lost() && finished >= 1;
  return elastic_result(std::move(what), dismissed, ok, relay_->stopped(), relay_->stop_reason());
}

LaunchResult Launcher::service_result(int dismissed) {
  // Elastic: the job succeeded when enough ranks finished and no generation lacked a quorum.
  // With several nodes, the other nodes' ranks that finished count too.
  const int finished = finished_here() + (hub_ ? hub_->finished() : 0);
  const int all_slots = options_.nnodes > 1 ? options_.nnodes * options_.nprocs : slot_count();
  std::string what = std::to_string(finished) + " of " + std::to_string(all_slots) +
                     " rank slots finished with status 0 after " +
                     std::to_string(membership_->generations()) + " generations and " +
                     std::to_string(restarts_) + " restarts" + (hub_ ? " on node 0" : "");
  const bool ok = !membership_->stopped() && finished >= options_.min_ranks;
  return elastic_result(std::move(what), dismissed, ok, membership_->stopped(),
                        membership_->stop_reason());
}

LaunchResult Launcher::elastic_result(std::string what, int dismissed, bool ok, bool stopped,
                                      const std::string& stop_reason) {
  if (dismissed > 0) what += "; " + std::to_string(dismissed) + " waiting spares stopped";
  if (!reason_.empty()) what += "; lost: " + reason_;
  if (!ok && result_.exit_code == 0) result_.exit_code = 1;
  if (stopped) what = stop_reason + "; " + what;
  result_.message = what;
  return result_;
}

LaunchResult Launcher::local_result(const std::vector<int>& not_started) {
  if (reason_.empty()) {
    result_.message = "all " + std::to_string(options_.nprocs) + " ranks exited with status 0";
    return result_;
  }
  result_.message = reason_;
  auto add = [&](const std::string& before, const std::vector<int>& ranks,
                 const std::string& after) {
    if (!ranks.empty()) result_.message += "; " + before + ranks_text(ranks) + after;
  };
  add("stopped ", stopped_, "");
  add("", not_started, " not started");
  if (!options_.stop_on_failure) {
    std::vector<int> failed, finished;
    for (int r = 0; r < options_.nprocs; ++r)
      (result_.rank_exit_codes[r] == 0 ? finished : failed).push_back(global(r));
    add("failed: ", failed, "");
    add("", finished, " ran on and exited with status 0");
  }
  add("", unreaped_, " did not exit within " + seconds_text(kReapAfterKillSec) + " of SIGKILL");
  return result_;
}

void check_options(const LaunchOptions& o) {
  auto bad = [](const std::string& what, const std::string& expected) {
    throw Error("LaunchOptions." + what + " (expected " + expected + ")");
  };
  if (o.nprocs < 1) bad("nprocs=" + std::to_string(o.nprocs) + " is not positive", "at least 1");
  check_world_size(o.nprocs, "LaunchOptions.nprocs", kMaxLocalRanks);
  if (o.nnodes < 1) {
    bad("nnodes (--nnodes) = " + std::to_string(o.nnodes) + " is not positive",
        "at least 1: the number of hosts, each running one launch");
  }
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    bad("node_rank (--node-rank) = " + std::to_string(o.node_rank) + " is out of range",
        "0.." + std::to_string(o.nnodes - 1) +
            " for nnodes (--nnodes) = " + std::to_string(o.nnodes));
  }
  check_world_size(static_cast<long long>(o.nnodes) * o.nprocs,
                   "LaunchOptions world size nnodes x nprocs (--nnodes " +
                       std::to_string(o.nnodes) + " x -n " + std::to_string(o.nprocs) + ")");
  if (o.command.empty()) bad("command is empty", "a program and its arguments");
  if (o.master_addr.empty() && o.nnodes > 1) {
    bad("master_addr (--master-addr) is not set for nnodes (--nnodes) = " +
            std::to_string(o.nnodes),
        "the host name or IP address of node 0, where rank 0 listens, the same on every node");
  }
  if (o.master_port < 0 || o.master_port > 65535) {
    bad("master_port=" + std::to_string(o.master_port) + " is out of range",
        "0..65535; 0: a free one, or " + std::to_string(kDefaultMasterPort) +
            " with several nodes");
  }
  if (!(o.timeout_sec >= 0))
    bad("timeout_sec=" + seconds_text(o.timeout_sec) + " is invalid", "0 or more");
  if (o.bind_cores && o.nprocs + std::max(0, o.spares) > available_cores()) {
    bad("bind_cores (--bind-cores) with " + std::to_string(o.nprocs + std::max(0, o.spares)) +
            " processes on this host (ranks and spares) on " + std::to_string(available_cores()) +
            " cores",
        "at most one process per core of the launcher's affinity");
  }
  if (!(o.grace_sec >= 0))
    bad("grace_sec=" + seconds_text(o.grace_sec) + " is invalid", "0 or more");
  const long long all_ranks = static_cast<long long>(o.nnodes) * o.nprocs;
  if (o.elastic && (o.min_ranks < 1 || o.min_ranks > all_ranks))
    bad("min_ranks (--min-ranks) = " + std::to_string(o.min_ranks) + " is out of range",
        "1.." + std::to_string(all_ranks) + " for " +
            (o.nnodes > 1 ? "--nnodes " + std::to_string(o.nnodes) + " x " : std::string()) +
            "-n " + std::to_string(o.nprocs));
  if (o.max_restarts < 0)
    bad("max_restarts (--max-restarts) = " + std::to_string(o.max_restarts) + " is negative",
        "0 or more");
  if (o.max_restarts > 0 && !o.elastic)
    bad("max_restarts (--max-restarts) = " + std::to_string(o.max_restarts) + " without elastic",
        "--elastic: only an elastic job takes a restarted rank back");
  if (o.spares < 0)
    bad("spares (--spares) = " + std::to_string(o.spares) + " is negative", "0 or more");
  if (o.spares > 0 && !o.elastic)
    bad("spares (--spares) = " + std::to_string(o.spares) + " without elastic",
        "--elastic: only an elastic job takes a spare in a dead rank's place");
  if (o.spares > 0) {
    check_world_size(static_cast<long long>(o.nprocs) + o.spares,
                     "LaunchOptions slots nprocs + spares (-n " + std::to_string(o.nprocs) +
                         " + --spares " + std::to_string(o.spares) + ")",
                     kMaxLocalRanks);
    check_world_size(static_cast<long long>(o.nnodes) * (o.nprocs + o.spares),
                     "LaunchOptions slots nnodes x (nprocs + spares) (--nnodes " +
                         std::to_string(o.nnodes) + " x (-n " + std::to_string(o.nprocs) +
                         " + --spares " + std::to_string(o.spares) + "))");
  }
  if (!o.job_id.empty() &&
      (o.job_id.size() > 128 || !std::all_of(o.job_id.begin(), o.job_id.end(), [](char c) {
         return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
       })))
    bad("job_id (--job-id) = '" + o.job_id + "' is invalid",
        "1..128 of A-Z, a-z, 0-9, '.', '_', '-'");
  if (o.elastic && !(o.membership_timeout_sec > 0))
    bad("membership_timeout_sec (--membership-timeout) = " + seconds_text(o.membership_timeout_sec),
        "more than 0");
}

/// `options` with what the ranks get beyond the user's choices (the compute thread variables),
/// after saying on `err` what that is.
LaunchOptions with_compute_threads(const LaunchOptions& options, std::ostream& err) {
  const GetEnv inherited = [&options](const char* name) -> const char* {
    for (const auto& [key, value] : options.extra_env)
      if (key == name) return value.c_str();
    return std::getenv(name);
  };
  const ComputeThreads threads = compute_threads(options.nprocs, available_cores(), inherited);
  if (!threads.notice.empty()) err << "troupe: " << threads.notice << "\n";
  if (!threads.warning.empty()) err << "troupe: warning: " << threads.warning << "\n";
  err.flush();
  LaunchOptions effective = options;
  effective.extra_env.insert(effective.extra_env.end(), threads.env.begin(), threads.env.end());
  return effective;
}

}  // namespace

LaunchResult launch(const LaunchOptions& options, std::ostream& out, std::ostream& err) {
  check_options(options);
  int port = options.master_port != 0 ? options.master_port
             : options.nnodes > 1     ? kDefaultMasterPort
                                      : pick_free_port();
  const LaunchOptions effective = with_compute_threads(options, err);
  Launcher launcher(effective, out, err);
  return launcher.run(port);
}

std::vector<std::pair<std::string, std::string>> rank_env(const LaunchOptions& options,
                                                          int local_rank, int port) {
  check_options(options);
  if (local_rank < 0 || local_rank >= options.nprocs) {
    throw Error("rank_env: local_rank = " + std::to_string(local_rank) +
                " is out of range (expected 0.." + std::to_string(options.nprocs - 1) +
                " for nprocs = " + std::to_string(options.nprocs) + ")");
  }
  const std::string rank = std::to_string(options.node_rank * options.nprocs + local_rank);
  const std::string world_size = std::to_string(options.nnodes * options.nprocs);
  const std::string values[] = {rank,
                                world_size,
                                std::to_string(local_rank),
                                std::to_string(options.nprocs),
                                std::to_string(options.node_rank),
                                std::to_string(options.nnodes),
                                rank,
                                world_size,
                                options.master_addr.empty() ? "127.0.0.1" : options.master_addr,
                                std::to_string(port)};
  std::vector<std::pair<std::string, std::string>> env;
  for (size_t i = 0; i < kRankVars.size(); ++i) env.emplace_back(kRankVars[i], values[i]);
  return env;
}

int pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("pick_free_port: socket() failed: ") + strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  bool ok = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  int error = errno;
  close(fd);
  if (!ok) throw Error(std::string("pick_free_port: bind 127.0.0.1:0 failed: ") + strerror(error));
  return ntohs(address.sin_port);
}

}  // namespace troupe
