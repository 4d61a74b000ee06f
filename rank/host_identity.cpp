#include "rank/host_identity.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace troupe {

std::string machine_identity(const std::string& shm_dir, const std::string& boot_id_path) {
  std::string boot;
  std::ifstream in(boot_id_path);
  std::getline(in, boot);
  std::string id;
  if (!boot.empty()) {
    id = "boot " + boot;
  } else {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
    id = std::string("name ") + (name[0] ? name : "unknown-host");
  }
  struct stat st {};
  if (::stat(shm_dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    id += " shm " + std::to_string(static_cast<unsigned long long>(st.st_dev)) + ":" +
          std::to_string(static_cast<unsigned long long>(st.st_ino));
  } else {
    id += " shm none";
  }
  return id;
}

std::vector<int> real_host_indices(const std::vector<std::string>& names,
                                   const std::vector<std::string>& identities) {
  if (names.size() != identities.size())
    throw comm::Error("real_host_indices: " + std::to_string(names.size()) + " host names but " +
                      std::to_string(identities.size()) +
                      " machine identities (expected one "
                      "of each per rank)");
  std::vector<std::pair<std::string, std::string>> seen;
  std::vector<int> out;
  out.reserve(names.size());
  for (size_t r = 0; r < names.size(); ++r) {
    const std::pair<std::string, std::string> key{names[r], identities[r]};
    auto at = std::find(seen.begin(), seen.end(), key);
    if (at == seen.end()) at = seen.insert(seen.end(), key);
    out.push_back(static_cast<int>(at - seen.begin()));
  }
  return out;
}

namespace {

// The medium of UCX's transports: memory between processes of one kernel, or a network.
std::string medium_of(const std::string& transports) {
  bool memory = false, network = false;
  std::istringstream words(transports);
  for (std::string w; words >> w;) {
    const std::string tl = w.substr(0, w.find('/'));
    if (tl == "posix" || tl == "sysv" || tl == "cma" || tl == "knem" || tl == "xpmem")
      memory = true;
    else if (tl != "self")
      network = true;
  }
  if (memory && network) return "shared memory and network";
  if (memory) return "shared memory";
  if (network) return "network";
  return "self";
}

}  // namespace

std::vector<std::string> describe_peer_paths(int rank, const std::vector<std::string>& names,
                                             const std::vector<int>& host_index,
                                             const std::vector<std::string>& transports) {
  std::vector<std::string> out;
  for (size_t r = 0; r < host_index.size(); ++r) {
    if (static_cast<int>(r) == rank) {
      out.push_back("self");
      continue;
    }
    std::string path = host_index[r] == host_index[static_cast<size_t>(rank)]
                           ? std::string("same host")
                           : "other host (" + names[r] + ")";
    if (r < transports.size() && !transports[r].empty())
      path += ", " + medium_of(transports[r]) + ": " + transports[r];
    out.push_back(std::move(path));
  }
  return out;
}

std::vector<std::string> gather_identities(comm::Communicator& comm, const std::string& mine) {
  const size_t world = static_cast<size_t>(comm.world_size());
  std::string padded = mine.substr(0, kMaxIdentityBytes);
  padded.resize(kMaxIdentityBytes, '\0');
  std::string all(world * kMaxIdentityBytes, '\0');
  // Bytes as int32 words (comm has no byte type; an allgather only moves them).
  comm.allgather(padded.data(), all.data(), kMaxIdentityBytes / 4, comm::DataType::int32);
  std::vector<std::string> out;
  for (size_t r = 0; r < world; ++r) {
    std::string one = all.substr(r * kMaxIdentityBytes, kMaxIdentityBytes);
    one.resize(one.find('\0') == std::string::npos ? one.size() : one.find('\0'));
    out.push_back(std::move(one));
  }
  return out;
}

}  // namespace troupe
