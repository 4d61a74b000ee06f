// Which ranks really share a host (rank/host_identity.h): the machine identity (boot id and the
// /dev/shm a rank sees), the grouping by name and identity, and what a Runtime and a
// DistributedModule make of it, with thread ranks pretending to be on different machines.
#include "tests/support/torch_doctest.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "ddp/distributed_module.h"
#include "rank/host_identity.h"
#include "tests/support/one_name_ranks.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

namespace {

std::string make_dir(const std::string& pattern) {
  std::string path = "/tmp/" + pattern + ".XXXXXX";
  REQUIRE(mkdtemp(path.data()) != nullptr);
  return path;
}

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text << "\n";
  return path;
}

}  // namespace

TEST_CASE(
    "a machine identity is the boot id and the device and inode of the shared-memory directory") {
  const std::string dir = make_dir("host-identity");
  const std::string boot = write_file(dir, "boot_id", "0f1e2d3c-aaaa-bbbb-cccc-000011112222");
  const std::string shm_a = dir + "/shm-a", shm_b = dir + "/shm-b";
  REQUIRE(mkdir(shm_a.c_str(), 0700) == 0);
  REQUIRE(mkdir(shm_b.c_str(), 0700) == 0);
  struct stat st {};
  REQUIRE(stat(shm_a.c_str(), &st) == 0);

  const std::string a = machine_identity(shm_a, boot);
  CHECK(a == "boot 0f1e2d3c-aaaa-bbbb-cccc-000011112222 shm " + std::to_string(st.st_dev) + ":" +
                 std::to_string(st.st_ino));
  CHECK(machine_identity(shm_a, boot) == a);  // the same directory on the same kernel
  CHECK(machine_identity(shm_b, boot) != a);  // another directory is another /dev/shm
  const std::string other_boot =
      write_file(dir, "boot_id_2", "99999999-aaaa-bbbb-cccc-000011112222");
  CHECK(machine_identity(shm_a, other_boot) != a);  // another kernel

  // Without a boot id the host name stands in for it; without the directory nothing is shared.
  CHECK(machine_identity(shm_a, dir + "/missing").rfind("name ", 0) == 0);
  CHECK(machine_identity(dir + "/missing", boot) ==
        "boot 0f1e2d3c-aaaa-bbbb-cccc-000011112222 shm none");
  // This process: its real boot id and /dev/shm.
  CHECK(machine_identity().rfind("boot ", 0) == 0);
  std::system(("rm -rf " + dir).c_str());
}

TEST_CASE("ranks share a real host only when both their host names and machine identities match") {
  CHECK(real_host_indices({"a", "a", "a", "a"}, {"m0", "m0", "m1", "m1"}) ==
        std::vector<int>{0, 0, 1, 1});  // one name on two machines: two hosts
  CHECK(real_host_indices({"a", "b", "a", "b"}, {"m0", "m0", "m0", "m0"}) ==
        std::vector<int>{0, 1, 0, 1});  // names chosen to pretend: kept apart
  CHECK(real_host_indices({"x", "y", "x"}, {"m1", "m0", "m1"}) == std::vector<int>{0, 1, 0});
  CHECK(real_host_indices({}, {}).empty());
  CHECK_THROWS_WITH(real_host_indices({"a", "b"}, {"m0"}),
                    "real_host_indices: 2 host names but 1 machine identities (expected one of "
                    "each per rank)");
}

TEST_CASE("the peer paths say which ranks share this rank's host and which transports reach them") {
  const std::vector<std::string> names{"h0", "h0", "h1"};
  const std::vector<int> hosts{0, 0, 1};
  CHECK(describe_peer_paths(1, names, hosts, {}) ==
        std::vector<std::string>{"same host", "self", "other host (h1)"});
  CHECK(describe_peer_paths(0, names, hosts,
                            {"self/memory", "posix/memory sysv/memory cma/memory", "tcp/eth0"}) ==
        std::vector<std::string>{"self",
                                 "same host, shared memory: posix/memory sysv/memory "
                                 "cma/memory",
                                 "other host (h1), network: tcp/eth0"});
}

TEST_CASE(
    "thread ranks under one host name on two machines form two hosts and keep gradients off shared "
    "memory") {
  torch::set_num_threads(1);
  for (bool one_machine : {true, false}) {
    CAPTURE(one_machine);
    const int world = 4;
    const auto options = test::one_name_ranks(world, !one_machine);
    std::mutex mutex;
    std::vector<std::vector<int>> hosts(world);
    std::vector<std::vector<std::string>> paths(world);
    std::vector<std::string> gradient_path(world);
    std::vector<torch::Tensor> grads(world);
    auto errors = test::run_ranks(options, [&](int r, Runtime& rt) {
      torch::manual_seed(1);  // the same model on every rank
      auto model = torch::nn::Linear(6, 3);
      DistributedModule ddp(rt, model);
      torch::optim::SGD opt(model->parameters(), 0.1);
      torch::manual_seed(10 + r);
      torch::mse_loss(model->forward(torch::randn({4, 6})), torch::randn({4, 3})).backward();
      ddp.step(opt);
      std::lock_guard<std::mutex> lock(mutex);
      hosts[r] = rt.real_hosts();
      paths[r] = rt.peer_paths();
      gradient_path[r] = ddp.gradient_path();
      grads[r] = model->weight.grad().clone();
    });
    for (auto& e : errors) CHECK(e == "");
    const std::vector<int> want =
        one_machine ? std::vector<int>{0, 0, 0, 0} : std::vector<int>{0, 0, 1, 1};
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      CHECK(hosts[r] == want);
      CHECK(gradient_path[r] == std::string(one_machine ? "cpu via shared memory" : "cpu"));
      CHECK(torch::equal(grads[r], grads[0]));
    }
    if (!one_machine)
      CHECK(paths[0] == std::vector<std::string>{"self", "same host", "other host (one-name)",
                                                 "other host (one-name)"});
  }
}
