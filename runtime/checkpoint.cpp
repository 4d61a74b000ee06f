#include "runtime/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <torch/serialize/archive.h>
#include <torch/version.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "runtime/runtime.h"

namespace troupe {

namespace {

constexpr char kMagic[8] = {'T', 'R', 'O', 'U', 'P', 'E', 'c', 'k'};
constexpr size_t kDigest = 32;
// magic, version, world, rank, flags (0), payload length, SHA-256 of the payload.
constexpr size_t kHeader = sizeof(kMagic) + 4 * sizeof(uint32_t) + sizeof(uint64_t) + kDigest;

std::string sha256(const char* data, size_t size) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(data, size, digest, &length, EVP_sha256(), nullptr) != 1 || length != kDigest)
    throw comm::Error("checkpoint: SHA-256 failed (OpenSSL)");
  return std::string(reinterpret_cast<const char*>(digest), kDigest);
}

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string errno_text() { return errno ? std::strerror(errno) : "unknown error"; }

// A module's parameters and buffers, by name, in a fixed order.
std::vector<std::pair<std::string, torch::Tensor>> tensors_of(torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& item : module.named_parameters(true)) out.emplace_back(item.key(), item.value());
  for (auto& item : module.named_buffers(true)) out.emplace_back("buffer " + item.key(), item.value());
  return out;
}

std::string shape_text(c10::ScalarType type, const std::vector<int64_t>& sizes) {
  std::string s = std::string(c10::toString(type)) + "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw comm::Error("checkpoint '" + path + "': cannot create the directory '" + dir.string() +
                      "': " + ec.message());
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  errno = 0;
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw comm::Error("checkpoint '" + temp + "': cannot create: " + errno_text());
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = errno_text();
      ::close(fd);
      ::unlink(temp.c_str());
      throw comm::Error("checkpoint '" + temp + "': write failed after " + std::to_string(done) +
                        " of " + std::to_string(bytes.size()) + " bytes: " + why);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string why = errno_text();
    ::unlink(temp.c_str());
    throw comm::Error("checkpoint '" + temp + "': fsync/close failed: " + why);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(temp.c_str());
    throw comm::Error("checkpoint '" + path + "': cannot rename '" + temp + "' to it: " + why);
  }
  // The rename itself is durable once the directory is synced.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace

Checkpoint::Checkpoint(Runtime& runtime) : Checkpoint(runtime.rank(), runtime.world_size()) {}

Checkpoint::Checkpoint(int rank, int world_size) : rank_(rank), world_(world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw comm::Error("Checkpoint: rank " + std::to_string(rank) + " of world size " +
                      std::to_string(world_size) + " (expected 0 <= rank < world size)");
}

Checkpoint& Checkpoint::part(const std::string& name,
                             std::function<void(comm::StateWriter&)> save,
                             std::function<void(comm::StateReader&)> load) {
  // The part's own load checks its bytes before it changes anything; it runs once every part has
  // passed the checks that need no object.
  return add(name, std::move(save), [load = std::move(load)](comm::StateReader& in) {
    const size_t size = in.remaining();
    const char* data = in.take(size);
    return std::function<void()>([load, data, size, what = in.what()] {
      comm::StateReader reader(data, size, what);
      load(reader);
      reader.expect_end();
    });
  }, Stage::checks_as_it_applies);
}

Checkpoint& Checkpoint::add(const std::string& name, std::function<void(comm::StateWriter&)> save,
                            std::function<std::function<void()>(comm::StateReader&)> prepare,
                            Stage stage) {
  for (const auto& p : parts_)
    if (p.name == name)
      throw comm::Error("Checkpoint: a second part named '" + name +
                        "' (expected one name per part; pass another name)");
  parts_.push_back(Part{name, std::move(save), std::move(prepare), stage});
  return *this;
}

Checkpoint& Checkpoint::module(torch::nn::Module& module) {
  auto save = [&module](comm::StateWriter& out) {
    auto tensors = tensors_of(module);
    out.value<uint64_t>(tensors.size());
    for (auto& [name, t] : tensors) {
      auto host = t.detach().to(torch::kCPU).contiguous();
      out.string(name);
      out.value<int8_t>(static_cast<int8_t>(host.scalar_type()));
      out.vector(host.sizes().vec());
      out.bytes(host.data_ptr(), host.numel() * host.element_size());
    }
  };
  auto prepare = [&module](comm::StateReader& in) {
    auto tensors = tensors_of(module);
    const auto count = in.value<uint64_t>();
    if (count != tensors.size())
      in.fail(std::to_string(count) + " parameters and buffers saved, the module has " +
              std::to_string(tensors.size()));
    std::vector<const char*> data;
    for (auto& [name, t] : tensors) {
      const auto saved = in.string();
      const auto type = static_cast<c10::ScalarType>(in.value<int8_t>());
      const auto sizes = in.vector<int64_t>();
      if (saved != name)
        in.fail("'" + saved + "' saved where the module has '" + name + "' (another model?)");
      if (type != t.scalar_type() || sizes != t.sizes().vec())
        in.fail("'" + name + "' saved as " + shape_text(type, sizes) + ", the module has " +
                shape_text(t.scalar_type(), t.sizes().vec()));
      data.push_back(in.take(static_cast<size_t>(t.numel()) * t.element_size()));
    }
    return std::function<void()>([tensors, data] {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < tensors.size(); ++i) {
        auto& t = tensors[i].second;
        // Through an aligned copy: the saved bytes sit at any offset of the state.
        auto host = torch::empty(t.sizes(), t.options().device(torch::kCPU));
        std::memcpy(host.data_ptr(), data[i], static_cast<size_t>(t.numel()) * t.element_size());
        t.copy_(host);
      }
    });
  };
  return add("module", save, prepare, Stage::checked);
}

void save_optimizer(const torch::optim::Optimizer& optimizer, comm::StateWriter& out) {
  out.string(TORCH_VERSION);
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream stream;
  archive.save_to(stream);
  out.string(stream.str());
}

namespace {

// A torch archive parsed from the state (before anything is changed). An optimizer's archive is
// LibTorch's own format, keyed by its own names (the state of each parameter, its "step"), which
// LibTorch does not promise to keep across versions (2.2 changed how optimizers key their state):
// one written by another LibTorch is refused, naming both versions, rather than loaded on trust.
std::shared_ptr<torch::serialize::InputArchive> read_archive(comm::StateReader& in) {
  const std::string written_by = in.string();
  if (written_by != TORCH_VERSION)
    in.fail("the optimizer's state was written by LibTorch " + written_by +
            ", this build runs LibTorch " TORCH_VERSION
            " (an optimizer's torch archive is loaded only by the LibTorch that wrote it)");
  auto archive = std::make_shared<torch::serialize::InputArchive>();
  std::istringstream stream(in.string());
  try {
    archive->load_from(stream);
  } catch (const std::exception& e) {
    in.fail(std::string("the optimizer's torch archive does not parse: ") + e.what());
  }
  return archive;
}

void apply_archive(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive,
                   const std::string& what) {
  try {
    optimizer.load(archive);
  } catch (const comm::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw comm::Error("state of " + what + ": the optimizer refused its saved state: " + e.what());
  }
}

}  // namespace

void load_optimizer(torch::optim::Optimizer& optimizer, comm::StateReader& in) {
  auto archive = read_archive(in);
  apply_archive(optimizer, *archive, in.what());
}

Checkpoint& Checkpoint::optimizer(torch::optim::Optimizer& optimizer) {
  return add(
      "optimizer", [&optimizer](comm::StateWriter& out) { save_optimizer(optimizer, out); },
      [&optimizer](comm::StateReader& in) {
        auto archive = read_archive(in);
        return std::function<void()>([&optimizer, archive, what = in.what()] {
          apply_archive(optimizer, *archive, what);
        });
      },
      Stage::optimizer);
}

Checkpoint& Checkpoint::rng() {
  auto save = [](comm::StateWriter& out) {
    auto gen = at::detail::getDefaultCPUGenerator();
    torch::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    out.value<uint64_t>(static_cast<uint64_t>(state.numel()));
    out.bytes(state.data_ptr(), static_cast<size_t>(state.numel()));
  };
  auto prepare = [](comm::StateReader& in) {
    auto gen = at::detail::getDefaultCPUGenerator();
    torch::Tensor now;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      now = gen.get_state();
    }
    const auto size = in.value<uint64_t>();
    if (size != static_cast<uint64_t>(now.numel()))
      in.fail("a generator state of " + std::to_string(size) + " bytes, this LibTorch's has " +
              std::to_string(now.numel()));
    auto state = torch::empty({now.numel()}, torch::kUInt8);
    in.bytes(state.data_ptr(), static_cast<size_t>(size));
    return std::function<void()>([state] {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    });
  };
  return add("rng", save, prepare, Stage::checked);
}

Checkpoint& Checkpoint::value(const std::string& name, int64_t& value) {
  return add(
      "value " + name, [&value](comm::StateWriter& out) { out.value(value); },
      [&value](comm::StateReader& in) {
        const auto v = in.value<int64_t>();
        return std::function<void()>([&value, v] { value = v; });
      },
      Stage::checked);
}

Checkpoint& Checkpoint::bytes(const std::string& name, std::string& bytes) {
  return add(
      "bytes " + name, [&bytes](comm::StateWriter& out) { out.string(bytes); },
      [&bytes](comm::StateReader& in) {
        auto v = in.string();
        return std::function<void()>([&bytes, v] { bytes = v; });
      },
      Stage::checked);
}

std::string Checkpoint::serialize_state() const {
  std::string payload;
  comm::StateWriter out(payload);
  out.value<uint32_t>(static_cast<uint32_t>(parts_.size()));
  std::string part;
  for (const auto& p : parts_) {
    part.clear();
    comm::StateWriter inner(part);
    p.save(inner);
    out.string(p.name);
    out.string(part);
  }
  std::string bytes;
  bytes.reserve(kHeader + payload.size());
  comm::StateWriter header(bytes);
  header.bytes(kMagic, sizeof(kMagic));
  header.value<uint32_t>(kVersion);
  header.value<uint32_t>(static_cast<uint32_t>(world_));
  header.value<uint32_t>(static_cast<uint32_t>(rank_));
  header.value<uint32_t>(0);
  header.value<uint64_t>(payload.size());
  header.bytes(sha256(payload.data(), payload.size()).data(), kDigest);
  bytes += payload;
  return bytes;
}

void Checkpoint::restore_state(const std::string& bytes, const std::string& source,
                               RestoreChecks checks) {
  auto fail = [&](const std::string& problem) {
    throw comm::Error("checkpoint " + source + ": " + problem + "; nothing was loaded");
  };
  if (bytes.size() < kHeader)
    fail("truncated: " + std::to_string(bytes.size()) + " bytes, shorter than the " +
         std::to_string(kHeader) + "-byte header");
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    fail("not a troupe checkpoint (its first bytes are not \"TROUPEck\")");
  comm::StateReader header(bytes.data() + sizeof(kMagic), kHeader - sizeof(kMagic), source);
  const auto version = header.value<uint32_t>();
  const auto world = header.value<uint32_t>();
  const auto rank = header.value<uint32_t>();
  header.value<uint32_t>();
  const auto length = header.value<uint64_t>();
  std::string digest(kDigest, '\0');
  header.bytes(digest.data(), kDigest);
  if (version != kVersion)
    fail("format version " + std::to_string(version) + ", this build reads version " +
         std::to_string(kVersion));
  if (length != bytes.size() - kHeader)
    fail(std::string(length > bytes.size() - kHeader ? "truncated" : "trailing bytes") +
         ": the header announces " + std::to_string(length) + " bytes of state, the file has " +
         std::to_string(bytes.size() - kHeader));
  const char* payload = bytes.data() + kHeader;
  if (sha256(payload, length) != digest)
    fail("corrupt: the SHA-256 of the state is " + hex(sha256(payload, length)) +
         ", the header says " + hex(digest));
  if (checks.same_world && world != static_cast<uint32_t>(world_))
    fail("saved by a job of world size " + std::to_string(world) + ", this job has world size " +
         std::to_string(world_));
  if (checks.same_rank && rank != static_cast<uint32_t>(rank_))
    fail("saved by rank " + std::to_string(rank) + ", this is rank " + std::to_string(rank_));

  comm::StateReader in(payload, length, source);
  const auto count = in.value<uint32_t>();
  std::string names, expected;
  for (const auto& p : parts_) expected += (expected.empty() ? "" : ", ") + p.name;
  std::vector<std::string> saved_names;
  std::vector<std::pair<const char*, size_t>> spans;
  for (uint32_t i = 0; i < count; ++i) {
    saved_names.push_back(in.string());
    const auto size = in.value<uint64_t>();
    if (size > in.remaining())
      fail("part '" + saved_names.back() + "' announces " + std::to_string(size) +
           " bytes, " + std::to_string(in.remaining()) + " left");
    spans.emplace_back(in.take(static_cast<size_t>(size)), static_cast<size_t>(size));
    names += (names.empty() ? "" : ", ") + saved_names.back();
  }
  in.expect_end();
  if (names != expected) fail("it holds the parts [" + names + "], this Checkpoint has [" + expected + "]");

  std::vector<std::function<void()>> commits;
  try {
    for (size_t i = 0; i < parts_.size(); ++i) {
      comm::StateReader part(spans[i].first, spans[i].second, source + " part '" + parts_[i].name + "'");
      commits.push_back(parts_[i].prepare(part));
      if (part.remaining())
        part.fail(std::to_string(part.remaining()) + " bytes left over after the part");
    }
  } catch (const comm::Error& e) {
    fail(e.what());
  }
  for (auto stage : {Stage::checks_as_it_applies, Stage::optimizer, Stage::checked})
    for (size_t i = 0; i < parts_.size(); ++i)
      if (parts_[i].stage == stage) commits[i]();
}

void Checkpoint::save(const std::string& dir) const {
  write_file_atomically(file_of(dir, rank_), serialize_state());
}

void Checkpoint::load(const std::string& dir) {
  const std::string path = file_of(dir, rank_);
  errno = 0;
  std::ifstream file(path, std::ios::binary);
  if (!file)
    throw comm::Error("checkpoint '" + path + "': cannot open: " + errno_text() +
                      " (expected the file rank " + std::to_string(rank_) + " saved)");
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) throw comm::Error("checkpoint '" + path + "': read failed: " + errno_text());
  restore_state(bytes, "'" + path + "'");
}

std::string Checkpoint::file_of(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("rank-" + std::to_string(rank) + ".troupe")).string();
}

std::string parameter_checksum(torch::nn::Module& module) {
  std::string all;
  for (auto& p : module.parameters(true)) {
    auto host = p.detach().to(torch::kCPU).contiguous();
    all.append(static_cast<const char*>(host.data_ptr()),
               static_cast<size_t>(host.numel()) * host.element_size());
  }
  return hex(sha256(all.data(), all.size()));
}

}  // namespace troupe
