#include "rank/runtime.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

#include "actors/node.h"
#include "comm/tags.h"
#include "comm/transport/inproc/transport.h"
#include "comm/transport/link_emulation.h"
#include "comm/transport/ucx/transport.h"
#include "rank/fault.h"
#include "rank/host_identity.h"
#include "rank/membership_client.h"
#include "rank/runtime_internal.h"
#include "rank/tcp_store.h"
#ifdef TROUPE_HAVE_NCCL
#include "comm/transport/nccl/communicator.h"
#include "cuda/reduce.h"
#include "cuda/stream.h"
#include "rank/device.h"
#endif

namespace troupe {

namespace {

std::string host_name(const std::string& chosen) {
  if (!chosen.empty()) return chosen;
  if (const char* env = std::getenv("TROUPE_HOST_NAME"); env && *env) return env;
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

int default_threads() {
  unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hw, 1u, 2u));
}

/// The key of this Runtime's directory port in torchrun's agent store: the job's key and how many
/// Runtimes this rank started before under it, so a second Runtime of the job never reads the
/// first one's port (every rank starts its Runtimes in the same order).
std::string agent_store_key(const RankInfo& info) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, int>, int> started;
  std::lock_guard<std::mutex> lock(mutex);
  return info.agent_store_key + "/" + std::to_string(started[{info.agent_store_key, info.rank}]++);
}

/// The directory port rank 0 wrote into the agent store.
int directory_port(const TcpStore& store, const std::string& key, const std::string& value) {
  int port = 0;
  size_t used = 0;
  try {
    port = std::stoi(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || port < 1 || port > 65535)
    throw comm::Error("key '" + key + "' in torchrun's TCPStore at " + store.host() + ":" +
                      std::to_string(store.port()) + " holds '" + value +
                      "' (expected rank 0's directory port, 1..65535)");
  return port;
}

/// A small non-negative integer from variable `name` (unset: `fallback`); strict.
int env_count(const char* name, int fallback, int min) {
  const char* text = std::getenv(name);
  if (!text) return fallback;
  const std::string value = text;
  size_t used = 0;
  int n = -1;
  try {
    n = std::stoi(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (value.empty() || used != value.size() || n < min)
    throw comm::Error(std::string(name) + "='" + value +
                      "' (expected an integer >= " + std::to_string(min) + ")");
  return n;
}

/// While it lives, the process's name (/proc/self/comm, what ps and pgrep show) is `name`; empty:
/// unchanged.
class ProcessName {
 public:
  explicit ProcessName(const std::string& name) {
    if (name.empty() || !read(before_)) return;
    write(name);
  }
  ~ProcessName() {
    if (!before_.empty()) write(before_);
  }
  ProcessName(const ProcessName&) = delete;
  ProcessName& operator=(const ProcessName&) = delete;

 private:
  static bool read(std::string& out) {
    std::ifstream in("/proc/self/comm");
    return static_cast<bool>(std::getline(in, out)) && !out.empty();
  }
  static void write(const std::string& name) {
    std::ofstream out("/proc/self/comm");
    out << name;  // best effort: only what ps shows depends on it
  }
  std::string before_;
};

}  // namespace

struct Runtime::Impl {
  RuntimeOptions options;
  RankInfo info;
  std::unique_ptr<actors::Node> node;  // the actor system, worker and directory
  std::shared_ptr<comm::Transport> transport;
  std::vector<std::string> hosts;
  std::vector<int> host_index;          // each rank's real host (rank/host_identity.h)
  std::vector<std::string> peer_paths;  // how this rank reaches each rank
  std::unique_ptr<comm::Communicator> comm;
  // Guards dead, death, death_rank and the creation of comm; in an elastic job also every change
  // of transport and of info's rank and world size, which the membership client's thread reads
  // (on_membership_change) while the rank's own thread forms and tears down generations.
  mutable std::mutex dead_mutex;
  std::vector<int> dead;
  std::string death;  // the first fatal loss, if any
  int death_rank = -1;
  std::map<int, std::function<void(int, const std::string&)>> listeners;
  int next_listener = 0;
  uint32_t module_ids = 0;  // bit i: module id i is taken (next_module_id)
  // NCCL: rank 0's unique id from the rendezvous (empty: none), why rank 0 made none (rank 0
  // only), and the communicator once nccl() has created it (guarded by dead_mutex; creation is
  // serialised by nccl_mutex).
  std::string nccl_id;
  std::string nccl_note;
  std::mutex nccl_mutex;
  std::shared_ptr<comm::NcclCommunicator> nccl;

  // Failure: exceptions in flight when the Runtime was made (more at its destruction mean an
  // exception unwinds it), and whether this rank has told the directory it failed.
  int uncaught_at_start = 0;
  std::atomic<bool> failure_announced{false};

  // Elastic: the membership service's client, this rank's launch slot, the generation in force,
  // and the newest generation the service announced (guarded by dead_mutex).
  std::unique_ptr<elastic::MembershipClient> membership;
  int slot = 0;
  // Whether the launch put every rank on this host (LOCAL_WORLD_SIZE == WORLD_SIZE): then UCX
  // is limited to shared memory; a launch of several nodes keeps the network transports.
  bool launch_single_host = true;
  ElasticGeneration generation;
  int announced = 0;
  std::string announced_why;
  bool stop_announced = false;  // the service stopped the job, or its socket closed

  void start();
  void arm_faults();
  void start_elastic(int membership_fd, const comm::LinkEmulation& links);
  std::shared_ptr<comm::Transport> inproc_transport();
  void on_peer_down(int rank, const std::string& reason, bool fatal);
  actors::RendezvousRequest rendezvous_request(const std::string& address) const;
  // Rank 0 publishes the directory behind its front door; every rank registers and gets the table.
  actors::PeerTable meet(actors::RendezvousRequest& request);
  // Whether this rank's links are emulated (RuntimeOptions::links, TROUPE_LINK_*).
  bool links_emulated = false;
  void find_real_hosts(const comm::UcxTransport* ucx);
  void publish_nccl_id(actors::RendezvousRequest& request);
  void announce_failure(const std::string& reason);
  void stop();
  // Elastic: form a generation with the membership service, and tear one down. `standby` > 0:
  // this process is a spare (TROUPE_ELASTIC_SPARE), whose first join waits that long for a
  // generation that needs it.
  void form(int64_t completed_steps, std::chrono::seconds standby = std::chrono::seconds(0));
  void teardown();
  void on_membership_change(int number, const std::string& why);
};

void Runtime::Impl::start() {
  info = options.rank_info ? *options.rank_info : rank_info_from_env();
  validate(info);
  if (options.scheduler_threads < 0 || options.scheduler_threads > 256)
    throw comm::Error(
        "RuntimeOptions.scheduler_threads=" + std::to_string(options.scheduler_threads) +
        " (expected 0..256; 0 = default)");
  const int threads = options.scheduler_threads ? options.scheduler_threads : default_threads();
  const comm::LinkEmulation links =
      options.links ? *options.links : link_emulation_from_env(info.world_size);
  links_emulated = links.active();
  std::vector<comm::LinkShape> shapes;
  try {
    shapes = links.outgoing(info.rank, info.world_size);
  } catch (const comm::Error& e) {
    throw comm::Error(std::string("RuntimeOptions.links: ") + e.what());
  }
  node = std::make_unique<actors::Node>(threads);

  slot = info.rank;
  launch_single_host = info.local_world_size == info.world_size;
  arm_faults();
  const int membership_fd =
      options.membership_fd >= 0 ? options.membership_fd : env_count("TROUPE_ELASTIC_FD", -1, 3);
  if (membership_fd >= 0) return start_elastic(membership_fd, links);

  std::string address;
  std::shared_ptr<comm::UcxTransport> ucx;
  if (options.transport == "ucx") {
    const bool single_host = info.local_world_size == info.world_size;
    ucx = std::make_shared<comm::UcxTransport>(info.rank, info.world_size, single_host);
    address = ucx->local_address();
    transport = ucx;
  } else {
    transport = inproc_transport();
  }
  if (links.active()) transport = std::make_shared<comm::EmulatedTransport>(transport, shapes);
  node->start_worker(info.rank, transport, [this](int rank, const std::string& reason, bool fatal) {
    on_peer_down(rank, reason, fatal);
  });

  auto request = rendezvous_request(address);
  if (info.rank == 0) publish_nccl_id(request);
  actors::PeerTable table;
  if (info.world_size == 1) {
    // Alone: nobody to meet, so nothing listens (two single-process runs never collide on a port).
    table.hosts = {request.host};
    table.addresses = {request.address};
    table.extras = {request.extra};
  } else {
    table = meet(request);
  }
  hosts = table.hosts;
  if (!table.extras.empty()) nccl_id = table.extras[0];

  if (ucx) ucx->connect(table.addresses);
  {
    std::lock_guard<std::mutex> lock(dead_mutex);
    comm = std::make_unique<comm::Communicator>(transport, options.collectives,
                                                options.rendezvous_timeout);
    if (!death.empty()) comm->abort(death, death_rank);
  }
  comm->barrier();
  find_real_hosts(ucx.get());
  comm->set_timeout(options.collective_timeout);
}

// The fault plan of RuntimeOptions::faults, else TROUPE_FAULT (rank/fault.h).
void Runtime::Impl::arm_faults() {
  const std::string fault_source =
      options.faults.empty() ? "TROUPE_FAULT" : "RuntimeOptions.faults";
  const char* fault_env = std::getenv("TROUPE_FAULT");
  fault::arm(parse_faults(options.faults.empty() ? (fault_env ? fault_env : "") : options.faults,
                          fault_source),
             info.rank, info.world_size, env_count("TROUPE_RESTART_COUNT", 0, 0), fault_source);
  fault::at_any(FaultPhase::rendezvous, 0);
}

// An elastic rank: its world comes from the membership service behind `membership_fd`.
void Runtime::Impl::start_elastic(int membership_fd, const comm::LinkEmulation& links) {
  if (options.transport != "ucx")
    throw comm::Error("RuntimeOptions.transport=\"" + options.transport +
                      "\" in an elastic job (expected \"ucx\": the world is re-formed between "
                      "processes)");
  if (links.active())
    throw comm::Error(
        "link emulation (TROUPE_LINK, RuntimeOptions.links) in an elastic job "
        "(expected none: the links are per rank, and ranks are renumbered)");
  membership = std::make_unique<elastic::MembershipClient>(
      membership_fd,
      [this](int number, const std::string& why) { on_membership_change(number, why); });
  form(-1, std::chrono::seconds(env_count("TROUPE_ELASTIC_SPARE", 0, 1)));
}

// RuntimeOptions::transport "inproc": this rank's end of the fabric; any other name but "ucx" is
// refused.
std::shared_ptr<comm::Transport> Runtime::Impl::inproc_transport() {
  if (options.transport != "inproc")
    throw comm::Error("RuntimeOptions.transport=\"" + options.transport +
                      "\" (expected \"ucx\" or \"inproc\")");
  if (!options.fabric)
    throw comm::Error(
        "RuntimeOptions.transport=\"inproc\" needs RuntimeOptions.fabric "
        "(an InprocFabric shared by the ranks of this process)");
  if (options.fabric->world_size() != info.world_size)
    throw comm::Error("InprocFabric has world size " +
                      std::to_string(options.fabric->world_size()) + ", but WORLD_SIZE is " +
                      std::to_string(info.world_size));
  return options.fabric->transport(info.rank);
}

// The worker heard that `rank` is gone: the first fatal loss aborts the collectives, NCCL and
// every failure listener's work, naming it.
void Runtime::Impl::on_peer_down(int rank, const std::string& reason, bool fatal) {
  std::lock_guard<std::mutex> lock(dead_mutex);
  dead.push_back(rank);
  if (!fatal || !death.empty()) return;
  death = reason;
  death_rank = rank;
  if (comm) comm->abort(reason, rank);
#ifdef TROUPE_HAVE_NCCL
  if (nccl) nccl->abort(reason);
#endif
  for (auto& [id, listener] : listeners) listener(rank, reason);
}

// What this rank tells the directory: who and where it is, and how to reach and trust rank 0.
actors::RendezvousRequest Runtime::Impl::rendezvous_request(const std::string& address) const {
  actors::RendezvousRequest request;
  request.rank = info.rank;
  request.world_size = info.world_size;
  request.master_addr = info.master_addr;
  request.master_port = info.master_port;
  request.host = host_name(options.host);
  request.address = address;
  request.timeout = options.rendezvous_timeout;
  request.secret = info.job_secret;
  request.job_id = info.job_id;
  request.bind_address = info.bind_address;
  request.tls = {info.tls_cert, info.tls_key, info.tls_ca};
  return request;
}

actors::PeerTable Runtime::Impl::meet(actors::RendezvousRequest& request) {
  // Under torchrun's agent store, MASTER_PORT is the agent's: the directory listens on a free
  // port, which travels through the store.
  std::unique_ptr<TcpStore> agent_store;
  std::string port_key;
  if (!info.agent_store_key.empty()) {
    agent_store =
        std::make_unique<TcpStore>(info.master_addr, info.master_port, options.rendezvous_timeout);
    port_key = agent_store_key(info);
    if (info.rank == 0) {
      request.master_port = 0;
    } else {
      request.master_port = directory_port(*agent_store, port_key,
                                           agent_store->get(port_key, options.rendezvous_timeout));
    }
  }
  if (info.rank == 0) {
    const auto& door = node->publish(request);
    request.master_port = door.port();
    if (agent_store) agent_store->set(port_key, std::to_string(request.master_port));
    const bool loopback = door.address().rfind("127.", 0) == 0;
    if (info.job_secret.empty() && !loopback)
      std::cerr << "troupe: rank 0: the rendezvous at " << door.address() << ":"
                << request.master_port
                << " accepts any process that reaches it: no TROUPE_JOB_SECRET is set (troupe "
                   "launch sets one; under torchrun, Slurm or mpirun export the same value of 16 "
                   "or more characters to every rank)\n";
  }
  agent_store.reset();
  return node->rendezvous(request);
}

void Runtime::Impl::find_real_hosts(const comm::UcxTransport* ucx) {
  const auto identities =
      gather_identities(*comm, options.machine.empty() ? machine_identity() : options.machine);
  host_index = real_host_indices(hosts, identities);
  comm->set_options(comm::for_layout(options.collectives, host_index));
  // One real host, over UCX: allreduce through shared memory (futex wake-ups, no polling
  // thread). Emulated links must carry the traffic, so they keep it on the transport.
  const bool one_host = std::adjacent_find(host_index.begin(), host_index.end(),
                                           std::not_equal_to<int>()) == host_index.end();
  comm->use_shared_memory(ucx && one_host && !links_emulated && options.collectives.shared_memory);
  peer_paths = describe_peer_paths(info.rank, hosts, host_index,
                                   ucx ? ucx->peer_transports() : std::vector<std::string>{});
  if (ucx && info.world_size > 1) {
    std::string line = "troupe: rank " + std::to_string(info.rank) + " on " +
                       hosts[static_cast<size_t>(info.rank)] + " reaches";
    const char* separator = " ";
    int shown = 0;
    for (int r = 0; r < info.world_size; ++r) {
      if (r == info.rank) continue;
      if (++shown > 8) {  // a line per rank, whatever the world
        line += "; ... (" + std::to_string(info.world_size - 1) + " peers in all)";
        break;
      }
      line += separator + std::string("rank ") + std::to_string(r) + " " +
              peer_paths[static_cast<size_t>(r)];
      separator = "; ";
    }
    std::cerr << line << "\n";
  }
}

void Runtime::Impl::publish_nccl_id(actors::RendezvousRequest& request) {
#ifdef TROUPE_HAVE_NCCL
  if (!options.nccl) {
    nccl_note = "RuntimeOptions::nccl is off on rank 0";
  } else if (!cuda::device_available()) {
    nccl_note = "rank 0 sees no CUDA device";
  } else {
    try {
      request.extra = comm::NcclCommunicator::unique_id();
    } catch (const comm::Error& e) {
      nccl_note = std::string("rank 0 could not make one: ") + e.what();
      std::cerr << "troupe: rank 0: the job has no NCCL, CUDA tensors go through host staging: "
                << nccl_note << "\n";
    }
  }
#else
  (void)request;
  nccl_note = "troupe was built without NCCL";
#endif
}

void Runtime::Impl::announce_failure(const std::string& reason) {
  if (!node || failure_announced.exchange(true)) return;
  // The directory tells every other rank at once, as a death: their waits on this rank end now
  // instead of at their deadlines, with this reason.
  if (!hosts.empty()) node->tell_failed(info.rank, reason);
  // This rank's own operations end too: its collectives, and what its modules (buckets, gossip
  // rounds, background averages) still wait for from its peers.
  const std::string why = "rank " + std::to_string(info.rank) + " (this rank) failed: " + reason;
  if (transport && !hosts.empty())
    for (int r = 0; r < info.world_size; ++r)
      if (r != info.rank) transport->fail_peer(r, why);
  std::lock_guard<std::mutex> lock(dead_mutex);
  if (comm) comm->abort(why, info.rank);
#ifdef TROUPE_HAVE_NCCL
  if (nccl) nccl->abort(why);
#endif
}

void Runtime::Impl::on_membership_change(int number, const std::string& why) {
  std::lock_guard<std::mutex> lock(dead_mutex);
  if (number > 0 && number <= announced) return;
  if (number <= 0) stop_announced = true;
  if (number > 0) {
    announced = number;
    announced_why = why;
  }
  if (number > 0 && number <= generation.number) return;
  // The generation in force ends: whatever waits on its peers fails now, naming the change.
  if (comm) comm->abort(why, -1);
  if (transport)
    for (int r = 0; r < info.world_size; ++r)
      if (r != info.rank) transport->fail_peer(r, why);
  for (auto& [id, listener] : listeners) listener(-1, why);
}

void Runtime::Impl::teardown() {
  std::shared_ptr<comm::Transport> old;  // destroyed outside the lock, after the worker's exit
  {
    std::lock_guard<std::mutex> lock(dead_mutex);
    comm.reset();
    dead.clear();
    death.clear();
    death_rank = -1;
    module_ids =
        0;  // the modules were destroyed before a reform (runtime.h), each giving its id back
    old = std::move(transport);
  }
  node->stop_worker();
  old.reset();
}

void Runtime::Impl::form(int64_t completed_steps, std::chrono::seconds standby) {
  const std::string host = host_name(options.host);
  for (int attempt = 1;; ++attempt) {
    const bool spare = attempt == 1 && standby.count() > 0;
    auto deadline = elastic::Clock::now() + (spare ? standby : options.rendezvous_timeout);
    // A spare makes its UCX context and worker before it waits, so that the generation that
    // takes it does not wait for them (its world size is not known yet: the launch's slots are
    // the estimate UCX sizes its tables by).
    std::unique_ptr<comm::UcxWorker> made;
    if (spare) made = std::make_unique<comm::UcxWorker>(launch_single_host, info.world_size);
    elastic::Assignment a;
    {
      // A waiting spare is named troupe-spare (ps, pgrep) until a generation takes it.
      ProcessName name(spare ? "troupe-spare" : "");
      try {
        a = membership->join(completed_steps, host, deadline);
      } catch (const comm::Error& e) {
        if (!spare) throw;
        throw comm::Error("elastic: the spare in launch slot " + std::to_string(slot) +
                          " waited TROUPE_ELASTIC_SPARE=" + std::to_string(standby.count()) +
                          " s for a generation that needs it: " + e.what());
      }
    }
    if (spare) deadline = elastic::Clock::now() + options.rendezvous_timeout;
    auto ucx = made
                   ? std::make_shared<comm::UcxTransport>(a.rank, a.world_size, std::move(made))
                   : std::make_shared<comm::UcxTransport>(a.rank, a.world_size, launch_single_host);
    auto table = membership->exchange(a.generation, ucx->local_address(), deadline);
    if (!table) continue;  // a newer generation opened: join it
    {
      std::lock_guard<std::mutex> lock(dead_mutex);
      info.rank = a.rank;
      info.world_size = a.world_size;
      transport = ucx;
    }
    // This generation's ranks on this host (by the host names the members reported).
    info.local_rank = 0;
    info.local_world_size = 0;
    for (int r = 0; r < a.world_size; ++r) {
      if (table->hosts[static_cast<size_t>(r)] != table->hosts[static_cast<size_t>(a.rank)])
        continue;
      if (r < a.rank) ++info.local_rank;
      ++info.local_world_size;
    }
    hosts = table->hosts;
    node->start_worker(info.rank, transport, [](int, const std::string&, bool) {});
    try {
      ucx->connect(table->addresses);
      {
        std::lock_guard<std::mutex> lock(dead_mutex);
        comm = std::make_unique<comm::Communicator>(transport, options.collectives,
                                                    options.rendezvous_timeout);
        generation = ElasticGeneration{a.generation, a.source, a.step, a.ranks};
        if (announced > a.generation) comm->abort(announced_why, -1);
      }
      comm->barrier();
      find_real_hosts(ucx.get());
      comm->set_timeout(options.collective_timeout);
      return;
    } catch (const comm::Error& e) {
      // A member died, or a newer generation opened, before this one was in force here.
      teardown();
      if (attempt >= 32)
        throw comm::Error(std::string("elastic: no generation formed in 32 attempts; the last "
                                      "failed with: ") +
                          e.what());
    }
  }
}

void Runtime::Impl::stop() {
  if (!node) return;
  if (membership && !failure_announced) membership->leave();
  // Tell the directory we leave on purpose, so survivors hear "left" rather than "died".
  if (!hosts.empty() && !failure_announced) node->tell_leaving(info.rank);
  std::shared_ptr<comm::NcclCommunicator> nccl_comm;
  std::shared_ptr<comm::Transport> old_transport;  // destroyed last, as before
  {
    std::lock_guard<std::mutex> lock(dead_mutex);
    comm.reset();
    nccl_comm = std::move(nccl);
    old_transport = std::move(transport);
  }
  nccl_comm.reset();  // may wait for its operations in flight, up to their deadlines
  node->close();
  old_transport.reset();
  node.reset();
  membership.reset();
}

Runtime::Runtime() : Runtime(RuntimeOptions{}) {}

Runtime::Runtime(RuntimeOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->uncaught_at_start = std::uncaught_exceptions();
  try {
    impl_->start();
  } catch (const std::exception& e) {
    impl_->announce_failure(std::string("its Runtime failed to start: ") + e.what());
    impl_->stop();
    throw;
  } catch (...) {
    impl_->stop();
    throw;
  }
}

Runtime::~Runtime() {
  if (std::uncaught_exceptions() > impl_->uncaught_at_start)
    impl_->announce_failure(
        "an exception unwound its Runtime (the program did not name it with "
        "Runtime::fail)");
  impl_->stop();
}

void Runtime::fail(const std::string& reason) { impl_->announce_failure(reason); }

int Runtime::rank() const { return impl_->info.rank; }
int Runtime::world_size() const { return impl_->info.world_size; }
int Runtime::local_rank() const { return impl_->info.local_rank; }
const RankInfo& Runtime::rank_info() const { return impl_->info; }
const std::vector<std::string>& Runtime::hosts() const { return impl_->hosts; }
const std::vector<int>& Runtime::real_hosts() const { return impl_->host_index; }
const std::vector<std::string>& Runtime::peer_paths() const { return impl_->peer_paths; }

std::vector<int> host_indices(const std::vector<std::string>& hosts) {
  std::vector<std::string> seen;
  std::vector<int> out;
  for (const auto& h : hosts) {
    auto at = std::find(seen.begin(), seen.end(), h);
    if (at == seen.end()) at = seen.insert(seen.end(), h);
    out.push_back(static_cast<int>(at - seen.begin()));
  }
  return out;
}
actors::Node& detail::RuntimeAccess::node(Runtime& runtime) { return *runtime.impl_->node; }
std::chrono::milliseconds detail::RuntimeAccess::collective_timeout(const Runtime& runtime) {
  return runtime.impl_->options.collective_timeout;
}

bool detail::RuntimeAccess::reform_announced(const Runtime& runtime) {
  std::lock_guard<std::mutex> lock(runtime.impl_->dead_mutex);
  return runtime.impl_->stop_announced ||
         runtime.impl_->announced > runtime.impl_->generation.number;
}

std::shared_ptr<comm::Transport> Runtime::transport() { return impl_->transport; }
comm::Communicator& Runtime::comm() { return *impl_->comm; }

std::vector<int> Runtime::dead_ranks() const {
  std::lock_guard<std::mutex> lock(impl_->dead_mutex);
  auto d = impl_->dead;
  std::sort(d.begin(), d.end());
  return d;
}

int Runtime::add_failure_listener(std::function<void(int, const std::string&)> listener) {
  std::lock_guard<std::mutex> lock(impl_->dead_mutex);
  const int id = ++impl_->next_listener;
  if (!impl_->death.empty()) listener(impl_->death_rank, impl_->death);
  impl_->listeners[id] = std::move(listener);
  return id;
}

void Runtime::remove_failure_listener(int id) {
  std::lock_guard<std::mutex> lock(impl_->dead_mutex);
  impl_->listeners.erase(id);
}

int Runtime::next_module_id() {
  std::lock_guard<std::mutex> lock(impl_->dead_mutex);
  for (int id = 1; id <= comm::tags::kMaxModules; ++id)
    if (!(impl_->module_ids & (uint32_t{1} << id))) {
      impl_->module_ids |= uint32_t{1} << id;
      return id;
    }
  throw comm::Error("a Runtime holds at most " + std::to_string(comm::tags::kMaxModules) +
                    " modules at once (DistributedModule, DecentralizedModule, "
                    "AsynchronousModule; tried a " +
                    std::to_string(comm::tags::kMaxModules + 1) + "th: destroy one first)");
}

void Runtime::release_module_id(int id) {
  std::lock_guard<std::mutex> lock(impl_->dead_mutex);
  if (id >= 1 && id <= comm::tags::kMaxModules) impl_->module_ids &= ~(uint32_t{1} << id);
}

bool Runtime::elastic() const { return impl_->membership != nullptr; }
int Runtime::slot() const { return impl_->slot; }

ElasticGeneration Runtime::generation() const {
  std::lock_guard<std::mutex> lock(impl_->dead_mutex);
  return impl_->generation;
}

ElasticGeneration Runtime::reform(int64_t completed_steps) {
  auto& m = *impl_;
  if (!m.membership)
    throw comm::Error(
        "Runtime::reform: this Runtime is not elastic (expected `troupe launch "
        "--elastic`, or RuntimeOptions::membership_fd)");
  m.teardown();
  fault::at_any(FaultPhase::rendezvous, completed_steps);
  m.form(completed_steps);
  return generation();
}

#ifdef TROUPE_HAVE_NCCL
namespace {

// "" when every rank of this rank's host can have a GPU of its own (rank/device.h).
std::string gpus_for_nccl_here(const Runtime& rt) {
  const auto& hosts = rt.real_hosts();
  const auto me = static_cast<size_t>(rt.rank());
  const int here =
      me < hosts.size() ? static_cast<int>(std::count(hosts.begin(), hosts.end(), hosts[me])) : 1;
  return gpus_for_nccl(here, cuda::device_count());
}

}  // namespace
#endif

bool Runtime::nccl_available() const {
#ifdef TROUPE_HAVE_NCCL
  return impl_->nccl_id.size() == comm::NcclCommunicator::kUniqueIdBytes &&
         gpus_for_nccl_here(*this).empty();
#else
  return false;
#endif
}

std::shared_ptr<comm::NcclCommunicator> Runtime::nccl(int device) {
  const std::string call = "Runtime::nccl(" + std::to_string(device) + ")";
#ifndef TROUPE_HAVE_NCCL
  throw comm::Error(call +
                    ": troupe was built without NCCL (CMake found no nccl.h and libnccl; "
                    "CUDA tensors are reduced through pinned host memory instead)");
#else
  auto& m = *impl_;
  std::lock_guard<std::mutex> creating(m.nccl_mutex);
  {
    std::lock_guard<std::mutex> lock(m.dead_mutex);
    if (m.nccl) {
      if (m.nccl->device() != device)
        throw comm::Error(call + ": this rank's NCCL communicator is on device " +
                          std::to_string(m.nccl->device()) + " (one device per rank)");
      return m.nccl;
    }
  }
  const size_t id_bytes = comm::NcclCommunicator::kUniqueIdBytes;
  if (!m.nccl_id.empty() && m.nccl_id.size() != id_bytes)
    throw comm::Error(call + ": rank 0's NCCL unique id from the rendezvous has " +
                      std::to_string(m.nccl_id.size()) + " bytes (expected " +
                      std::to_string(id_bytes) + ")");
  if (m.nccl_id.empty())
    throw comm::Error(call + " on rank " + std::to_string(m.info.rank) +
                      ": rank 0 published no NCCL unique id at the rendezvous (" +
                      (m.nccl_note.empty() ? std::string("rank 0 saw no CUDA device, had "
                                                         "RuntimeOptions::nccl off, or could not "
                                                         "make an id")
                                           : m.nccl_note) +
                      ")");
  if (const std::string shared = gpus_for_nccl_here(*this); !shared.empty())
    throw comm::Error(call + " on rank " + std::to_string(m.info.rank) + ": " + shared);
  auto created = std::make_shared<comm::NcclCommunicator>(m.info.rank, m.info.world_size, m.nccl_id,
                                                          device, m.options.rendezvous_timeout);
  created->set_timeout(m.options.collective_timeout);
  std::lock_guard<std::mutex> lock(m.dead_mutex);
  m.nccl = created;
  if (!m.death.empty()) created->abort(m.death);
  return created;
#endif
}

}  // namespace troupe
