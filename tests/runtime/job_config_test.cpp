// Job files: every algorithm's settings, every class of mistake, and the files in examples/configs.
#include <doctest/doctest.h>

#include <filesystem>
#include <initializer_list>
#include <string>
#include <vector>

#include "comm/status.h"
#include "tools/job_config.h"

using namespace troupe;

namespace {

/// A job of 8 ranks with the given [algorithm] (and any other tables after it).
std::string job_with(const std::string& tables) { return "[job]\nworld_size = 8\n\n" + tables; }

/// The message of the comm::Error that parsing `text` throws, or "" when it parses.
std::string error_of(const std::string& text) {
  try {
    parse_job_config(text, "job.toml");
  } catch (const comm::Error& e) {
    return e.what();
  }
  return "";
}

/// Parsing `text` fails with a message that contains every one of `parts`.
void check_error(const std::string& text, std::initializer_list<std::string> parts) {
  const std::string message = error_of(text);
  INFO("job file:\n", text, "\nmessage: ", message);
  REQUIRE_FALSE(message.empty());
  CHECK(message.rfind("job.toml", 0) == 0);
  for (const std::string& part : parts)
    CHECK_MESSAGE(message.find(part) != std::string::npos, part);
}

template <class T>
T algorithm_of(const std::string& text) {
  const JobConfig config = parse_job_config(text, "job.toml");
  REQUIRE(std::holds_alternative<T>(config.algorithm));
  return std::get<T>(config.algorithm);
}

template <class T>
T compression_of(const std::string& text) {
  const auto c = algorithm_of<comm::Compression>(text);
  REQUIRE(std::holds_alternative<T>(c));
  return std::get<T>(c);
}

}  // namespace

TEST_CASE("a job file with every table sets the job, topology, algorithm, trainer and links") {
  const JobConfig c = parse_job_config(R"(
[job]
world_size = 6
mode = "threads"
timeout_sec = 600

[topology]
kind = "edge_list"
mixing = "metropolis"
edges = [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 0], [0, 3]]

[algorithm]
name = "decentralized"
exchange = "after_step"
communication_interval = 4

[trainer]
program = "/opt/bin/fashion_mnist"
model = "mlp"
epochs = 3
batch = 32
lr = 0.1
momentum = 0.5
lr_schedule = "cosine"
data = "/data/fmnist"
log_every = 20
seed = 7
threads = 2

[links]
all = "1gbit,5ms"
ranks = { 4 = "10ms", 2 = "100mbit,20ms" }
)",
                                       "job.toml");
  CHECK(c.source == "job.toml");
  CHECK(c.world_size == 6);
  CHECK(c.mode == JobConfig::Mode::threads);
  CHECK(c.timeout_sec == 600);
  REQUIRE(std::holds_alternative<Decentralized>(c.algorithm));
  const auto& d = std::get<Decentralized>(c.algorithm);
  CHECK(d.exchange == Decentralized::Exchange::after_step);
  CHECK(d.communication_interval == 4);
  CHECK(d.topology.kind == comm::TopologyKind::edge_list);
  CHECK(d.topology.mixing == comm::Mixing::metropolis);
  CHECK((d.topology.edges ==
         std::vector<std::pair<int, int>>{{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 0}, {0, 3}}));
  CHECK(c.trainer.program == "/opt/bin/fashion_mnist");
  CHECK(c.trainer.model == "mlp");
  CHECK(c.trainer.epochs == 3);
  CHECK(c.trainer.batch == 32);
  CHECK(c.trainer.lr == doctest::Approx(0.1));
  CHECK(c.trainer.momentum == doctest::Approx(0.5));
  CHECK(c.trainer.lr_schedule == "cosine");
  CHECK(c.trainer.data == "/data/fmnist");
  CHECK(c.trainer.log_every == 20);
  CHECK(c.trainer.seed == 7);
  CHECK(c.trainer.threads == 2);
  CHECK(c.links.all.bytes_per_sec == doctest::Approx(1e9 / 8));
  CHECK(c.links.all.latency == std::chrono::milliseconds(5));
  REQUIRE(c.links.ranks.size() == 2);  // sorted by rank
  CHECK(c.links.ranks[0].first == 2);
  CHECK(c.links.ranks[0].second.bytes_per_sec == doctest::Approx(100e6 / 8));
  CHECK(c.links.ranks[0].second.latency == std::chrono::milliseconds(20));
  CHECK(c.links.ranks[1].first == 4);
  CHECK(c.links.ranks[1].second.bytes_per_sec == 0);
  CHECK(c.links.ranks[1].second.latency == std::chrono::milliseconds(10));
}

TEST_CASE("what a job file leaves out keeps the defaults of JobConfig and TrainerConfig") {
  const JobConfig c =
      parse_job_config("[job]\nworld_size = 2\n[algorithm]\nname = \"allreduce\"\n");
  CHECK(c.source == "<string>");
  CHECK(c.world_size == 2);
  CHECK(c.mode == JobConfig::Mode::processes);
  CHECK(c.timeout_sec == 0);
  CHECK(std::holds_alternative<comm::GradientAllReduce>(std::get<comm::Compression>(c.algorithm)));
  const TrainerConfig defaults;
  CHECK(c.trainer.program == defaults.program);
  CHECK(c.trainer.model == defaults.model);
  CHECK(c.trainer.epochs == defaults.epochs);
  CHECK(c.trainer.lr == defaults.lr);
  CHECK(c.trainer.lr_schedule == "constant");
  CHECK(c.trainer.seed == defaults.seed);
  CHECK_FALSE(c.links.active());
}

TEST_CASE("each compression algorithm reads its settings by their field names") {
  SUBCASE("allreduce, fp16 and bf16") {
    algorithm_of<comm::Compression>(job_with("[algorithm]\nname = \"allreduce\"\n"));
    CHECK_FALSE(
        compression_of<comm::HalfPrecision>(job_with("[algorithm]\nname = \"fp16\"\n")).bfloat16);
    CHECK(compression_of<comm::HalfPrecision>(job_with("[algorithm]\nname = \"bf16\"\n")).bfloat16);
  }
  SUBCASE("bytegrad") {
    const std::string text = job_with("[algorithm]\nname = \"bytegrad\"\nblock = 512\n");
    CHECK(compression_of<comm::ByteGrad>(text).block == 512);
  }
  SUBCASE("sign and sign-vote") {
    auto s = compression_of<comm::SignCompression>(
        job_with("[algorithm]\nname = \"sign\"\nerror_feedback = false\n"));
    CHECK(s.mode == comm::SignMode::scaled);
    CHECK_FALSE(s.error_feedback);
    s = compression_of<comm::SignCompression>(job_with("[algorithm]\nname = \"sign\"\n"));
    CHECK(s.error_feedback);
    s = compression_of<comm::SignCompression>(job_with("[algorithm]\nname = \"sign-vote\"\n"));
    CHECK(s.mode == comm::SignMode::majority_vote);
    CHECK_FALSE(s.error_feedback);
  }
  SUBCASE("topk, randomk and blockk") {
    auto s = compression_of<comm::Sparsification>(job_with(R"([algorithm]
name = "topk"
ratio = 0.05
count = 100
error_feedback = false
seed = 3
)"));
    CHECK(s.mode == comm::SparseMode::top_k);
    CHECK(s.ratio == doctest::Approx(0.05));
    CHECK(s.count == 100);
    CHECK_FALSE(s.error_feedback);
    CHECK(s.seed == 3);
    s = compression_of<comm::Sparsification>(
        job_with("[algorithm]\nname = \"randomk\"\nratio = 1\n"));
    CHECK(s.mode == comm::SparseMode::random_k);
    CHECK(s.ratio == 1.0);  // an integer is taken as a number
    s = compression_of<comm::Sparsification>(job_with("[algorithm]\nname = \"blockk\"\n"));
    CHECK(s.mode == comm::SparseMode::block);
    CHECK(s.momentum == 0);
    s = compression_of<comm::Sparsification>(
        job_with("[algorithm]\nname = \"topk\"\nmomentum = 0.9\n"));
    CHECK(s.momentum == doctest::Approx(0.9));
  }
  SUBCASE("powersgd") {
    const auto p = compression_of<comm::PowerSGD>(job_with(R"([algorithm]
name = "powersgd"
rank = 4
warm_start = false
error_feedback = false
min_compression_rate = 1.5
start_iter = 100
seed = 9
)"));
    CHECK(p.rank == 4);
    CHECK_FALSE(p.warm_start);
    CHECK_FALSE(p.error_feedback);
    CHECK(p.min_compression_rate == 1.5);
    CHECK(p.start_iter == 100);
    CHECK(p.seed == 9);
  }
}

TEST_CASE("each decentralized and asynchronous algorithm reads its settings and its topology") {
  SUBCASE("decentralized on a torus") {
    const auto d = algorithm_of<Decentralized>(job_with(R"([topology]
kind = "torus"
rows = 2
cols = 4
[algorithm]
name = "decentralized"
)"));
    CHECK(d.topology.kind == comm::TopologyKind::torus);
    CHECK(d.topology.rows == 2);
    CHECK(d.topology.cols == 4);
    CHECK(d.exchange == Decentralized::Exchange::overlap);
    CHECK(d.communication_interval == 1);
  }
  SUBCASE("decentralized on a random matching") {
    const auto d = algorithm_of<Decentralized>(job_with(R"([topology]
kind = "random_matching"
seed = 5
[algorithm]
name = "decentralized"
)"));
    CHECK(d.topology.kind == comm::TopologyKind::random_matching);
    CHECK(d.topology.seed == 5);
  }
  SUBCASE("low_precision_decentralized") {
    const auto l = algorithm_of<LowPrecisionDecentralized>(job_with(R"([topology]
kind = "complete"
[algorithm]
name = "low_precision_decentralized"
gamma = 0.25
block = 256
)"));
    CHECK(l.topology.kind == comm::TopologyKind::complete);
    CHECK(l.gamma == 0.25);
    CHECK(l.block == 256);
  }
  SUBCASE("async_model_average") {
    const auto m = algorithm_of<AsyncModelAverage>(job_with(
        "[algorithm]\nname = \"async_model_average\"\nwarmup_steps = 0\nsync_interval_ms = 5\n"));
    CHECK(m.warmup_steps == 0);
    CHECK(m.sync_interval_ms == 5);
  }
  SUBCASE("async_gossip") {
    const auto g = algorithm_of<AsyncGossip>(job_with(R"([topology]
kind = "ring"
[algorithm]
name = "async_gossip"
min_interval_ms = 0
)"));
    CHECK(g.topology.kind == comm::TopologyKind::ring);
    CHECK(g.min_interval_ms == 0);
  }
}

TEST_CASE("job_algorithm_name gives back the name the job file used") {
  for (const char* name : {"allreduce", "fp16", "bf16", "bytegrad", "int4", "sign", "sign-vote",
                           "topk", "randomk", "blockk", "powersgd", "decentralized",
                           "low_precision_decentralized", "async_model_average", "async_gossip"}) {
    CAPTURE(name);
    const std::string n = name;
    const bool gossip =
        n == "decentralized" || n == "low_precision_decentralized" || n == "async_gossip";
    const std::string text = job_with(std::string(gossip ? "[topology]\nkind = \"ring\"\n" : "") +
                                      "[algorithm]\nname = \"" + n + "\"\n");
    CHECK(job_algorithm_name(parse_job_config(text).algorithm) == n);
  }
}

TEST_CASE("a value of the wrong type names the key, the value and the type expected") {
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nepochs = \"2\"\n"),
              {"trainer.epochs = \"2\": expected an integer"});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nepochs = 2.5\n"),
              {"trainer.epochs = 2.5: expected an integer"});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nlr = \"fast\"\n"),
              {"trainer.lr = \"fast\": expected a number > 0"});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nlr_schedule = \"step\"\n"),
              {"trainer.lr_schedule = \"step\"", "constant", "cosine"});
  check_error(job_with("[algorithm]\nname = \"powersgd\"\nwarm_start = 1\n"),
              {"algorithm.warm_start = 1: expected true or false"});
  check_error(job_with("[algorithm]\nname = 3\n"), {"algorithm.name = 3", "allreduce", "powersgd"});
  check_error("job = 3\n", {"job = 3: expected a table"});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[links]\nranks = \"3=10ms\"\n"),
              {"links.ranks = \"3=10ms\"", "expected a table"});
}

TEST_CASE("a value out of range names the key, the value and the range allowed") {
  const std::string decentralized = "[topology]\nkind = \"ring\"\n[algorithm]\nname = ";
  check_error(job_with("[algorithm]\nname = \"powersgd\"\nrank = 0\n"),
              {"job.toml: algorithm.rank = 0: expected an integer >= 1"});
  check_error("[job]\nworld_size = 0\n[algorithm]\nname = \"allreduce\"\n",
              {"job.world_size = 0", ">= 1"});
  check_error("[job]\nworld_size = 2\ntimeout_sec = -1\n[algorithm]\nname = \"allreduce\"\n",
              {"job.timeout_sec = -1", ">= 0"});
  check_error("[job]\nworld_size = 2\nmode = \"thread\"\n[algorithm]\nname = \"allreduce\"\n",
              {"job.mode = \"thread\"", "\"threads\", \"processes\""});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nmodel = \"resnet\"\n"),
              {"trainer.model = \"resnet\"", "\"cnn\", \"mlp\""});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nlr = 0\n"),
              {"trainer.lr = 0", "> 0"});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nmomentum = 1\n"),
              {"trainer.momentum = 1", "[0, 1)"});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nthreads = 0\n"),
              {"trainer.threads = 0", ">= 1"});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nseed = -1\n"),
              {"trainer.seed = -1", ">= 0"});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nepochs = 3000000000\n"),
              {"trainer.epochs = 3000000000", "[1, 2147483647]"});
  check_error(job_with("[algorithm]\nname = \"topk\"\nratio = 1.5\n"),
              {"algorithm.ratio = 1.5", "(0, 1]"});
  check_error(job_with("[algorithm]\nname = \"topk\"\nmomentum = 1\n"),
              {"algorithm.momentum = 1", "[0, 1)"});
  check_error(job_with("[algorithm]\nname = \"topk\"\nmomentum = 0.9\nerror_feedback = false\n"),
              {"momentum=0.9 with error_feedback=false"});
  check_error(job_with("[algorithm]\nname = \"bytegrad\"\nblock = 0\n"),
              {"algorithm.block = 0", ">= 1"});
  check_error(job_with("[algorithm]\nname = \"powersgd\"\nmin_compression_rate = nan\n"),
              {"algorithm.min_compression_rate = nan", ">= 0"});
  check_error(job_with(decentralized + "\"decentralized\"\nexchange = \"before\"\n"),
              {"algorithm.exchange = \"before\"", "\"overlap\", \"after_step\""});
  check_error(job_with(decentralized + "\"decentralized\"\ncommunication_interval = 0\n"),
              {"algorithm.communication_interval = 0", ">= 1"});
  check_error(job_with(decentralized + "\"low_precision_decentralized\"\ngamma = 0\n"),
              {"algorithm.gamma = 0", "(0, 1]"});
  check_error(job_with(decentralized + "\"low_precision_decentralized\"\ngamma = 1.5\n"),
              {"algorithm.gamma = 1.5", "(0, 1]"});
  check_error(job_with("[algorithm]\nname = \"async_model_average\"\nsync_interval_ms = 0\n"),
              {"algorithm.sync_interval_ms = 0", ">= 1"});
  check_error(job_with("[algorithm]\nname = \"async_model_average\"\nwarmup_steps = -1\n"),
              {"algorithm.warmup_steps = -1", ">= 0"});
  check_error(job_with(decentralized + "\"async_gossip\"\nmin_interval_ms = -5\n"),
              {"algorithm.min_interval_ms = -5", ">= 0"});
}

TEST_CASE("an unknown table, key or algorithm is named with the ones allowed") {
  const std::string decentralized = "[algorithm]\nname = \"decentralized\"\n";
  check_error("[jobs]\nworld_size = 2\n", {"[jobs]", "job, topology, algorithm, trainer, links"});
  check_error("world_size = 2\n", {"world_size", "job, topology, algorithm, trainer, links"});
  check_error("[job]\nworld = 2\n", {"job.world", "world_size, mode, timeout_sec"});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[trainer]\nepoch = 2\n"),
              {"trainer.epoch", "epochs", "log_every"});
  check_error(job_with("[algorithm]\nname = \"powersgd\"\nratio = 0.1\n"),
              {"algorithm.ratio", "powersgd",
               "rank, warm_start, error_feedback, min_compression_rate, start_iter, seed"});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\nrank = 2\n"),
              {"algorithm.rank", "allreduce", "name"});
  check_error(job_with("[algorithm]\nname = \"powersdg\"\n"),
              {"algorithm.name = \"powersdg\"", "\"powersgd\"", "\"async_gossip\""});
  check_error(job_with("[algorithm]\nname = \"allreduce\"\n[links]\nslow = \"10ms\"\n"),
              {"links.slow", "all, ranks"});
  check_error(job_with("[topology]\nkind = \"ring\"\nshape = 2\n" + decentralized),
              {"topology.shape", "kind, mixing, rows, cols, edges, seed"});
}

TEST_CASE("a missing table or required key says what it should hold") {
  const std::string decentralized = "[algorithm]\nname = \"decentralized\"\n";
  check_error("[algorithm]\nname = \"allreduce\"\n", {"[job]", "world_size"});
  check_error("[job]\nmode = \"threads\"\n[algorithm]\nname = \"allreduce\"\n",
              {"job.world_size is missing", ">= 1"});
  check_error("[job]\nworld_size = 2\n", {"[algorithm]", "\"powersgd\""});
  check_error(job_with("[algorithm]\nrank = 2\n"), {"algorithm.name is missing", "\"allreduce\""});
  check_error(job_with("[algorithm]\nname = \"decentralized\"\n"),
              {"decentralized needs a [topology]", "kind = \"ring\""});
  check_error(job_with("[topology]\nkind = \"torus\"\nrows = 2\n" + decentralized),
              {"topology.cols is missing"});
  check_error(job_with("[topology]\nmixing = \"uniform\"\n[algorithm]\nname = \"decentralized\"\n"),
              {"topology.kind is missing", "ring", "edge_list"});
}

TEST_CASE("a topology that does not fit the world size or the algorithm is refused") {
  const std::string decentralized = "[algorithm]\nname = \"decentralized\"\n";
  const std::string path3 =
      "[job]\nworld_size = 3\n[topology]\nkind = \"edge_list\"\n"
      "edges = [[0, 1], [1, 2]]\n";
  check_error(job_with("[topology]\nkind = \"ring\"\n[algorithm]\nname = \"powersgd\"\n"),
              {"[topology] is only used by", "decentralized", "\"powersgd\""});
  check_error(job_with("[topology]\nkind = \"rng\"\n[algorithm]\nname = \"decentralized\"\n"),
              {"topology.kind = \"rng\"", "ring", "random_matching"});
  check_error(job_with("[topology]\nkind = \"ring\"\nmixing = \"average\"\n"
                       "[algorithm]\nname = \"decentralized\"\n"),
              {"topology.mixing = \"average\"", "metropolis"});
  check_error(job_with("[topology]\nkind = \"ring\"\nrows = 2\n" + decentralized),
              {"topology.rows is only used by kind = \"torus\"", "\"ring\""});
  check_error(job_with("[topology]\nkind = \"torus\"\nrows = 3\ncols = 3\n"
                       "[algorithm]\nname = \"decentralized\"\n"),
              {"topology", "job.world_size = 8"});
  check_error(job_with("[topology]\nkind = \"edge_list\"\nedges = [[0, 1, 2]]\n"
                       "[algorithm]\nname = \"decentralized\"\n"),
              {"topology.edges[0] = [0, 1, 2]", "a pair of ranks"});
  check_error(job_with("[topology]\nkind = \"edge_list\"\nedges = [[0, 9]]\n"
                       "[algorithm]\nname = \"decentralized\"\n"),
              {"topology", "9"});
  // A path 0-1-2: uniform weights are not doubly stochastic on an irregular graph.
  check_error(path3 + decentralized,
              {"doubly stochastic", "decentralized", "mixing = \"metropolis\""});
  CHECK(error_of(path3 + "mixing = \"metropolis\"\n" + decentralized) == "");
  check_error(job_with("[topology]\nkind = \"exponential\"\n[algorithm]\nname = \"async_gossip\""),
              {"async_gossip", "undirected, static"});
  check_error(job_with("[topology]\nkind = \"random_matching\"\n"
                       "[algorithm]\nname = \"low_precision_decentralized\"\n"),
              {"low_precision_decentralized", "undirected, static"});
}

TEST_CASE("link shapes are read by comm's parsers and checked against the world size") {
  const std::string algorithm = "[algorithm]\nname = \"allreduce\"\n";
  check_error(job_with(algorithm + "[links]\nall = \"1gbit,5xs\"\n"),
              {"links.all = \"1gbit,5xs\"", "link shape"});
  check_error(job_with(algorithm + "[links]\nall = 5\n"), {"links.all = 5", "a string"});
  check_error(job_with(algorithm + "[links]\nranks = { 8 = \"10ms\" }\n"),
              {"links.ranks.8 = \"10ms\"", "[0, 8)"});
  check_error(job_with(algorithm + "[links]\nranks = { x = \"10ms\" }\n"),
              {"links.ranks.x", "a rank in [0, 8)"});
  check_error(job_with(algorithm + "[links]\nranks = { 3 = \"fast\" }\n"),
              {"links.ranks.3 = \"fast\"", "link shape"});
  check_error(job_with(algorithm + "[links]\nranks = { 3 = \"10ms\", 03 = \"20ms\" }\n"),
              {"links.ranks", "rank", "named twice"});
}

TEST_CASE("a compression setting that comm::validate refuses is reported with the file") {
  check_error(job_with("[algorithm]\nname = \"sign-vote\"\nerror_feedback = true\n"),
              {"job.toml: algorithm", "error_feedback", "majority_vote"});
}

TEST_CASE("a TOML syntax error gives the file, line and column") {
  check_error("[job]\nworld_size = 8\nmode = \n", {"job.toml:3:", "TOML"});
  check_error("[job]\nworld_size = 8\n[job]\n", {"job.toml:3:"});
}

TEST_CASE("a job file that cannot be read is named in the error") {
  const std::string path = "/nonexistent/troupe/job.toml";
  try {
    load_job_config(path);
    FAIL("no error for a missing file");
  } catch (const comm::Error& e) {
    CHECK(std::string(e.what()).find(path) != std::string::npos);
  }
  CHECK_THROWS_AS(load_job_config(TROUPE_SOURCE_DIR "/examples/configs"), comm::Error);
}

TEST_CASE("every job file in examples/configs loads") {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(fs::path(TROUPE_SOURCE_DIR) / "examples/configs"))
    if (entry.path().extension() == ".toml") files.push_back(entry.path());
  CHECK(files.size() >= 9);
  for (const auto& file : files) {
    CAPTURE(file.string());
    JobConfig config;
    CHECK_NOTHROW(config = load_job_config(file.string()));
    CHECK(config.source == file.string());
    CHECK(config.world_size == 8);
  }
  const std::string dir = TROUPE_SOURCE_DIR "/examples/configs/";
  const auto torus = std::get<Decentralized>(load_job_config(dir + "torus.toml").algorithm);
  CHECK(torus.topology.kind == comm::TopologyKind::torus);
  CHECK(torus.exchange == Decentralized::Exchange::after_step);
  const JobConfig slow = load_job_config(dir + "slow_rank.toml");
  REQUIRE(slow.links.ranks.size() == 1);
  CHECK(slow.links.ranks[0].first == 3);
  CHECK(slow.links.ranks[0].second.latency == std::chrono::milliseconds(20));
  const auto average =
      std::get<AsyncModelAverage>(load_job_config(dir + "async_average.toml").algorithm);
  CHECK(average.warmup_steps == 100);
  CHECK(average.sync_interval_ms == 50);
}
