// The language-model example as its users run it: two rank processes under `troupe launch` learn
// the held-out fortunes better than the unigram model of the training text (computed here, from
// the same files, independently of the program), with allreduce and with a compressed algorithm;
// and the bytes it reports for a local-update algorithm's sync are the outer reduction's.
// torch's headers first: through them glog defines CHECK (which aborts without the values), and
// doctest's CHECK must be the one defined last.
#include <torch/types.h>

#include <doctest/doctest.h>

#include <cstdlib>
#include <regex>
#include <sstream>
#include <string>

#include "elastic/launch.h"
#include "examples/char_lm/corpus.h"

using namespace troupe;

namespace {

const char kFortunes[] = "/usr/share/games/fortunes";

std::string char_lm_bin() {
  const std::string bin = TROUPE_BIN;
  return bin.substr(0, bin.rfind('/') + 1) + "char_lm";
}

// The last "final eval bits per char X" that rank 0 printed, or NaN.
double final_bits(const std::string& log) {
  std::smatch m;
  const std::regex line(R"(\[rank 0\] final eval bits per char ([0-9.]+))");
  return std::regex_search(log, m, line) ? std::stod(m[1]) : std::nan("");
}

// The number rank 0 printed right after `label` (a regex: "[rank 0] <label>N"), or -1.
long long printed_number(const std::string& log, const std::string& label) {
  std::smatch m;
  const std::regex line("\\[rank 0\\] " + label + "([0-9]+)");
  return std::regex_search(log, m, line) ? std::stoll(m[1]) : -1;
}

// char_lm's output for `algorithm` on two processes, training the small model for `steps` steps.
std::string run_char_lm(const std::string& algorithm, const std::string& steps) {
  LaunchOptions o;
  o.nprocs = 2;
  o.command = {char_lm_bin(), "--algorithm", algorithm, "--steps",      steps,  "--batch",
               "8",           "--context",   "32",      "--dim",        "48",   "--layers",
               "1",           "--heads",     "4",       "--eval-every", "1000", "--eval-windows",
               "16",          "--log-every", "1000"};
  o.timeout_sec = 240;
  o.extra_env = {{"UCX_TLS", "sm,self"}};
  std::ostringstream out, err;
  auto r = launch(o, out, err);
  const std::string log = out.str() + err.str();
  INFO(log);
  REQUIRE(r.rank_exit_codes == std::vector<int>{0, 0});
  return log;
}

}  // namespace

TEST_CASE("char_lm prints the bytes of its largest sync: DiLoCo's outer allreduce of the model") {
  // DiLoCo averages the whole model's outer gradient, n float32, with a ring allreduce (or, at
  // or below 64 KiB, recursive doubling): with 2 ranks each sends 2 (W - 1) / W * 4n = 4n bytes
  // either way. n is the parameter count char_lm prints first.
  const std::string diloco = run_char_lm("diloco:h=10", "20");
  const long long parameters = printed_number(diloco, "char_lm: transformer \\(");
  const long long peak = printed_number(diloco, "peak bytes sent by one sync ");
  INFO(diloco);
  REQUIRE(parameters > 0);
  CHECK(peak == 4 * parameters);
  // Streaming DiLoCo with two fragments syncs one fragment at a time: the larger of the two, at
  // least half the model and less than all of it.
  const std::string streaming = run_char_lm("streaming-diloco:h=10,fragments=2", "30");
  const long long fragment_peak = printed_number(streaming, "peak bytes sent by one sync ");
  INFO(streaming);
  CHECK(2 * fragment_peak >= 4 * parameters);
  CHECK(fragment_peak < 4 * parameters);
}

TEST_CASE("char_lm on two processes learns the fortunes better than their unigram model") {
  auto corpus = examples::load_char_corpus(kFortunes, 20, 4 * 33);
  const double unigram = examples::unigram_bits_per_char(corpus.train, corpus.eval, corpus.vocab());
  MESSAGE("unigram bits per char of the held-out fortunes: " << unigram);
  CHECK(unigram > 4.0);  // English text over ~180 byte values: about 4.5-5 bits
  for (const char* algorithm : {"allreduce", "powersgd:rank=2"}) {
    CAPTURE(algorithm);
    LaunchOptions o;
    o.nprocs = 2;
    o.command = {char_lm_bin(), "--algorithm",    algorithm, "--steps",     "150",  "--batch",
                 "16",          "--context",      "32",      "--dim",       "48",   "--layers",
                 "1",           "--heads",        "4",       "--lr",        "0.01", "--eval-every",
                 "1000",        "--eval-windows", "128",     "--log-every", "50"};
    o.timeout_sec = 240;
    o.extra_env = {{"UCX_TLS", "sm,self"}};
    std::ostringstream out, err;
    auto r = launch(o, out, err);
    const std::string log = out.str() + err.str();
    INFO(log);
    REQUIRE(r.rank_exit_codes == std::vector<int>{0, 0});
    const double bits = final_bits(log);
    MESSAGE(std::string(algorithm) << ": final eval bits per char " << bits);
    REQUIRE(std::isfinite(bits));
    // Context helps: well under the unigram bar (a model that learned nothing sits at log2(vocab)).
    CHECK(bits < unigram - 0.3);
  }
}

TEST_CASE("char_lm refuses a data folder without fortunes, naming it") {
  LaunchOptions o;
  o.nprocs = 1;
  o.command = {char_lm_bin(), "--data", "/nonexistent/fortunes", "--steps", "1"};
  o.timeout_sec = 60;
  std::ostringstream out, err;
  auto r = launch(o, out, err);
  const std::string log = out.str() + err.str();
  INFO(log);
  CHECK(r.rank_exit_codes == std::vector<int>{1});
  CHECK(log.find("char_lm: char corpus: cannot open the folder '/nonexistent/fortunes'") !=
        std::string::npos);
}
