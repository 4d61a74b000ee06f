#include "rank/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <torch/serialize/archive.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>

#include "rank/runtime.h"

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
  for (auto& item : module.named_buffers(true))
    out.emplace_back("buffer " + item.key(), item.value());
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

Checkpoint::Checkpoint(Runtime& runtime) : Checkpoint(runtime.rank(), runtime.world_size()) {
  runtime_ = &runtime;
}

Checkpoint::Checkpoint(int rank, int world_size) : rank_(rank), world_(world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw comm::Error("Checkpoint: rank " + std::to_string(rank) + " of world size " +
                      std::to_string(world_size) + " (expected 0 <= rank < world size)");
}

Checkpoint& Checkpoint::part(const std::string& name, std::function<void(comm::StateWriter&)> save,
                             std::function<void(comm::StateReader&)> load) {
  // The part's own load checks its bytes before it changes anything; it runs once every part has
  // passed the checks that need no object.
  return add(
      name, std::move(save),
      [load = std::move(load)](comm::StateReader& in) {
        const size_t size = in.remaining();
        const char* data = in.take(size);
        return std::function<void()>([load, data, size, what = in.what()] {
          comm::StateReader reader(data, size, what);
          load(reader);
          reader.expect_end();
        });
      },
      Stage::checks_as_it_applies, Kind::rank_local);
}

Checkpoint& Checkpoint::add(const std::string& name, std::function<void(comm::StateWriter&)> save,
                            std::function<std::function<void()>(comm::StateReader&)> prepare,
                            Stage stage, Kind kind, void* target) {
  if (name.empty()) throw comm::Error("Checkpoint: a part with an empty name (expected a name)");
  for (const auto& p : parts_)
    if (p.name == name)
      throw comm::Error("Checkpoint: a second part named '" + name +
                        "' (expected one name per part; module() and optimizer() take a name as "
                        "their second argument)");
  parts_.push_back(Part{name, std::move(save), std::move(prepare), stage, kind, target});
  return *this;
}

Checkpoint& Checkpoint::module(torch::nn::Module& module, const std::string& name) {
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
  return add(name, save, prepare, Stage::checked, Kind::module, &module);
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

Checkpoint& Checkpoint::optimizer(torch::optim::Optimizer& optimizer, const std::string& name) {
  return add(
      name, [&optimizer](comm::StateWriter& out) { save_optimizer(optimizer, out); },
      [&optimizer](comm::StateReader& in) {
        auto archive = read_archive(in);
        return std::function<void()>(
            [&optimizer, archive, what = in.what()] { apply_archive(optimizer, *archive, what); });
      },
      Stage::optimizer, Kind::optimizer, &optimizer);
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
  return add("rng", save, prepare, Stage::checked, Kind::rank_local);
}

Checkpoint& Checkpoint::value(const std::string& name, int64_t& value) {
  return add(
      "value " + name, [&value](comm::StateWriter& out) { out.value(value); },
      [&value](comm::StateReader& in) {
        const auto v = in.value<int64_t>();
        return std::function<void()>([&value, v] { value = v; });
      },
      Stage::checked, Kind::value);
}

Checkpoint& Checkpoint::bytes(const std::string& name, std::string& bytes) {
  return add(
      "bytes " + name, [&bytes](comm::StateWriter& out) { out.string(bytes); },
      [&bytes](comm::StateReader& in) {
        auto v = in.string();
        return std::function<void()>([&bytes, v] { bytes = v; });
      },
      Stage::checked, Kind::value);
}

Checkpoint& Checkpoint::setting(const std::string& name, int64_t value) {
  return add(
      "setting " + name, [value](comm::StateWriter& out) { out.value(value); },
      [name, value](comm::StateReader& in) {
        const auto saved = in.value<int64_t>();
        if (saved != value)
          in.fail("saved with " + name + " " + std::to_string(saved) + ", this run has " + name +
                  " " + std::to_string(value) +
                  " (expected the same: the saved state depends on it)");
        return std::function<void()>([] {});
      },
      Stage::checked, Kind::setting);
}

Checkpoint& Checkpoint::setting(const std::string& name, const std::string& value) {
  return add(
      "setting " + name, [value](comm::StateWriter& out) { out.string(value); },
      [name, value](comm::StateReader& in) {
        const auto saved = in.string();
        if (saved != value)
          in.fail("saved with " + name + " '" + saved + "', this run has " + name + " '" + value +
                  "' (expected the same: the saved state depends on it)");
        return std::function<void()>([] {});
      },
      Stage::checked, Kind::setting);
}

namespace {

// The header's kind: a rank's state, or the manifest of a consolidated checkpoint.
constexpr uint32_t kRankState = 0;
constexpr uint32_t kConsolidated = 1;

std::string frame(const std::string& payload, int world, int rank, uint32_t kind) {
  std::string bytes;
  bytes.reserve(kHeader + payload.size());
  comm::StateWriter header(bytes);
  header.bytes(kMagic, sizeof(kMagic));
  header.value<uint32_t>(Checkpoint::kVersion);
  header.value<uint32_t>(static_cast<uint32_t>(world));
  header.value<uint32_t>(static_cast<uint32_t>(rank));
  header.value<uint32_t>(kind);
  header.value<uint64_t>(payload.size());
  header.bytes(sha256(payload.data(), payload.size()).data(), kDigest);
  bytes += payload;
  return bytes;
}

struct Framed {
  uint32_t world, rank, kind;
  const char* payload;
  uint64_t length;
};

// Checks the header's magic, version, length and checksum; `fail` throws.
Framed unframe(const std::string& bytes, const std::string& source,
               const std::function<void(const std::string&)>& fail) {
  if (bytes.size() < kHeader)
    fail("truncated: " + std::to_string(bytes.size()) + " bytes, shorter than the " +
         std::to_string(kHeader) + "-byte header");
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    fail("not a troupe checkpoint (its first bytes are not \"TROUPEck\")");
  comm::StateReader header(bytes.data() + sizeof(kMagic), kHeader - sizeof(kMagic), source);
  const auto version = header.value<uint32_t>();
  Framed f{};
  f.world = header.value<uint32_t>();
  f.rank = header.value<uint32_t>();
  f.kind = header.value<uint32_t>();
  f.length = header.value<uint64_t>();
  std::string digest(kDigest, '\0');
  header.bytes(digest.data(), kDigest);
  if (version != Checkpoint::kVersion)
    fail("format version " + std::to_string(version) + ", this build reads version " +
         std::to_string(Checkpoint::kVersion));
  if (f.length != bytes.size() - kHeader)
    fail(std::string(f.length > bytes.size() - kHeader ? "truncated" : "trailing bytes") +
         ": the header announces " + std::to_string(f.length) + " bytes of state, the file has " +
         std::to_string(bytes.size() - kHeader));
  f.payload = bytes.data() + kHeader;
  if (sha256(f.payload, f.length) != digest)
    fail("corrupt: the SHA-256 of the state is " + hex(sha256(f.payload, f.length)) +
         ", the header says " + hex(digest));
  if (f.kind != kRankState && f.kind != kConsolidated)
    fail("of kind " + std::to_string(f.kind) + " (expected 0, a rank's state, or 1, consolidated)");
  return f;
}

std::string read_file(const std::string& path, const std::string& expected) {
  errno = 0;
  std::ifstream file(path, std::ios::binary);
  if (!file)
    throw comm::Error("checkpoint '" + path + "': cannot open: " + errno_text() + " (expected " +
                      expected + ")");
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) throw comm::Error("checkpoint '" + path + "': read failed: " + errno_text());
  return bytes;
}

}  // namespace

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
  return frame(payload, world_, rank_, kRankState);
}

std::vector<std::function<void()>> Checkpoint::prepare_restore(const std::string& bytes,
                                                               const std::string& source,
                                                               RestoreChecks checks) const {
  auto fail = [&](const std::string& problem) {
    throw comm::Error("checkpoint " + source + ": " + problem + "; nothing was loaded");
  };
  const Framed framed = unframe(bytes, source, fail);
  const auto world = framed.world;
  const auto rank = framed.rank;
  const char* payload = framed.payload;
  const auto length = framed.length;
  if (framed.kind == kConsolidated)
    fail(
        "a consolidated checkpoint's manifest, not a rank's state (expected a rank's file; load "
        "this one with load_consolidated)");
  if (checks.same_world && world != static_cast<uint32_t>(world_))
    fail("saved by a job of world size " + std::to_string(world) + ", this job has world size " +
         std::to_string(world_) +
         " (a rank's checkpoint continues the same job; save_consolidated / load_consolidated "
         "carry the model to another world size)");
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
      fail("part '" + saved_names.back() + "' announces " + std::to_string(size) + " bytes, " +
           std::to_string(in.remaining()) + " left");
    spans.emplace_back(in.take(static_cast<size_t>(size)), static_cast<size_t>(size));
    names += (names.empty() ? "" : ", ") + saved_names.back();
  }
  in.expect_end();
  if (names != expected)
    fail("it holds the parts [" + names + "], this Checkpoint has [" + expected + "]");

  std::vector<std::function<void()>> commits;
  try {
    for (size_t i = 0; i < parts_.size(); ++i) {
      comm::StateReader part(spans[i].first, spans[i].second,
                             source + " part '" + parts_[i].name + "'");
      commits.push_back(parts_[i].prepare(part));
      if (part.remaining())
        part.fail(std::to_string(part.remaining()) + " bytes left over after the part");
    }
  } catch (const comm::Error& e) {
    fail(e.what());
  }
  return commits;
}

void Checkpoint::apply(const std::vector<std::function<void()>>& commits) const {
  for (auto stage : {Stage::checks_as_it_applies, Stage::optimizer, Stage::checked})
    for (size_t i = 0; i < parts_.size(); ++i)
      if (parts_[i].stage == stage && commits[i]) commits[i]();
}

void Checkpoint::restore_state(const std::string& bytes, const std::string& source,
                               RestoreChecks checks) {
  apply(prepare_restore(bytes, source, checks));
}

namespace {
void remove_stale_temporaries(const std::filesystem::path& dir, int rank);
}  // namespace

void Checkpoint::save(const std::string& dir) const {
  // What an earlier process of this rank left half-written (it died mid-save) goes first.
  remove_stale_temporaries(dir, rank_);
  write_file_atomically(file_of(dir, rank_), serialize_state());
}

void Checkpoint::load(const std::string& dir) {
  const std::string path = file_of(dir, rank_);
  restore_state(read_file(path, "the file rank " + std::to_string(rank_) + " saved"),
                "'" + path + "'");
}

std::string Checkpoint::file_of(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("rank-" + std::to_string(rank) + ".troupe")).string();
}

// ---- The job's checkpoints: a step every rank completed
// -----------------------------------------

namespace {

namespace fs = std::filesystem;

std::string record_of(const std::string& dir, int rank) {
  return (fs::path(dir) / ("rank-" + std::to_string(rank) + ".complete")).string();
}

// "step-<n>" -> n; anything else -> -1.
int64_t step_of_dir_name(const std::string& name) {
  const std::string prefix = "step-";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return -1;
  int64_t step = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (INT64_MAX - 9) / 10) return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

// Removes this rank's temporary files in `dir` (those of processes that died mid-write: a live
// write of this rank's is never concurrent with its own save).
void remove_stale_temporaries(const fs::path& dir, int rank) {
  const std::string mine[] = {"rank-" + std::to_string(rank) + ".troupe.tmp.",
                              "rank-" + std::to_string(rank) + ".complete.tmp."};
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    for (const auto& prefix : mine)
      if (name.compare(0, prefix.size(), prefix) == 0) fs::remove(it->path(), ec);
  }
}

// Removes this rank's file and temporaries in each step folder of `dir` whose step `drop` selects,
// then the folder itself when that left it empty (the other ranks' files stay theirs). The caller
// guarantees that no rank is writing into a selected folder meanwhile.
void remove_steps_of(const std::string& dir, int rank, const std::function<bool(int64_t)>& drop) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const int64_t s = step_of_dir_name(it->path().filename().string());
    if (s < 0 || !drop(s)) continue;
    std::error_code ignore;
    fs::remove(it->path() / fs::path(Checkpoint::file_of_step(dir, s, rank)).filename(), ignore);
    remove_stale_temporaries(it->path(), rank);
    fs::remove(it->path(), ignore);  // only when empty
  }
}

// The ranks whose flag (gathered from each) is 0.
std::vector<int> ranks_without(const std::vector<int64_t>& flags) {
  std::vector<int> out;
  for (size_t r = 0; r < flags.size(); ++r)
    if (!flags[r]) out.push_back(static_cast<int>(r));
  return out;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace

std::string Checkpoint::file_of_step(const std::string& dir, int64_t step, int rank) {
  return file_of((fs::path(dir) / ("step-" + std::to_string(step))).string(), rank);
}

std::optional<int64_t> Checkpoint::last_complete_step(const std::string& dir, int rank) {
  const std::string path = record_of(dir, rank);
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  const std::string text = read_file(path, "the record of rank " + std::to_string(rank));
  // "step <n>\n": what save_step writes.
  const std::string prefix = "step ";
  int64_t step = -1;
  if (text.size() > prefix.size() + 1 && text.compare(0, prefix.size(), prefix) == 0 &&
      text.back() == '\n')
    step = step_of_dir_name("step-" + text.substr(prefix.size(), text.size() - prefix.size() - 1));
  if (step < 0)
    throw comm::Error("checkpoint record '" + path + "': holds \"" + text.substr(0, 40) +
                      "\" (expected \"step <n>\" as save_step writes it)");
  return step;
}

std::vector<int64_t> Checkpoint::gather(int64_t mine, const std::string& what) const {
  if (world_ == 1) return {mine};
  if (!runtime_)
    throw comm::Error("Checkpoint: " + what +
                      " is a collective of the job, and this Checkpoint of rank " +
                      std::to_string(rank_) + " of world size " + std::to_string(world_) +
                      " has no Runtime (expected Checkpoint(runtime))");
  std::vector<int64_t> all(static_cast<size_t>(world_));
  try {
    runtime_->comm().allgather(&mine, all.data(), 1, comm::DataType::int64);
  } catch (const comm::Error& e) {
    throw comm::Error("Checkpoint: " + what + ": " + e.what());
  }
  return all;
}

void Checkpoint::save_step(const std::string& dir, int64_t step) {
  if (step < 0)
    throw comm::Error("Checkpoint::save_step('" + dir + "', " + std::to_string(step) +
                      "): a negative step (expected >= 0)");
  const std::string what = "save of step " + std::to_string(step) + " in '" + dir + "'";
  // Write this rank's file; a failure is everyone's (no record is written anywhere).
  std::string error;
  try {
    remove_stale_temporaries(dir, rank_);  // an interrupted record's
    // The rank's file of the step is its save() there, which removes that folder's temporaries.
    save(fs::path(file_of_step(dir, step, rank_)).parent_path().string());
  } catch (const comm::Error& e) {
    error = e.what();
  }
  const auto written = gather(error.empty() ? 1 : 0, what);
  if (!error.empty()) throw comm::Error(error + " (the last complete step stays the job's)");
  const auto failed = ranks_without(written);
  if (!failed.empty())
    throw comm::Error(
        "checkpoint " + what + ": " + ranks_text(failed) +
        " could not write their file (see their error); the last complete step stays the job's");
  // Every rank's file is durable: record the step, then keep it and the previous complete step
  // (another rank may die before its own record; load_last then takes this step from ours, or the
  // previous one from everyone's).
  const auto previous = last_complete_step(dir, rank_);
  write_file_atomically(record_of(dir, rank_), "step " + std::to_string(step) + "\n");
  // Only earlier steps: a rank that left this save's barrier first may already be saving a later
  // step, and its folder is empty until its file lands there (removing it made that rank's write
  // fail). Later steps left by a killed save go at the resume (load_last).
  remove_steps_of(dir, rank_, [&](int64_t s) { return s < step && (!previous || s != *previous); });
}

int64_t Checkpoint::load_last(const std::string& dir) {
  const std::string what = "resume from '" + dir + "'";
  // -2: this rank's record is unreadable (its error is thrown below, the others name the rank).
  std::string error;
  int64_t mine = -1;
  try {
    mine = last_complete_step(dir, rank_).value_or(-1);
  } catch (const comm::Error& e) {
    error = e.what();
    mine = -2;
  }
  const auto records = gather(mine, what);
  if (!error.empty()) throw comm::Error(error);
  std::vector<int> unreadable;
  int64_t last = -1;
  for (int r = 0; r < world_; ++r) {
    const int64_t s = records[static_cast<size_t>(r)];
    if (s == -2) unreadable.push_back(r);
    last = std::max(last, s);
  }
  if (!unreadable.empty())
    throw comm::Error("checkpoint " + what + ": the record of " + ranks_text(unreadable) +
                      " is unreadable (see their error)");
  if (last < 0)
    throw comm::Error("checkpoint " + what + ": no rank recorded a complete step (expected " +
                      record_of(dir, rank_) + " or another rank's, written by save_step)");
  // Some rank's record of `last` proves that every rank wrote its file of that step.
  const std::string path = file_of_step(dir, last, rank_);
  std::error_code ec;
  const bool have = fs::exists(path, ec);
  const auto held = gather(have ? 1 : 0, what);
  const auto lacking = ranks_without(held);
  std::vector<int> recorded;
  for (int r = 0; r < world_; ++r)
    if (records[static_cast<size_t>(r)] == last) recorded.push_back(r);
  if (!lacking.empty())
    throw comm::Error("checkpoint " + what + ": step " + std::to_string(last) +
                      " was recorded complete by " + ranks_text(recorded) +
                      ", but its file is missing on " + ranks_text(lacking) + " (" +
                      file_of_step(dir, last, lacking.front()) +
                      "): the ranks' folders hold different checkpoints (another job's, or files "
                      "removed); nothing was loaded");
  // No rank recorded a step after `last`: folders of later steps are what killed saves left. Every
  // rank is inside this call until the gather below, so none is saving into them yet.
  remove_steps_of(dir, rank_, [&](int64_t s) { return s > last; });
  // Every rank checks its file before any rank changes anything. (The commits read from `bytes`: it
  // lives until they ran.)
  std::string bytes;
  std::vector<std::function<void()>> commits;
  error.clear();
  try {
    bytes = read_file(
        path, "the file rank " + std::to_string(rank_) + " saved at step " + std::to_string(last));
    commits = prepare_restore(bytes, "'" + path + "'", {});
  } catch (const comm::Error& e) {
    error = e.what();
  }
  const auto checked = gather(error.empty() ? 1 : 0, what);
  if (!error.empty()) throw comm::Error(error);
  const auto refused = ranks_without(checked);
  if (!refused.empty())
    throw comm::Error("checkpoint " + what + ": " + ranks_text(refused) +
                      " refused their file of step " + std::to_string(last) +
                      " (see their error); nothing was loaded");
  apply(commits);
  if (mine != last)
    write_file_atomically(record_of(dir, rank_), "step " + std::to_string(last) + "\n");
  return last;
}

// ---- The consolidated checkpoint: the model from rank 0, for any world size
// --------------------

namespace {

constexpr const char* kManifest = "consolidated.troupe";

// A part's file: its name with anything but letters, digits, '.', '-' and '_' as '_'.
std::string file_name_of(const std::string& part) {
  std::string out;
  for (char c : part)
    out +=
        (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_') ? c : '_';
  return out + ".pt";
}

std::string archive_bytes(const std::function<void(torch::serialize::OutputArchive&)>& save) {
  torch::serialize::OutputArchive archive;
  save(archive);
  std::ostringstream stream;
  archive.save_to(stream);
  return stream.str();
}

// The tensors of `module` read from its archive (what Module::save wrote: its own parameters and
// buffers by name, each child in an archive under its name), checked against the module's names,
// shapes and dtypes; `where` names the file.
void read_module_tensors(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                         const std::string& prefix, const std::string& where,
                         std::vector<std::pair<torch::Tensor, torch::Tensor>>& out) {
  auto fail = [&](const std::string& problem) {
    throw comm::Error("checkpoint " + where + ": " + problem + "; nothing was loaded");
  };
  auto take = [&](const std::string& key, const torch::Tensor& target, bool buffer) {
    torch::Tensor saved;
    if (!archive.try_read(key, saved, buffer) || !saved.defined())
      fail("no " + std::string(buffer ? "buffer" : "parameter") + " '" + prefix + key +
           "' in it (another model?)");
    if (saved.scalar_type() != target.scalar_type() || saved.sizes() != target.sizes())
      fail("'" + prefix + key + "' saved as " +
           shape_text(saved.scalar_type(), saved.sizes().vec()) + ", the module has " +
           shape_text(target.scalar_type(), target.sizes().vec()));
    out.emplace_back(target, saved);
  };
  for (auto& item : module.named_parameters(false)) take(item.key(), item.value(), false);
  for (auto& item : module.named_buffers(false)) take(item.key(), item.value(), true);
  for (auto& child : module.named_children()) {
    torch::serialize::InputArchive child_archive;
    if (!archive.try_read(child.key(), child_archive))
      fail("no module '" + prefix + child.key() + "' in it (another model?)");
    read_module_tensors(*child.value(), child_archive, prefix + child.key() + ".", where, out);
  }
}

}  // namespace

void Checkpoint::save_consolidated(const std::string& dir) const {
  const std::string what = "consolidated save in '" + dir + "'";
  std::string error;
  if (rank_ == 0) {
    try {
      std::error_code ec;
      fs::create_directories(dir, ec);
      // Without the manifest the folder is no checkpoint: a crash below leaves none, never a
      // manifest that names files of two saves.
      fs::remove(fs::path(dir) / kManifest, ec);
      std::string payload;
      comm::StateWriter out(payload);
      uint32_t count = 0;
      for (const auto& p : parts_) count += p.kind != Kind::rank_local;
      out.value<uint32_t>(count);
      std::vector<std::string> files;
      for (const auto& p : parts_) {
        if (p.kind == Kind::rank_local) continue;
        std::string body;
        comm::StateWriter part(body);
        if (p.kind == Kind::module || p.kind == Kind::optimizer) {
          const std::string file = file_name_of(p.name);
          if (file == kManifest || std::find(files.begin(), files.end(), file) != files.end())
            throw comm::Error("checkpoint " + what + ": part '" + p.name +
                              "' would be written to " + file +
                              ", another part's file (expected names that differ in letters, "
                              "digits, '.', '-' or '_')");
          files.push_back(file);
          const std::string bytes =
              p.kind == Kind::module ? archive_bytes([&](auto& a) {
                static_cast<torch::nn::Module*>(p.target)->save(a);
              })
                                     : archive_bytes([&](auto& a) {
                                         static_cast<torch::optim::Optimizer*>(p.target)->save(a);
                                       });
          write_file_atomically((fs::path(dir) / file).string(), bytes);
          part.string(file);
          part.string(sha256(bytes.data(), bytes.size()));
          part.string(TORCH_VERSION);
        } else {
          p.save(part);
        }
        out.string(p.name);
        out.value<uint8_t>(static_cast<uint8_t>(p.kind));
        out.string(body);
      }
      write_file_atomically((fs::path(dir) / kManifest).string(),
                            frame(payload, world_, 0, kConsolidated));
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  const auto written = gather(error.empty() ? 1 : 0, what);
  if (!error.empty()) throw comm::Error(error);
  if (!written[0])
    throw comm::Error("checkpoint " + what + ": rank 0 could not write it (see its error)");
}

namespace {

// A part as the manifest holds it: its name, its kind (Checkpoint's, as a byte) and its bytes.
struct ManifestEntry {
  std::string name;
  uint8_t kind;
  std::string body;
};

// The parts of the consolidated checkpoint's manifest at `path` (`source` names it; `fail`
// throws).
std::vector<ManifestEntry> read_manifest(const std::string& path, const std::string& source,
                                         const std::function<void(const std::string&)>& fail) {
  const std::string bytes = read_file(path, "the manifest save_consolidated writes last");
  const Framed framed = unframe(bytes, source, fail);
  if (framed.kind != kConsolidated)
    fail("a rank's state, not a consolidated checkpoint (expected what save_consolidated wrote)");
  comm::StateReader in(framed.payload, framed.length, source);
  const auto count = in.value<uint32_t>();
  std::vector<ManifestEntry> entries;
  for (uint32_t i = 0; i < count; ++i) {
    ManifestEntry e;
    e.name = in.string();
    e.kind = in.value<uint8_t>();
    e.body = in.string();
    entries.push_back(std::move(e));
  }
  in.expect_end();
  return entries;
}

// A module's or optimizer's torch archive, from the file its manifest entry names.
struct ArchiveFile {
  std::string file;        // the file's path
  std::string written_by;  // the LibTorch version that wrote it
  std::shared_ptr<torch::serialize::InputArchive> archive;
};

// Reads the file that part `part`'s manifest entry `body` names in `dir`, checks it against the
// entry's SHA-256 and parses it; `fail` throws.
ArchiveFile read_archive_file(comm::StateReader& body, const std::string& dir,
                              const std::string& part,
                              const std::function<void(const std::string&)>& fail) {
  ArchiveFile out;
  out.file = (fs::path(dir) / body.string()).string();
  const std::string digest = body.string();
  out.written_by = body.string();
  body.expect_end();
  const std::string data = read_file(out.file, "the file of part '" + part + "'");
  if (sha256(data.data(), data.size()) != digest)
    fail("'" + out.file + "' has SHA-256 " + hex(sha256(data.data(), data.size())) +
         ", the manifest says " + hex(digest) + " (changed after the save, or another save's)");
  out.archive = std::make_shared<torch::serialize::InputArchive>();
  try {
    std::istringstream stream(data);
    out.archive->load_from(stream);
  } catch (const std::exception& e) {
    fail("'" + out.file + "' does not parse as a torch archive: " + e.what());
  }
  return out;
}

}  // namespace

void Checkpoint::load_consolidated(const std::string& dir) {
  const std::string path = (fs::path(dir) / kManifest).string();
  const std::string source = "'" + path + "'";
  auto fail = [&](const std::string& problem) {
    throw comm::Error("checkpoint " + source + ": " + problem + "; nothing was loaded");
  };
  const std::vector<ManifestEntry> saved = read_manifest(path, source, fail);
  std::string names, expected;
  for (const ManifestEntry& s : saved) names += (names.empty() ? "" : ", ") + s.name;
  std::vector<size_t> mine;
  for (size_t i = 0; i < parts_.size(); ++i)
    if (parts_[i].kind != Kind::rank_local) {
      mine.push_back(i);
      expected += (expected.empty() ? "" : ", ") + parts_[i].name;
    }
  if (names != expected)
    fail("it holds the parts [" + names + "], this Checkpoint's model and values are [" + expected +
         "] (rng, algorithm and custom parts are a rank's, not consolidated)");

  std::vector<std::function<void()>> commits(parts_.size());
  for (size_t k = 0; k < mine.size(); ++k) {
    const Part& p = parts_[mine[k]];
    const ManifestEntry& s = saved[k];
    const std::string where = source + " part '" + p.name + "'";
    comm::StateReader body(s.body.data(), s.body.size(), where);
    if (static_cast<Kind>(s.kind) != p.kind) body.fail("saved as another kind of part");
    if (p.kind == Kind::module) {
      const ArchiveFile f = read_archive_file(body, dir, p.name, fail);
      std::vector<std::pair<torch::Tensor, torch::Tensor>> tensors;
      read_module_tensors(*static_cast<torch::nn::Module*>(p.target), *f.archive, "",
                          "'" + f.file + "'", tensors);
      commits[mine[k]] = [tensors] {
        torch::NoGradGuard no_grad;
        for (const auto& [target, value] : tensors) target.copy_(value);
      };
    } else if (p.kind == Kind::optimizer) {
      const ArchiveFile f = read_archive_file(body, dir, p.name, fail);
      if (f.written_by != TORCH_VERSION)
        fail("optimizer '" + p.name + "' was written by LibTorch " + f.written_by +
             ", this build runs LibTorch " TORCH_VERSION
             " (an optimizer's torch archive is loaded only by the LibTorch that wrote it)");
      auto* optimizer = static_cast<torch::optim::Optimizer*>(p.target);
      commits[mine[k]] = [optimizer, archive = f.archive, file = f.file] {
        apply_archive(*optimizer, *archive, file);
      };
    } else {
      try {
        commits[mine[k]] = p.prepare(body);
        body.expect_end();
      } catch (const comm::Error& e) {
        fail(e.what());
      }
    }
  }
  apply(commits);
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
