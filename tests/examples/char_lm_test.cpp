// The language-model example's corpus, sampler and models: documents split and held out as
// documented, ids that give the text back, a unigram reference that matches its closed form, and
// models that see only the past.
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "examples/char_lm/corpus.h"
#include "examples/char_lm/model.h"

using namespace troupe::examples;

namespace {

std::string text_of(const CharCorpus& c, const torch::Tensor& ids) {
  std::string s;
  auto a = ids.accessor<int64_t, 1>();
  for (int64_t i = 0; i < a.size(0); ++i)
    s += static_cast<char>(c.symbols[static_cast<size_t>(a[i])]);
  return s;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("fortune files are cut into documents at lines that hold only a percent sign") {
  CHECK(split_fortunes("a\nb\n%\nc %\n%\n%\nd") ==
        std::vector<std::string>{"a\nb\n", "c %\n", "d\n"});
  CHECK(split_fortunes("%\n%\n").empty());
  CHECK(split_fortunes("").empty());
}

TEST_CASE("every twentieth document is held out, and the ids give the text back") {
  std::vector<std::string> docs;
  for (int k = 0; k < 41; ++k) docs.push_back("doc " + std::to_string(k) + "\n");
  auto c = make_char_corpus(docs, 20, 1);
  CHECK(c.eval_documents == 3);  // 0, 20, 40
  CHECK(c.train_documents == 38);
  CHECK(text_of(c, c.eval) == "doc 0\n%\ndoc 20\n%\ndoc 40\n%\n");
  std::string train;
  for (int k = 1; k < 41; ++k)
    if (k % 20 != 0) train += "doc " + std::to_string(k) + "\n%\n";
  CHECK(text_of(c, c.train) == train);
  // The vocabulary: the bytes present, in byte order.
  CHECK(std::string(c.symbols.begin(), c.symbols.end()) == "\n %0123456789cdo");
  CHECK(c.id_of['z'] == -1);
}

TEST_CASE("a corpus too small or held out at every document is refused, naming the numbers") {
  CHECK(error_of([] {
          make_char_corpus({"a\n", "b\n"}, 1, 1);
        }).find("eval_every = 1") != std::string::npos);
  const auto small = error_of([] { make_char_corpus({"a\n", "b\n", "c\n"}, 2, 100); });
  CHECK(small.find(
            "3 documents give 4 training and 8 evaluation characters, expected at least 100") !=
        std::string::npos);
}

TEST_CASE("a folder without fortune files is refused, naming it and the package") {
  const auto missing = error_of([] { load_char_corpus("/nonexistent/fortunes", 20, 1); });
  CHECK(missing.find("'/nonexistent/fortunes'") != std::string::npos);
  CHECK(missing.find("apt-get install fortunes") != std::string::npos);
  char dir[] = "/tmp/char_lm_test_XXXXXX";
  REQUIRE(mkdtemp(dir));
  const std::string index = std::string(dir) + "/fortunes.dat";
  std::FILE* f = std::fopen(index.c_str(), "w");
  REQUIRE(f);
  std::fclose(f);
  const auto empty = error_of([&] { load_char_corpus(dir, 20, 1); });
  CHECK(empty.find("no fortune files") != std::string::npos);
  CHECK(empty.find(dir) != std::string::npos);
  std::remove(index.c_str());
  rmdir(dir);
}

TEST_CASE("the unigram reference is the closed-form cross entropy with add-one smoothing") {
  // train "aab" over {a, b}: p(a) = (2+1)/(3+2) = 0.6, p(b) = 0.4; eval "ab".
  auto train = torch::tensor({0, 0, 1}, torch::kInt64), eval = torch::tensor({0, 1}, torch::kInt64);
  CHECK(unigram_bits_per_char(train, eval, 2) ==
        doctest::Approx(-(std::log2(0.6) + std::log2(0.4)) / 2).epsilon(1e-12));
}

TEST_CASE("training windows are consecutive symbols, targets the inputs shifted by one") {
  auto stream = torch::arange(1000, torch::kInt64);
  WindowSampler a(stream, 16, 7), b(stream, 16, 7), c(stream, 16, 8);
  torch::Tensor xa, ya, xb, yb, xc, yc;
  a.next(8, xa, ya);
  b.next(8, xb, yb);
  c.next(8, xc, yc);
  CHECK(xa.sizes() == torch::IntArrayRef({8, 16}));
  CHECK(torch::equal(ya, xa + 1));  // the stream is 0..999: the next symbol is +1
  CHECK(torch::equal(xa.narrow(1, 1, 15), xa.narrow(1, 0, 15) + 1));
  CHECK(torch::equal(xa, xb));  // same seed, same windows
  CHECK(!torch::equal(xa, xc));
  CHECK(error_of([&] {
          WindowSampler(torch::arange(10, torch::kInt64), 10, 1);
        }).find("stream of 10") != std::string::npos);
  torch::Tensor ex, ey;
  eval_windows(stream, 9, 1000, ex, ey);
  CHECK(ex.size(0) == 100);  // 1000 / (9 + 1) whole windows
  CHECK(ex[3][0].item<int64_t>() == 30);
  CHECK(torch::equal(ey, ex + 1));
}

TEST_CASE("both models see only the past: changing later symbols leaves earlier outputs alone") {
  torch::manual_seed(3);
  CharModelShape shape;
  shape.vocab = 11;
  shape.context = 12;
  shape.dim = 16;
  shape.layers = 2;
  shape.heads = 4;
  CharTransformer transformer(shape);
  CharLstm lstm(shape);
  torch::NoGradGuard no_grad;
  auto x = torch::randint(0, 11, {3, 12}, torch::kInt64);
  auto changed = x.clone();
  changed.narrow(1, 7, 5).random_(0, 11);
  for (auto forward : {std::function<torch::Tensor(torch::Tensor)>(
                           [&](torch::Tensor t) { return transformer->forward(t); }),
                       std::function<torch::Tensor(torch::Tensor)>(
                           [&](torch::Tensor t) { return lstm->forward(t); })}) {
    auto a = forward(x), b = forward(changed);
    CHECK(a.sizes() == torch::IntArrayRef({3, 12, 11}));
    CHECK(torch::allclose(a.narrow(1, 0, 7), b.narrow(1, 0, 7), 1e-5, 1e-6));
    CHECK(!torch::allclose(a.narrow(1, 7, 5), b.narrow(1, 7, 5)));
    CHECK(torch::allclose(a.exp().sum(-1), torch::ones({3, 12}), 1e-5, 1e-5));  // distributions
  }
  CHECK(error_of([&] {
          transformer->forward(torch::zeros({1, 13}, torch::kInt64));
        }).find("an input of 13 symbols, expected at most the context, 12") != std::string::npos);
  shape.heads = 3;
  CHECK(error_of([&] { CharTransformer bad(shape); }).find("heads 3") != std::string::npos);
}
