#include "char_lm/corpus.h"

#include <torch/torch.h>

#include <dirent.h>
#include <sys/stat.h>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace troupe::examples {

std::vector<std::string> split_fortunes(const std::string& text) {
  std::vector<std::string> documents;
  std::string current;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    const bool last = end == std::string::npos;
    if (last) end = text.size();
    const std::string line = text.substr(start, end - start);
    if (line == "%") {
      if (!current.empty()) documents.push_back(std::move(current));
      current.clear();
    } else {
      current += line;
      current += '\n';
    }
    start = end + 1;
  }
  if (!current.empty()) documents.push_back(std::move(current));
  return documents;
}

namespace {

torch::Tensor to_ids(const std::string& text, const std::array<int, 256>& id_of) {
  auto ids = torch::empty({static_cast<int64_t>(text.size())}, torch::kInt64);
  auto* out = ids.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) out[i] = id_of[static_cast<uint8_t>(text[i])];
  return ids;
}

}  // namespace

CharCorpus make_char_corpus(const std::vector<std::string>& documents, int eval_every,
                            int64_t min_chars) {
  if (eval_every < 2)
    throw std::invalid_argument("char corpus: eval_every = " + std::to_string(eval_every) +
                                ", expected >= 2 (every eval_every-th document is held out)");
  std::string train, eval;
  CharCorpus c;
  for (size_t k = 0; k < documents.size(); ++k) {
    auto& part = k % static_cast<size_t>(eval_every) == 0 ? eval : train;
    part += documents[k];
    part += "%\n";
    ++(k % static_cast<size_t>(eval_every) == 0 ? c.eval_documents : c.train_documents);
  }
  if (static_cast<int64_t>(train.size()) < min_chars ||
      static_cast<int64_t>(eval.size()) < min_chars)
    throw std::invalid_argument(
        "char corpus: " + std::to_string(documents.size()) + " documents give " +
        std::to_string(train.size()) + " training and " + std::to_string(eval.size()) +
        " evaluation characters, expected at least " + std::to_string(min_chars) + " each");
  std::array<bool, 256> seen{};
  for (unsigned char ch : train) seen[ch] = true;
  for (unsigned char ch : eval) seen[ch] = true;
  c.id_of.fill(-1);
  for (int b = 0; b < 256; ++b)
    if (seen[static_cast<size_t>(b)]) {
      c.id_of[static_cast<size_t>(b)] = static_cast<int>(c.symbols.size());
      c.symbols.push_back(static_cast<uint8_t>(b));
    }
  c.train = to_ids(train, c.id_of);
  c.eval = to_ids(eval, c.id_of);
  return c;
}

CharCorpus load_char_corpus(const std::string& dir, int eval_every, int64_t min_chars) {
  DIR* d = opendir(dir.c_str());
  if (!d)
    throw std::runtime_error("char corpus: cannot open the folder '" + dir +
                             "' (expected the fortune files of Debian's package fortunes: "
                             "apt-get install fortunes puts them in /usr/share/games/fortunes)");
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.find('.') != std::string::npos) continue;  // ., .., *.dat, *.u8
    struct stat st {};
    if (stat((dir + "/" + name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) names.push_back(name);
  }
  closedir(d);
  if (names.empty())
    throw std::runtime_error("char corpus: no fortune files (names without a '.') in '" + dir +
                             "' (apt-get install fortunes puts them in /usr/share/games/fortunes)");
  std::sort(names.begin(), names.end());
  std::vector<std::string> documents;
  for (const auto& name : names) {
    std::ifstream in(dir + "/" + name, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    if (!in && !in.eof())
      throw std::runtime_error("char corpus: cannot read '" + dir + "/" + name + "'");
    for (auto& doc : split_fortunes(text.str())) documents.push_back(std::move(doc));
  }
  return make_char_corpus(documents, eval_every, min_chars);
}

double unigram_bits_per_char(const torch::Tensor& train, const torch::Tensor& eval, int64_t vocab) {
  auto counts = torch::bincount(train, {}, vocab).to(torch::kFloat64) + 1.0;
  auto log2p = torch::log2(counts / counts.sum());
  return -log2p.index_select(0, eval).mean().item<double>();
}

WindowSampler::WindowSampler(torch::Tensor stream, int64_t length, uint64_t seed)
    : stream_(std::move(stream)), length_(length), generator_(seed) {
  if (length_ < 1 || stream_.numel() < length_ + 1)
    throw std::invalid_argument("window sampler: windows of " + std::to_string(length_ + 1) +
                                " symbols from a stream of " + std::to_string(stream_.numel()) +
                                ", expected a length >= 1 and a stream at least that long");
}

void WindowSampler::next(int64_t batch, torch::Tensor& inputs, torch::Tensor& targets) {
  std::uniform_int_distribution<int64_t> start(0, stream_.numel() - length_ - 1);
  auto index = torch::empty({batch, length_ + 1}, torch::kInt64);
  auto* out = index.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t s = start(generator_);
    for (int64_t t = 0; t <= length_; ++t) out[b * (length_ + 1) + t] = s + t;
  }
  auto window = stream_.index_select(0, index.view({-1})).view({batch, length_ + 1});
  inputs = window.narrow(1, 0, length_);
  targets = window.narrow(1, 1, length_);
}

void eval_windows(const torch::Tensor& stream, int64_t length, int64_t windows,
                  torch::Tensor& inputs, torch::Tensor& targets) {
  const int64_t whole = stream.numel() / (length + 1);
  if (whole < 1)
    throw std::invalid_argument("eval windows: a stream of " + std::to_string(stream.numel()) +
                                " symbols holds no window of " + std::to_string(length + 1));
  const int64_t n = std::min(whole, windows);
  auto window = stream.narrow(0, 0, n * (length + 1)).view({n, length + 1});
  inputs = window.narrow(1, 0, length);
  targets = window.narrow(1, 1, length);
}

}  // namespace troupe::examples
