// Data-parallel training of Fashion-MNIST over troupe, with any of its algorithms:
//   build/bin/troupe launch -n 4 -- build/bin/fashion_mnist --epochs 1
//   build/bin/troupe launch -n 4 -- build/bin/fashion_mnist --algorithm powersgd:rank=2
//   build/bin/troupe run examples/configs/gossip_ring8.toml   (runs fashion_mnist --job FILE)
//   ... fashion_mnist --checkpoint ckpt --checkpoint-every 500, later ... --resume ckpt
//   TROUPE_FAULT=kill:rank=2,step=300 build/bin/troupe launch --elastic --min-ranks 2 -n 4 --
//       build/bin/fashion_mnist --epochs 2     (a rank dies mid-epoch; the others go on; with
//       --algorithm, any bucket algorithm: allreduce, fp16, ..., topk, powersgd, or diloco and
//       sparseloco, which go back to their last outer sync; decentralized,
//       low_precision_decentralized, async_model_average and async_gossip, whose survivors keep
//       their own replicas)
// With --job, the job file (<troupe/job_config.h>) gives the algorithm, the trainer's settings and
// the link emulation; its mode "threads" runs every rank as a thread of this process.
#include <torch/torch.h>
#include <troupe/option_checks.h>
#include <troupe/troupe.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>

#include "fashion_mnist/dataset.h"
#include "fashion_mnist/elastic.h"
#include "fashion_mnist/models.h"

using namespace troupe;

namespace {

struct Settings {
  TrainerConfig trainer;
  JobAlgorithm algorithm = comm::GradientAllReduce{};
  DdpOptions ddp;
  bool ranks_as_threads = false;
  // "cpu", "cuda" (the rank's GPU: its local rank modulo the GPUs the process sees) or "cuda:N".
  std::string device = "cpu";
  int die_rank = -1;  // failure injection for tests: this rank exits abruptly at die_step
  int64_t die_step = 0;
  // Only the first `subset` training images (0: all), for quick runs and tests.
  int64_t subset = 0;
  // Checkpoints (<troupe/checkpoint.h>): where and how often to save, where to resume from, and a
  // test-only stop after a step (as if the job had been killed there).
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  std::string resume_dir;
  int64_t stop_step = 0;
  // Benchmarks: resume without the algorithm's state (error feedback, step counter), as a trainer
  // that checkpoints only model and optimizer would (docs/benchmarks.md: the loss spike).
  bool drop_algorithm_state = false;
  // The deadline of each collective. Long enough for rank 0's end-of-epoch evaluation on a loaded
  // machine, while the other ranks wait in the next step's reduction.
  double collective_timeout_sec = 60;
};

std::chrono::milliseconds collective_timeout(const Settings& s) {
  return std::chrono::milliseconds(
      static_cast<int64_t>(std::ceil(s.collective_timeout_sec * 1000)));
}

std::mutex print_mutex;

// One line to stdout, whole, prefixed with the rank when ranks are threads (troupe launch prefixes
// the lines of processes itself).
void say(const Settings& s, int rank, const std::string& line) {
  std::lock_guard<std::mutex> lock(print_mutex);
  if (s.ranks_as_threads) std::printf("[rank %d] ", rank);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  return buf;
}

bool is_bucket_algorithm(const JobAlgorithm& a) {
  return std::holds_alternative<comm::Compression>(a);
}

void train_rank(Runtime& rt, const Settings& s) {
  const auto& t = s.trainer;
  const int rank = rt.rank(), world = rt.world_size();
  auto test = examples::load_fashion_mnist(t.data, "test");
  auto train = [&] {
    auto all = examples::load_fashion_mnist(t.data, "train");
    if (s.subset > 0 && s.subset < examples::size(all))
      all = {all.images.narrow(0, 0, s.subset), all.labels.narrow(0, 0, s.subset)};
    examples::check_trainable(t.data, examples::size(all), world, t.batch, examples::size(test));
    return examples::shard(all, rank, world, t.seed);
  }();

  const torch::Device device = training_device(s.device, rt.local_rank());
  std::shared_ptr<torch::nn::Module> module;
  examples::Forward forward;
  if (t.model == "cnn") {
    examples::CnnNet net;
    module = net.ptr();
    forward = [net](const torch::Tensor& x) mutable { return net->forward(x); };
  } else {
    examples::MlpNet net({784, 256, 10});
    module = net.ptr();
    forward = [net](const torch::Tensor& x) mutable { return net->forward(x); };
  }
  // The model lives on the device; the data stays in host memory and each batch is copied over
  // (Fashion-MNIST's batches are small). The test set is scored through the same copy.
  module->to(device);
  const examples::Forward evaluate = [&forward, device](const torch::Tensor& x) {
    return forward(x.to(device)).to(torch::kCPU);
  };
  torch::optim::SGD opt(module->parameters(), torch::optim::SGDOptions(t.lr).momentum(t.momentum));
  auto dp = make_data_parallel(rt, module, s.algorithm, s.ddp);
  // Bucket algorithms keep the ranks identical: rank 0 speaks for all. The others: every rank.
  const bool speaks = rank == 0 || !is_bucket_algorithm(s.algorithm);
  if (rank == 0)
    say(s, rank,
        format("fashion_mnist: %s, %s, %d rank(s)%s, %lld training images per rank, batch %d "
               "per rank, on %s",
               t.model.c_str(), dp->algorithm_name().c_str(), world,
               s.ranks_as_threads ? " as threads" : "",
               static_cast<long long>(examples::size(train)), t.batch, device.str().c_str()));

  examples::BatchIterator batches(train, t.batch, t.seed + static_cast<uint64_t>(rank));
  const int64_t steps = t.epochs * batches.batches_per_epoch();
  auto& sgd = static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options());
  int64_t step = 0;
  // Everything a rank needs to go on exactly: model, optimizer, the algorithm's state, torch's
  // generator, and where the loader is (epoch, batches done in it). The loader's order depends
  // only on the seed, the batch size, the training set and the epoch, so those are settings a
  // resume must keep (and the world size, which the checkpoint checks itself); the job's
  // checkpoint (save_step / load_last) is a step that every rank saved.
  int64_t saved_epoch = 0, saved_batch = 0;
  Checkpoint checkpoint(rt);
  checkpoint.module(*module).optimizer(opt).rng().value("step", step);
  checkpoint.part(
      "algorithm", [&dp](comm::StateWriter& out) { dp->save_state(out); },
      [&dp, &s](comm::StateReader& in) {
        if (s.drop_algorithm_state) {
          in.take(in.remaining());
        } else {
          dp->load_state(in);
        }
      });
  checkpoint.value("epoch", saved_epoch).value("batch", saved_batch);
  checkpoint.setting("seed", static_cast<int64_t>(t.seed))
      .setting("batch", t.batch)
      .setting("subset", s.subset)
      .setting("model", t.model);
  if (!s.resume_dir.empty()) {
    checkpoint.load_last(s.resume_dir);
    if (rank == 0)
      say(s, rank,
          format("resumed from %s at step %lld (epoch %lld, batch %lld)", s.resume_dir.c_str(),
                 static_cast<long long>(step), static_cast<long long>(saved_epoch + 1),
                 static_cast<long long>(saved_batch)));
  }
  const int64_t first_epoch = saved_epoch, first_batch = saved_batch;
  for (int64_t epoch = first_epoch; epoch < t.epochs; ++epoch) {
    batches.begin(epoch);
    int64_t batch_index = 0;
    if (epoch == first_epoch && first_batch > 0) {
      batches.skip(first_batch);
      batch_index = first_batch;
    }
    torch::Tensor x, y;
    // Compute utilisation: the epoch's time less what step() waited for communication.
    const double wait_before = dp->stats().comm_wait_sec;
    const auto epoch_start = std::chrono::steady_clock::now();
    auto window_start = epoch_start;
    int64_t window_images = 0;
    double window_loss = 0;
    while (batches.next(x, y)) {
      if (rank == s.die_rank && step == s.die_step) {
        say(s, rank,
            format("exiting abruptly at step %lld (--die-rank)", static_cast<long long>(step)));
        std::_Exit(3);
      }
      if (t.lr_schedule == "cosine")
        sgd.lr(t.lr * 0.5 *
               (1 + std::cos(M_PI * static_cast<double>(step) / static_cast<double>(steps))));
      opt.zero_grad();
      auto loss = torch::nll_loss(forward(x.to(device)), y.to(device));
      loss.backward();
      dp->step(opt);
      window_images += x.size(0);
      window_loss += loss.item<double>();
      if (++step % t.log_every == 0 && speaks) {
        double sec =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - window_start).count();
        auto st = dp->stats();
        say(s, rank,
            format("epoch %lld step %lld loss %.4f images/s %.0f MB sent %.1f",
                   static_cast<long long>(epoch + 1), static_cast<long long>(step),
                   window_loss / t.log_every,
                   window_images * (is_bucket_algorithm(s.algorithm) ? world : 1) / sec,
                   static_cast<double>(st.bytes_sent) / 1e6));
        window_start = std::chrono::steady_clock::now();
        window_images = 0;
        window_loss = 0;
      }
      ++batch_index;
      if (s.checkpoint_every > 0 && step % s.checkpoint_every == 0) {
        saved_epoch = epoch;
        saved_batch = batch_index;
        await_parameters(*module);  // --overlap-next-forward: the step's update, before saving
        checkpoint.save_step(s.checkpoint_dir, step);
      }
      if (s.stop_step > 0 && step == s.stop_step) {
        say(s, rank,
            format("stopping after step %lld (--stop-step)", static_cast<long long>(step)));
        return;
      }
    }
    await_parameters(*module);  // --overlap-next-forward: the last step's update
    const double epoch_sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
    const double wait_sec = dp->stats().comm_wait_sec - wait_before;
    std::string consensus;
    try {
      consensus = format("%.4g", consensus_distance(rt, *module));
    } catch (const std::exception& e) {
      // A collective of every rank. A gossip job trains on without a dead neighbour, so this
      // metric may fail there: it is reported and training goes on. Any other job needs every
      // rank in every step: a failed or timed-out collective ends the run, as an uncaught
      // collective error ends a PyTorch DDP job.
      const std::string why =
          "epoch " + std::to_string(epoch + 1) + ": consensus distance: " + e.what();
      if (!tolerates_dead_ranks(s.algorithm)) throw comm::Error(why);
      consensus = "n/a";
      say(s, rank, why);
    }
    if (rank == 0) {
      auto st = dp->stats();
      double acc = examples::accuracy(*module, evaluate, test);
      say(s, rank,
          format(
              "epoch %lld test accuracy %.2f%% bytes sent per step %.0f (last step %llu) "
              "epoch time %.1f s (communication wait %.1f s, compute %.0f%%) consensus "
              "distance %s",
              static_cast<long long>(epoch + 1), acc * 100,
              st.steps ? static_cast<double>(st.bytes_sent) / static_cast<double>(st.steps) : 0.0,
              static_cast<unsigned long long>(st.last_step_bytes_sent), epoch_sec, wait_sec,
              epoch_sec > 0 ? 100 * (epoch_sec - wait_sec) / epoch_sec : 100.0, consensus.c_str()));
    }
  }
  dp->finish();
  if (rank == 0) say(s, rank, "parameter checksum " + parameter_checksum(*module));
  auto st = dp->stats();
  if (!st.dropped_peers.empty()) {
    std::string peers;
    for (int p : st.dropped_peers) peers += (peers.empty() ? "" : ", ") + std::to_string(p);
    say(s, rank, "finished without dropped peer(s) " + peers);
  } else if (speaks && !is_bucket_algorithm(s.algorithm)) {
    say(s, rank,
        format("finished: %llu steps, %llu background rounds, %.1f MB sent, "
               "peak %.3f MB per sync",
               static_cast<unsigned long long>(st.steps),
               static_cast<unsigned long long>(st.background_rounds),
               static_cast<double>(st.bytes_sent) / 1e6,
               static_cast<double>(st.peak_sync_bytes_sent) / 1e6));
  }
}

// A rank that cannot go on tells the others why, so that they stop at once naming it and the
// error instead of waiting for it until their deadlines.
void train_or_fail(Runtime& rt, const Settings& s) {
  try {
    train_rank(rt, s);
  } catch (const std::exception& e) {
    rt.fail(e.what());
    throw;
  }
}

// Sparsification's momentum correction already applies momentum: SGD's would apply it twice.
void check_momentum_once(const Settings& s) {
  const auto* c = std::get_if<comm::Compression>(&s.algorithm);
  const auto* sparse = c ? std::get_if<comm::Sparsification>(c) : nullptr;
  if (sparse && sparse->momentum > 0 && s.trainer.momentum > 0)
    throw comm::Error(
        format("%s applies momentum %g inside the compressor (momentum correction), "
               "so SGD must run without it: momentum %g given, expected 0 "
               "(--momentum 0, or trainer.momentum = 0 in a job file)",
               comm::algorithm_name(*c).c_str(), sparse->momentum, s.trainer.momentum));
}

// Every rank as a thread of this process, over the in-process transport.
int run_threads(const Settings& s, int world, const comm::LinkEmulation& links) {
  auto fabric = std::make_shared<comm::InprocFabric>(world);
  const int port = pick_free_port();
  std::vector<RuntimeOptions> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(thread_rank_options(r, world, port, fabric));
    ranks.back().links = links;
    ranks.back().collective_timeout = collective_timeout(s);
  }
  const auto errors = run_thread_ranks(ranks, [&](int, Runtime& rt) { train_or_fail(rt, s); });
  int status = 0;
  for (int r = 0; r < world; ++r) {
    if (errors[static_cast<size_t>(r)].empty()) continue;
    std::cerr << "fashion_mnist: rank " << r << ": " << errors[static_cast<size_t>(r)] << "\n";
    status = 1;
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fashion-MNIST, data parallel over troupe"};
  Settings s;
  auto& t = s.trainer;
  std::string algorithm = "allreduce", job_file;
  app.add_option("--job", job_file,
                 "A job file (troupe run's TOML): algorithm, trainer settings and links from it");
  app.add_option("--data", t.data, "Folder with the four *-ubyte.gz files");
  app.add_option("--model", t.model, "cnn or mlp")->check(CLI::IsMember({"cnn", "mlp"}));
  app.add_option("--device", s.device,
                 "cpu, cuda (each rank on GPU local-rank mod the GPUs it sees) or cuda:N")
      ->check(CLI::Validator([](std::string& v) { return check_device_name(v); }, "DEVICE"));
  const int max_int = std::numeric_limits<int>::max();
  app.add_option("--epochs", t.epochs, "Epochs")->check(cli::integer_in(1, max_int));
  app.add_option("--batch", t.batch, "Batch per rank")->check(cli::integer_in(1, max_int));
  app.add_option("--lr", t.lr, "SGD learning rate")->check(cli::number_above(0));
  app.add_option("--momentum", t.momentum, "SGD momentum")->check(cli::number_in(0, 1, true));
  app.add_option("--lr-schedule", t.lr_schedule,
                 "constant, or cosine: lr (1 + cos(pi step / steps)) / 2 over the whole run")
      ->check(CLI::IsMember({"constant", "cosine"}));
  app.add_option("--log-every", t.log_every, "Steps between progress lines")
      ->check(cli::integer_in(1, max_int));
  app.add_option("--threads", t.threads,
                 "Compute threads per rank (torch's intra-op threads and OpenBLAS's pool)")
      ->check(cli::integer_in(1, 1024));
  app.add_option("--seed", t.seed, "Seed of the shards and the batch order");
  app.add_option("--algorithm", algorithm,
                 "allreduce, fp16, bf16, bytegrad, int4, sign, sign-vote, topk, randomk, blockk "
                 "or powersgd, with settings: powersgd:rank=2,start_iter=10 or topk:ratio=0.01; "
                 "local updates: diloco:h=50,compress=int4, "
                 "streaming-diloco:h=50,fragments=4,delay=2,alpha=0.5,compress=int4,eager=0 or "
                 "sparseloco:h=50,ratio=0.015625,bits=2; gossip: "
                 "decentralized:topology=ring,exchange=after_step, "
                 "low_precision_decentralized:gamma=0.5, "
                 "async_model_average:warmup_steps=10,sync_interval_ms=100 or "
                 "async_gossip:topology=ring,min_interval_ms=10");
  app.add_flag("--delay-reduce", s.ddp.delay_reduce, "Reduce after backward (no overlap)");
  app.add_flag("--overlap-next-forward", s.ddp.overlap_next_forward,
               "Let a step's reductions run on into the next forward, each layer waiting for its "
               "own (allreduce and the compressors)");
  app.add_option("--trace", s.ddp.trace_path,
                 "Write a Chrome trace per rank here ({rank} is replaced)");
  app.add_option("--die-rank", s.die_rank, "Testing: this rank exits abruptly at --die-step")
      ->group("");
  app.add_option("--die-step", s.die_step, "Testing: the step at which --die-rank exits")
      ->group("");
  app.add_option("--collective-timeout", s.collective_timeout_sec,
                 "Seconds each collective (a step's gradient reduction too) waits for the other "
                 "ranks before the job fails (default 60; raise it when rank 0's end-of-epoch "
                 "evaluation is slow)")
      ->check(cli::number_above(0, 1e9));
  app.add_option("--subset", s.subset, "Train on the first N training images only (0: all)")
      ->check(cli::integer_in(0, max_int));
  app.add_option("--checkpoint", s.checkpoint_dir,
                 "Save the job's checkpoint here every --checkpoint-every steps (DIR/step-N/, a "
                 "file per rank, and each rank's record of the last step all ranks saved)");
  app.add_option("--checkpoint-every", s.checkpoint_every, "Steps between two checkpoints")
      ->check(cli::integer_in(1, max_int));
  app.add_option("--resume", s.resume_dir,
                 "Continue from the last step every rank saved in this folder (same world size, "
                 "algorithm, seed, batch, subset and model)");
  app.add_flag("--resume-without-algorithm-state", s.drop_algorithm_state,
               "Benchmarks: resume the model, optimizer and loader but not the algorithm's state")
      ->group("");
  app.add_option("--stop-step", s.stop_step,
                 "Testing: every rank stops after this step, as if the job were killed")
      ->group("");
  CLI11_PARSE(app, argc, argv);
  if (s.checkpoint_dir.empty() != (s.checkpoint_every == 0)) {
    std::cerr << "fashion_mnist: --checkpoint DIR and --checkpoint-every STEPS go together\n";
    return 2;
  }

  try {
    comm::LinkEmulation links;
    int world = 0;
    bool links_from_job = false;
    if (!job_file.empty()) {
      auto job = load_job_config(job_file);
      t = job.trainer;
      s.algorithm = job.algorithm;
      links = job.links;
      links_from_job = true;
      world = job.world_size;
      s.ranks_as_threads = job.mode == JobConfig::Mode::threads;
    } else {
      s.algorithm = parse_algorithm_argument(algorithm);
    }
    if (s.ddp.overlap_next_forward && !is_bucket_algorithm(s.algorithm))
      throw comm::Error("--overlap-next-forward with --algorithm " + algorithm +
                        ": expected allreduce or a compressor (the others do not reduce "
                        "gradients in buckets)");
    check_momentum_once(s);
    troupe::set_compute_threads(t.threads);
    torch::manual_seed(t.seed);
    if (s.ranks_as_threads) return run_threads(s, world, links);
    RuntimeOptions o;
    if (links_from_job) o.links = links;
    o.collective_timeout = collective_timeout(s);
    // An elastic rank loads its data before it joins the job: a hot spare waits with it loaded.
    const bool elastic = std::getenv("TROUPE_ELASTIC_FD") != nullptr;
    std::optional<examples::ElasticData> elastic_data;
    if (elastic) elastic_data = examples::load_elastic_data(t.data, s.subset);
    Runtime rt(o);
    if (rt.elastic()) {
      if (s.device != "cpu")
        throw comm::Error("--device " + s.device +
                          " with troupe launch --elastic: elastic "
                          "training runs on the CPU only (expected --device cpu)");
      // troupe launch --elastic: a bucket algorithm, DiLoCo, Streaming DiLoCo, SparseLoCo, D-PSGD,
      // Choco-SGD, AsyncModelAverage or AsyncGossip through an ElasticTrainer
      // (fashion_mnist/elastic.h), which refuses the others by name.
      examples::ElasticRun run{t.data,     t.model,     t.epochs, t.batch,     t.lr,
                               t.momentum, t.log_every, t.seed,   s.algorithm, s.ddp};
      if (!elastic_data) elastic_data = examples::load_elastic_data(t.data, s.subset);
      examples::train_elastic(rt, run, *elastic_data);
      return 0;
    }
    if (world && rt.world_size() != world)
      throw comm::Error(job_file + ": job.world_size = " + std::to_string(world) +
                        " but this job has " + std::to_string(rt.world_size()) +
                        " ranks (start it with troupe run)");
    train_or_fail(rt, s);
  } catch (const std::exception& e) {
    std::cerr << "fashion_mnist: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
