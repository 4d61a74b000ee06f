#include "rank/env.h"

#include <climits>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "comm/status.h"

namespace troupe {
namespace {

using comm::Error;

constexpr const char* kNonNegative = "a non-negative integer";
constexpr const char* kPositive = "a positive integer";
constexpr const char* kPort = "a port in 1..65535";

std::optional<std::string> lookup(const GetEnv& getenv, const char* name) {
  const char* value = getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

std::string quoted(const char* name, const std::string& value) {
  return std::string(name) + "='" + value + "'";
}

/// Parses the whole of `value` as a decimal integer in [min, max]; anything else (empty, spaces,
/// "3x", overflow) throws naming the variable, the value and `expected`.
int parse_int(const char* name, const std::string& value, long long min, long long max,
              const char* expected) {
  size_t i = 0;
  bool negative = false;
  if (i < value.size() && (value[i] == '-' || value[i] == '+')) negative = value[i++] == '-';
  if (i == value.size()) {
    throw Error(quoted(name, value) + " is not an integer (expected " + expected + ")");
  }
  long long magnitude = 0;
  bool overflow = false;
  for (; i < value.size(); ++i) {
    char c = value[i];
    if (c < '0' || c > '9') {
      throw Error(quoted(name, value) + " is not an integer (expected " + expected + ")");
    }
    if (magnitude > (LLONG_MAX - 9) / 10) {
      overflow = true;
    } else {
      magnitude = magnitude * 10 + (c - '0');
    }
  }
  long long parsed = negative ? -magnitude : magnitude;
  if (!overflow && negative && parsed < 0 && min >= 0) {
    throw Error(quoted(name, value) + " is negative (expected " + expected + ")");
  }
  if (overflow || parsed < min || parsed > max) {
    throw Error(quoted(name, value) + " is out of range (expected " + expected + ")");
  }
  return static_cast<int>(parsed);
}

int require_int(const GetEnv& getenv, const char* name, const char* because, long long min,
                const char* expected) {
  auto value = lookup(getenv, name);
  if (!value) {
    throw Error(std::string(name) + " is not set but " + because + " is (expected " + expected +
                ")");
  }
  return parse_int(name, *value, min, INT_MAX, expected);
}

std::optional<int> optional_int(const GetEnv& getenv, const char* name, long long min,
                                const char* expected) {
  auto value = lookup(getenv, name);
  if (!value) return std::nullopt;
  return parse_int(name, *value, min, INT_MAX, expected);
}

/// Applies MASTER_ADDR and MASTER_PORT when set.
void read_master(const GetEnv& getenv, RankInfo& info) {
  if (auto addr = lookup(getenv, "MASTER_ADDR")) {
    if (addr->empty()) {
      throw Error("MASTER_ADDR='' is empty (expected a host name or IP address)");
    }
    info.master_addr = *addr;
  }
  if (auto port = lookup(getenv, "MASTER_PORT")) {
    info.master_port = parse_int("MASTER_PORT", *port, 1, 65535, kPort);
  }
}

RankInfo from_torchrun(const GetEnv& getenv) {
  RankInfo info;
  info.source = "torchrun";
  bool has_rank = getenv("RANK") != nullptr;
  info.rank = require_int(getenv, "RANK", has_rank ? "RANK" : "WORLD_SIZE", 0, kNonNegative);
  info.world_size = require_int(getenv, "WORLD_SIZE", "RANK", 1, kPositive);
  info.local_rank = optional_int(getenv, "LOCAL_RANK", 0, kNonNegative).value_or(info.rank);
  info.local_world_size =
      optional_int(getenv, "LOCAL_WORLD_SIZE", 1, kPositive).value_or(info.world_size);
  read_master(getenv, info);
  if (lookup(getenv, "TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True") {
    // A restart of the same job reuses the agent's store: the key names the attempt.
    info.agent_store_key = "troupe/directory/" +
                           lookup(getenv, "TORCHELASTIC_RUN_ID").value_or("none") + "/" +
                           lookup(getenv, "TORCHELASTIC_RESTART_COUNT").value_or("0");
  }
  return info;
}

RankInfo from_mpirun(const GetEnv& getenv) {
  RankInfo info;
  info.source = "mpirun";
  bool has_rank = getenv("OMPI_COMM_WORLD_RANK") != nullptr;
  info.rank =
      require_int(getenv, "OMPI_COMM_WORLD_RANK",
                  has_rank ? "OMPI_COMM_WORLD_RANK" : "OMPI_COMM_WORLD_SIZE", 0, kNonNegative);
  info.world_size =
      require_int(getenv, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", 1, kPositive);
  info.local_rank =
      optional_int(getenv, "OMPI_COMM_WORLD_LOCAL_RANK", 0, kNonNegative).value_or(info.rank);
  info.local_world_size =
      optional_int(getenv, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, kPositive).value_or(info.world_size);
  read_master(getenv, info);
  return info;
}

/// The task count of node `node` in Slurm's compressed list ("2(x3),1" means 2,2,2,1), or nullopt
/// when the list is malformed or too short: the local size is best effort.
std::optional<int> tasks_on_node(const std::string& list, int node) {
  size_t pos = 0;
  long long first_node = 0;
  while (pos < list.size()) {
    size_t end = list.find(',', pos);
    if (end == std::string::npos) end = list.size();
    std::string entry = list.substr(pos, end - pos);
    std::string count_text = entry;
    std::string repeat_text = "1";
    size_t paren = entry.find("(x");
    if (paren != std::string::npos) {
      if (entry.back() != ')') return std::nullopt;
      count_text = entry.substr(0, paren);
      repeat_text = entry.substr(paren + 2, entry.size() - paren - 3);
    }
    try {
      int count = parse_int("SLURM_TASKS_PER_NODE", count_text, 1, INT_MAX, kPositive);
      int repeat = parse_int("SLURM_TASKS_PER_NODE", repeat_text, 1, INT_MAX, kPositive);
      if (node < first_node + repeat) return count;
      first_node += repeat;
    } catch (const Error&) {
      return std::nullopt;
    }
    pos = end + 1;
  }
  return std::nullopt;
}

RankInfo from_slurm(const GetEnv& getenv) {
  RankInfo info;
  info.source = "slurm";
  info.rank = parse_int("SLURM_PROCID", *lookup(getenv, "SLURM_PROCID"), 0, INT_MAX, kNonNegative);
  // SLURM_NPROCS is the older spelling of SLURM_NTASKS.
  if (getenv("SLURM_NTASKS") == nullptr && getenv("SLURM_NPROCS") != nullptr) {
    info.world_size = require_int(getenv, "SLURM_NPROCS", "SLURM_PROCID", 1, kPositive);
  } else {
    info.world_size = require_int(getenv, "SLURM_NTASKS", "SLURM_PROCID", 1, kPositive);
  }
  info.local_rank = optional_int(getenv, "SLURM_LOCALID", 0, kNonNegative).value_or(info.rank);
  info.local_world_size = info.world_size;
  if (auto per_node = optional_int(getenv, "SLURM_NTASKS_PER_NODE", 1, kPositive)) {
    info.local_world_size = *per_node;
  } else {
    int node = 0;
    try {
      node = optional_int(getenv, "SLURM_NODEID", 0, kNonNegative).value_or(0);
    } catch (const Error&) {
      node = -1;
    }
    for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      auto list = lookup(getenv, name);
      if (!list || node < 0) continue;
      if (auto count = tasks_on_node(*list, node)) {
        info.local_world_size = *count;
        break;
      }
    }
  }
  if (auto addr = lookup(getenv, "SLURM_LAUNCH_NODE_IPADDR"); addr && !addr->empty()) {
    info.master_addr = *addr;
  }
  read_master(getenv, info);
  return info;
}

std::string where(const RankInfo& info) { return " (source " + info.source + ")"; }

/// The variable that gave the world size of `info`, for messages.
std::string world_size_name(const RankInfo& info) {
  if (info.source == "torchrun") return "WORLD_SIZE";
  if (info.source == "mpirun") return "OMPI_COMM_WORLD_SIZE";
  if (info.source == "slurm") return "SLURM_NTASKS";
  return "world_size";
}

}  // namespace

GetEnv default_getenv() {
  return [](const char* name) -> const char* { return std::getenv(name); };
}

RankInfo rank_info_from_env(const GetEnv& getenv) {
  RankInfo info;
  if (getenv("RANK") != nullptr || getenv("WORLD_SIZE") != nullptr) {
    info = from_torchrun(getenv);
  } else if (getenv("OMPI_COMM_WORLD_RANK") != nullptr ||
             getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {
    info = from_mpirun(getenv);
  } else if (getenv("SLURM_PROCID") != nullptr) {
    info = from_slurm(getenv);
  } else {
    read_master(getenv, info);
  }
  if (const char* secret = getenv("TROUPE_JOB_SECRET")) info.job_secret = secret;
  if (const char* job = getenv("TROUPE_JOB_ID")) info.job_id = job;
  if (const char* bind = getenv("TROUPE_BIND_ADDRESS")) info.bind_address = bind;
  const char* tls[] = {getenv("TROUPE_TLS_CERT"), getenv("TROUPE_TLS_KEY"),
                       getenv("TROUPE_TLS_CA")};
  if (tls[0] || tls[1] || tls[2]) {
    const char* names[] = {"TROUPE_TLS_CERT", "TROUPE_TLS_KEY", "TROUPE_TLS_CA"};
    const int given = tls[0] ? 0 : tls[1] ? 1 : 2;
    for (int i = 0; i < 3; ++i)
      if (!tls[i] || !*tls[i])
        throw Error(std::string(names[i]) + " is not set, but " + names[given] +
                    " is (expected all three of TROUPE_TLS_CERT, TROUPE_TLS_KEY and TROUPE_TLS_CA, "
                    "or none)");
    info.tls_cert = tls[0];
    info.tls_key = tls[1];
    info.tls_ca = tls[2];
  }
  validate(info);
  return info;
}

void check_world_size(long long world_size, const std::string& what, int max) {
  if (world_size >= 1 && world_size <= max) return;
  const char* why = max == kMaxLocalRanks  ? ", the most ranks one host starts"
                    : max == kMaxWorldSize ? ", the most ranks a job may have"
                                           : "";
  throw Error(what + " = " + std::to_string(world_size) + " is out of range (expected 1.." +
              std::to_string(max) + why + ")");
}

void validate(const RankInfo& info) {
  if (info.world_size < 1) {
    throw Error("world_size " + std::to_string(info.world_size) +
                " is not positive (expected at least 1)" + where(info));
  }
  // Before anything is sized by the world: 2^31 ranks would allocate gigabytes first.
  check_world_size(info.world_size, world_size_name(info));
  if (info.rank < 0 || info.rank >= info.world_size) {
    throw Error("rank " + std::to_string(info.rank) + " is out of range (expected 0.." +
                std::to_string(info.world_size - 1) + " for world_size " +
                std::to_string(info.world_size) + ")" + where(info));
  }
  if (info.local_world_size < 1 || info.local_world_size > info.world_size) {
    throw Error("local_world_size " + std::to_string(info.local_world_size) +
                " is out of range (expected 1.." + std::to_string(info.world_size) +
                " for world_size " + std::to_string(info.world_size) + ")" + where(info));
  }
  if (info.local_rank < 0 || info.local_rank >= info.local_world_size) {
    throw Error("local_rank " + std::to_string(info.local_rank) + " is out of range (expected 0.." +
                std::to_string(info.local_world_size - 1) + " for local_world_size " +
                std::to_string(info.local_world_size) + ")" + where(info));
  }
  if (info.master_port < 1 || info.master_port > 65535) {
    throw Error("master_port " + std::to_string(info.master_port) +
                " is out of range (expected 1..65535)" + where(info));
  }
  if (info.master_addr.empty()) {
    throw Error("master_addr is empty (expected a host name or IP address)" + where(info));
  }
  // The secret itself is never printed, only its length.
  if (!info.job_secret.empty() && info.job_secret.size() < kMinJobSecretLength) {
    throw Error("TROUPE_JOB_SECRET has " + std::to_string(info.job_secret.size()) +
                " characters (expected at least " + std::to_string(kMinJobSecretLength) +
                "; troupe launch makes one of 64 hex digits)");
  }
}

comm::LinkEmulation link_emulation_from_env(int world_size, const GetEnv& getenv) {
  comm::LinkEmulation links;
  // Errors of the parsers name the text; say which variable held it.
  auto read = [&](const char* name, auto parse) {
    auto value = lookup(getenv, name);
    if (!value) return decltype(parse(std::string())){};
    try {
      return parse(*value);
    } catch (const Error& e) {
      throw Error(std::string(name) + ": " + e.what());
    }
  };
  links.all = read("TROUPE_LINK", [](const std::string& v) { return comm::parse_link_shape(v); });
  links.ranks =
      read("TROUPE_LINK_RANKS", [](const std::string& v) { return comm::parse_rank_links(v); });
  for (const auto& [rank, shape] : links.ranks) {
    if (rank >= world_size) {
      throw Error(quoted("TROUPE_LINK_RANKS", *lookup(getenv, "TROUPE_LINK_RANKS")) +
                  " names rank " + std::to_string(rank) + " (expected a rank in 0.." +
                  std::to_string(world_size - 1) + " for world_size " + std::to_string(world_size) +
                  ")");
    }
  }
  return links;
}

std::vector<std::pair<std::string, std::string>> link_emulation_env(
    const std::string& all, const std::vector<std::string>& ranks, int world_size) {
  std::vector<std::pair<std::string, std::string>> vars;
  if (!all.empty()) vars.emplace_back("TROUPE_LINK", all);
  std::string joined;
  for (const std::string& entry : ranks) joined += (joined.empty() ? "" : ";") + entry;
  if (!joined.empty()) vars.emplace_back("TROUPE_LINK_RANKS", joined);
  const std::map<std::string, std::string> env(vars.begin(), vars.end());
  link_emulation_from_env(world_size, [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
  return vars;
}

}  // namespace troupe
