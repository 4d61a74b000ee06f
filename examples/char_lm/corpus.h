#pragma once
/// A character-level text corpus for the language-model example: the fortune files that Debian's
/// `fortunes` package installs (/usr/share/games/fortunes), cut into documents (the fortunes, which
/// the files separate by lines holding a single '%'), every `eval_every`-th document held out for
/// evaluation, and both parts turned into streams of symbol ids.
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace troupe::examples {

/// Symbols are bytes: the vocabulary is the set of bytes that occur anywhere in the corpus, in
/// byte order, so the same files give the same ids on every rank and every run.
struct CharCorpus {
  std::vector<uint8_t> symbols;  // id -> byte
  std::array<int, 256> id_of{};  // byte -> id, -1 where the byte does not occur
  torch::Tensor train;           // int64 [train characters]
  torch::Tensor eval;            // int64 [eval characters]
  int64_t train_documents = 0;
  int64_t eval_documents = 0;
  int64_t vocab() const { return static_cast<int64_t>(symbols.size()); }
};

/// The documents of one fortune file: the text between lines that hold only '%', each ending in
/// its own newline; empty documents are dropped.
std::vector<std::string> split_fortunes(const std::string& text);

/// Builds the corpus from documents in order: document k goes to eval when k % eval_every == 0,
/// else to train; each document is followed by "%\n" as in the files. Throws std::invalid_argument
/// for eval_every < 2, or when either part would hold fewer than `min_chars` characters.
CharCorpus make_char_corpus(const std::vector<std::string>& documents, int eval_every,
                            int64_t min_chars);

/// Reads every regular file of `dir` whose name has no '.' (the fortune texts; the .dat indexes
/// and .u8 links are skipped), in name order. Throws std::runtime_error naming `dir` when it is
/// missing or holds no such file (with how to install it).
CharCorpus load_char_corpus(const std::string& dir, int eval_every, int64_t min_chars);

/// Cross entropy, in bits per character, of `eval` under the unigram distribution of `train`
/// (add-one smoothing over `vocab` symbols): what a model that ignores context can reach, the bar
/// that a language model has to get under.
double unigram_bits_per_char(const torch::Tensor& train, const torch::Tensor& eval, int64_t vocab);

/// Random windows of `length` + 1 consecutive symbols from `stream` (inputs and, shifted by one,
/// targets), from a generator of its own: the same seed gives the same batches.
class WindowSampler {
 public:
  WindowSampler(torch::Tensor stream, int64_t length, uint64_t seed);
  /// inputs int64 [batch, length], targets int64 [batch, length].
  void next(int64_t batch, torch::Tensor& inputs, torch::Tensor& targets);

 private:
  torch::Tensor stream_;
  int64_t length_;
  std::mt19937_64 generator_;
};

/// The first `windows` non-overlapping windows of `length` + 1 symbols of `stream` (all there are
/// when fewer), as inputs and targets [windows, length]. Throws std::invalid_argument when the
/// stream holds no whole window.
void eval_windows(const torch::Tensor& stream, int64_t length, int64_t windows,
                  torch::Tensor& inputs, torch::Tensor& targets);

}  // namespace troupe::examples
