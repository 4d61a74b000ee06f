// A job over several hosts as users start it: one `troupe launch --nnodes 2 --node-rank I` per
// host (here two on this host, meeting at 127.0.0.1 over TCP), the same rank program started with
// mpirun's or Slurm's variables instead of torchrun's, and the compute threads a launch gives its
// ranks.
#include <doctest/doctest.h>

#include <future>
#include <sstream>
#include <string>

#include "elastic/launch.h"
#include "rank/compute_threads.h"
#include "tests/support/command.h"

namespace {

using troupe::test::Output;
using troupe::test::run;

int count_of(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

/// `troupe launch` for node `node_rank` of 2, `nprocs` ranks each, running the collectives check.
std::string node_command(int node_rank, int nprocs, int port) {
  return std::string("UCX_TLS=tcp,self ") + TROUPE_BIN + " launch --nnodes 2 --node-rank " +
         std::to_string(node_rank) + " --master-addr 127.0.0.1 --master-port " +
         std::to_string(port) + " --timeout 240 -n " + std::to_string(nprocs) + " -- " +
         TROUPE_TEST_RANK_BIN + " collectives";
}

/// Two ranks started by troupe::launch, each running `wrapper` in sh: the wrapper turns the
/// launcher's torchrun variables into another launcher's and execs the collectives check.
troupe::LaunchResult as_other_launcher(const std::string& wrapper, std::string* log) {
  troupe::LaunchOptions o;
  o.nprocs = 2;
  o.command = {"/bin/sh", "-c", wrapper + " " + TROUPE_TEST_RANK_BIN + " collectives"};
  o.timeout_sec = 240;
  o.extra_env = {{"UCX_TLS", "sm,self"}};
  std::ostringstream out, err;
  auto result = troupe::launch(o, out, err);
  *log = out.str() + err.str();
  return result;
}

// What a launch sets, without torchrun's variables: they are what the other launcher replaces.
const std::string kUnsetTorchrun =
    "exec env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK "
    "-u GROUP_WORLD_SIZE -u ROLE_RANK -u ROLE_WORLD_SIZE ";

}  // namespace

TEST_CASE("two troupe launches, one per node, of 1 and then 2 ranks each check every collective") {
  for (int nprocs : {1, 2}) {
    CAPTURE(nprocs);
    const int port = troupe::pick_free_port();
    auto node1 = std::async(std::launch::async, [&] { return run(node_command(1, nprocs, port)); });
    Output node0 = run(node_command(0, nprocs, port));
    Output other = node1.get();
    INFO(node0.text);
    INFO(other.text);
    CHECK(node0.status == 0);
    CHECK(other.status == 0);
    const int world = 2 * nprocs;
    for (int rank = 0; rank < world; ++rank) {
      const Output& node = rank < nprocs ? node0 : other;
      CHECK(count_of(node.text, "[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) +
                                    " of " + std::to_string(world) +
                                    ": every collective correct") == 1);
    }
  }
}

TEST_CASE("troupe launch names the flag and the value of a bad node rank, node count or address") {
  const std::string launch = std::string(TROUPE_BIN) + " launch ";
  auto past = run(launch + "--nnodes 2 --node-rank 2 --master-addr 127.0.0.1 -n 1 -- true");
  CHECK(past.status != 0);
  CHECK(past.text.find("node_rank (--node-rank) = 2 is out of range (expected 0..1 for nnodes "
                       "(--nnodes) = 2)") != std::string::npos);
  auto zero = run(launch + "--nnodes 0 -n 1 -- true");
  CHECK(zero.status != 0);
  CHECK(zero.text.find("--nnodes: 0 is out of range (expected an integer in 1..65536)") !=
        std::string::npos);
  auto many = run(launch + "--nnodes 64 --master-addr 127.0.0.1 -n 2048 -- true");
  CHECK(many.status != 0);
  CHECK(many.text.find("(--nnodes 64 x -n 2048) = 131072 is out of range (expected 1..65536") !=
        std::string::npos);
  auto no_address = run(launch + "--nnodes 2 --node-rank 1 -n 1 -- true");
  CHECK(no_address.status != 0);
  CHECK(no_address.text.find("master_addr (--master-addr) is not set for nnodes (--nnodes) = 2") !=
        std::string::npos);
  for (const Output* out : {&past, &zero, &many, &no_address}) {
    INFO(out->text);
    CHECK(out->text.find("[rank") == std::string::npos);  // refused before any rank started
  }
}

TEST_CASE("the rank program starts as a job from mpirun's variables and from Slurm's") {
  std::string log;
  auto mpirun = as_other_launcher(
      kUnsetTorchrun +
          "OMPI_COMM_WORLD_RANK=$RANK OMPI_COMM_WORLD_SIZE=$WORLD_SIZE "
          "OMPI_COMM_WORLD_LOCAL_RANK=$LOCAL_RANK OMPI_COMM_WORLD_LOCAL_SIZE=$LOCAL_WORLD_SIZE",
      &log);
  INFO(log);
  CHECK(mpirun.exit_code == 0);
  CHECK(count_of(log, "rank 0 of 2: every collective correct") == 1);
  CHECK(count_of(log, "rank 1 of 2: every collective correct") == 1);
  // Slurm names no rendezvous port and its address is the launch node's.
  std::string slurm_log;
  auto slurm = as_other_launcher(
      kUnsetTorchrun +
          "-u MASTER_ADDR SLURM_PROCID=$RANK SLURM_NTASKS=$WORLD_SIZE SLURM_LOCALID=$LOCAL_RANK "
          "SLURM_NODEID=0 SLURM_TASKS_PER_NODE='2(x1)' SLURM_LAUNCH_NODE_IPADDR=127.0.0.1",
      &slurm_log);
  INFO(slurm_log);
  CHECK(slurm.exit_code == 0);
  CHECK(count_of(slurm_log, "rank 0 of 2: every collective correct") == 1);
  CHECK(count_of(slurm_log, "rank 1 of 2: every collective correct") == 1);
}

TEST_CASE("troupe launch gives each rank one compute thread unless the user chose, and says so") {
  const std::string launch = std::string(TROUPE_BIN) + " launch -n 2 -- sh -c " +
                             "'echo omp=$OMP_NUM_THREADS blas=$OPENBLAS_NUM_THREADS'";
  auto unset = run("env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS " + launch);
  INFO(unset.text);
  CHECK(unset.status == 0);
  CHECK(count_of(unset.text, "] omp=1 blas=1\n") == 2);
  CHECK(count_of(unset.text,
                 "troupe: setting OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1 for "
                 "each of the 2 ranks") == 1);
  auto chosen = run("env -u OPENBLAS_NUM_THREADS OMP_NUM_THREADS=3 " + launch);
  INFO(chosen.text);
  CHECK(chosen.status == 0);
  CHECK(count_of(chosen.text, "] omp=3 blas=\n") == 2);
  CHECK(count_of(chosen.text, "troupe: setting") == 0);
}

TEST_CASE("troupe launch warns once when its ranks' threads exceed the cores, and not otherwise") {
  const int cores = troupe::available_cores();
  const std::string over = "env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS " +
                           std::string(TROUPE_BIN) + " launch -n " + std::to_string(cores + 1) +
                           " -- true";
  auto warned = run(over);
  INFO(warned.text);
  CHECK(warned.status == 0);
  CHECK(count_of(warned.text, "troupe: warning: " + std::to_string(cores + 1) +
                                  " ranks x 1 compute thread = " + std::to_string(cores + 1) +
                                  " threads exceed the " + std::to_string(cores) + " core") == 1);
  auto fits = run("env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS " + std::string(TROUPE_BIN) +
                  " launch -n 1 -- true");
  CHECK(fits.status == 0);
  CHECK(count_of(fits.text, "warning") == 0);
}

TEST_CASE(
    "two staggered two-node jobs that share a secret and a port never cross-wire: the other job's "
    "node is refused by its job id") {
  // Job a's node 0 listens and waits for its node 1. Job b's node 1, given the same secret and
  // port (job b's own node 0 could not listen on this host's port: it is job a's), reaches job
  // a's node 0 and must be refused, naming its job; then job a's own node 1 arrives, and job a
  // runs with its own ranks only. Before job ids, job b's rank trained with job a's rank 0.
  const int port = troupe::pick_free_port();
  auto node = [&](const std::string& job, int node_rank) {
    return std::string("UCX_TLS=tcp,self TROUPE_JOB_SECRET=one-secret-for-two-jobs-0123456789 ") +
           TROUPE_BIN + " launch --nnodes 2 --node-rank " + std::to_string(node_rank) +
           " --master-addr 127.0.0.1 --master-port " + std::to_string(port) + " --job-id " + job +
           " --timeout 120 -n 1 -- " + TROUPE_TEST_RANK_BIN + " collectives";
  };
  auto a0 = std::async(std::launch::async, [&] { return run(node("job-a", 0)); });
  // Retries until job a's node 0 listens (its rendezvous deadline is 30 s), then is refused.
  Output b1 = run(node("job-b", 1));
  Output a1 = run(node("job-a", 1));
  Output a0_out = a0.get();
  INFO("job a node 0:\n" << a0_out.text);
  INFO("job a node 1:\n" << a1.text);
  INFO("job b node 1:\n" << b1.text);
  CHECK(b1.status != 0);
  CHECK(b1.text.find("cannot join the rendezvous at 127.0.0.1:" + std::to_string(port)) !=
        std::string::npos);
  CHECK(b1.text.find("does not hold this job's secret and id (this rank's job is 'job-b'") !=
        std::string::npos);
  CHECK(b1.text.find("every collective correct") == std::string::npos);
  // Job a: its two ranks, each checking every collective against its closed form.
  CHECK(a0_out.status == 0);
  CHECK(a1.status == 0);
  CHECK(count_of(a0_out.text, "[rank 0] rank 0 of 2: every collective correct") == 1);
  CHECK(count_of(a1.text, "[rank 1] rank 1 of 2: every collective correct") == 1);
}
