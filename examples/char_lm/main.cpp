// A character-level language model trained data parallel over troupe, with any of its algorithms:
// the second workload beside fashion_mnist, the kind of model that local-update methods (DiLoCo
// and its family) are judged on. It reports evaluation loss in bits per character on held-out
// fortunes, beside what a unigram model of the training text reaches.
//   build/bin/troupe launch -n 4 -- build/bin/char_lm --steps 600
//   build/bin/troupe launch -n 4 -- build/bin/char_lm --algorithm powersgd:rank=4
//   build/bin/troupe launch -n 4 -- build/bin/char_lm --job examples/configs/gossip_ring8.toml
// With --job only the job file's algorithm (and link emulation) is used; the trainer's settings
// are this program's options.
#include <torch/torch.h>
#include <troupe/option_checks.h>
#include <troupe/troupe.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <iostream>
#include <limits>
#include <variant>

#include "char_lm/corpus.h"
#include "char_lm/model.h"

using namespace troupe;

namespace {

struct Settings {
  std::string data = "/usr/share/games/fortunes";
  std::string model = "transformer";
  std::string optimizer = "adamw";
  examples::CharModelShape shape;
  int64_t steps = 600;
  int64_t batch = 32;
  double lr = 3e-3;
  double momentum = 0.9;                 // sgd
  double weight_decay = 0.01;            // adamw
  int64_t warmup = 0;                    // steps of linear warm-up from lr / warmup to lr
  std::string lr_schedule = "constant";  // or cosine: decays to 0 at the last step after warm-up
  int64_t log_every = 50;
  int64_t eval_every = 200;
  int64_t eval_windows = 256;
  int threads = 1;
  uint64_t seed = 1;
  std::string device = "cpu";  // rank/device.h
  JobAlgorithm algorithm = comm::GradientAllReduce{};
};

void say(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void say(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vprintf(fmt, args);
  va_end(args);
  std::printf("\n");
  std::fflush(stdout);
}

// Mean negative log-likelihood of the windows' targets, in bits per character.
double bits_per_char(const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                     const torch::Tensor& inputs, const torch::Tensor& targets) {
  torch::NoGradGuard no_grad;
  double nats = 0;
  const int64_t n = inputs.size(0), chunk = 64;
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t m = std::min(chunk, n - i);
    auto logp = forward(inputs.narrow(0, i, m));
    nats += torch::nll_loss(logp.reshape({-1, logp.size(-1)}),
                            targets.narrow(0, i, m).reshape({-1}), {}, at::Reduction::Sum)
                .item<double>();
  }
  return nats / static_cast<double>(targets.numel()) / std::log(2.0);
}

// DiLoCo and its family: they synchronise every few steps, and the largest synchronisation (its
// bytes on the wire) is what a link must carry in one go.
bool is_local_update(const JobAlgorithm& a) {
  return std::holds_alternative<DiLoCo>(a) || std::holds_alternative<StreamingDiLoCo>(a) ||
         std::holds_alternative<SparseLoCo>(a);
}

// The learning rate of step `step` (1-based): linear warm-up over s.warmup steps, then constant
// or a cosine decay to 0 at s.steps. Every rank and every algorithm applies the same schedule to
// its (inner) optimizer, so the runs compare at equal learning rates.
double scheduled_lr(const Settings& s, int64_t step) {
  if (step <= s.warmup) return s.lr * static_cast<double>(step) / static_cast<double>(s.warmup);
  if (s.lr_schedule != "cosine") return s.lr;
  const double done =
      static_cast<double>(step - s.warmup) / static_cast<double>(s.steps - s.warmup);
  return s.lr * 0.5 * (1 + std::cos(M_PI * done));
}

void train(Runtime& rt, const Settings& s) {
  const int rank = rt.rank(), world = rt.world_size();
  const int64_t length = s.shape.context;
  auto corpus = examples::load_char_corpus(s.data, 20, 4 * (length + 1));
  auto shape = s.shape;
  shape.vocab = corpus.vocab();
  torch::manual_seed(s.seed);  // the same initial weights on every rank (and rank 0's broadcast)
  std::shared_ptr<torch::nn::Module> module;
  // The model lives on the device; the windows are drawn in host memory and copied over (forward
  // answers on the device; evaluate brings it back for scoring on the host).
  const torch::Device device = training_device(s.device, rt.local_rank());
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  auto take = [&](auto net) {  // a CharTransformer or a CharLstm
    net->to(device);
    module = net.ptr();
    forward = [net, device](const torch::Tensor& x) mutable { return net->forward(x.to(device)); };
  };
  if (s.model == "transformer")
    take(examples::CharTransformer(shape));
  else
    take(examples::CharLstm(shape));
  const auto evaluate = [&forward](const torch::Tensor& x) { return forward(x).to(torch::kCPU); };
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (s.optimizer == "adamw")
    opt = std::make_unique<torch::optim::AdamW>(
        module->parameters(), torch::optim::AdamWOptions(s.lr).weight_decay(s.weight_decay));
  else
    opt = std::make_unique<torch::optim::SGD>(module->parameters(),
                                              torch::optim::SGDOptions(s.lr).momentum(s.momentum));
  auto dp = make_data_parallel(rt, module, s.algorithm);

  torch::Tensor eval_in, eval_out;
  examples::eval_windows(corpus.eval, length, s.eval_windows, eval_in, eval_out);
  const double unigram = examples::unigram_bits_per_char(corpus.train, corpus.eval, corpus.vocab());
  if (rank == 0) {
    int64_t params = 0;
    for (auto& p : module->parameters()) params += p.numel();
    say("char_lm: %s (%lld parameters) on %s, %s lr %g (%s, warm-up %lld steps), %s, %d "
        "rank(s), batch %lld x %lld characters per "
        "rank, %lld training / %lld evaluation characters, vocabulary %lld, unigram bits per "
        "char %.4f",
        s.model.c_str(), static_cast<long long>(params), device.str().c_str(), s.optimizer.c_str(),
        s.lr, s.lr_schedule.c_str(), static_cast<long long>(s.warmup), dp->algorithm_name().c_str(),
        world, static_cast<long long>(s.batch), static_cast<long long>(length),
        static_cast<long long>(corpus.train.numel()), static_cast<long long>(corpus.eval.numel()),
        static_cast<long long>(corpus.vocab()), unigram);
  }

  examples::WindowSampler sampler(corpus.train, length,
                                  s.seed * 1000003 + static_cast<uint64_t>(rank));
  const auto start = std::chrono::steady_clock::now();
  auto window_start = start;
  double window_loss = 0, last_eval = std::nan("");
  torch::Tensor x, y;
  for (int64_t step = 1; step <= s.steps; ++step) {
    sampler.next(s.batch, x, y);
    if (s.warmup > 0 || s.lr_schedule != "constant") {
      const double lr = scheduled_lr(s, step);
      for (auto& group : opt->param_groups()) group.options().set_lr(lr);
    }
    opt->zero_grad();
    auto logp = forward(x);
    auto loss = torch::nll_loss(logp.reshape({-1, logp.size(-1)}), y.to(device).reshape({-1}));
    loss.backward();
    dp->step(*opt);
    window_loss += loss.item<double>();
    if (step % s.log_every == 0 && rank == 0) {
      const double sec =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - window_start).count();
      say("step %lld loss %.4f (%.3f bits per char) characters/s %.0f MB sent %.1f",
          static_cast<long long>(step), window_loss / s.log_every,
          window_loss / s.log_every / std::log(2.0),
          // every rank trains on its own windows, whatever the algorithm
          static_cast<double>(s.log_every * s.batch * length * world) / sec,
          static_cast<double>(dp->stats().bytes_sent) / 1e6);
      window_start = std::chrono::steady_clock::now();
      window_loss = 0;
    }
    if (rank == 0 && (step % s.eval_every == 0 || step == s.steps)) {
      last_eval = bits_per_char(evaluate, eval_in, eval_out);
      say("eval step %lld bits per char %.4f (unigram %.4f)", static_cast<long long>(step),
          last_eval, unigram);
    }
  }
  dp->finish();
  if (rank == 0) {
    const auto st = dp->stats();
    const double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    say("final eval bits per char %.4f after %lld steps, %lld characters per rank, bytes sent per "
        "step %.0f, %.1f s",
        last_eval, static_cast<long long>(s.steps),
        static_cast<long long>(s.steps * s.batch * length),
        st.steps ? static_cast<double>(st.bytes_sent) / static_cast<double>(st.steps) : 0.0, sec);
    if (is_local_update(s.algorithm))
      say("peak bytes sent by one sync %llu",
          static_cast<unsigned long long>(st.peak_sync_bytes_sent));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A character-level language model, data parallel over troupe"};
  Settings s;
  std::string algorithm = "allreduce", job_file;
  const int max_int = std::numeric_limits<int>::max();
  app.add_option("--data", s.data, "Folder of fortune files (Debian package fortunes)");
  app.add_option("--model", s.model, "transformer or lstm")
      ->check(CLI::IsMember({"transformer", "lstm"}));
  app.add_option("--optimizer", s.optimizer, "adamw or sgd")
      ->check(CLI::IsMember({"adamw", "sgd"}));
  app.add_option("--context", s.shape.context, "Characters per training window")
      ->check(cli::integer_in(1, 4096));
  app.add_option("--dim", s.shape.dim, "Model width")->check(cli::integer_in(1, 65536));
  app.add_option("--layers", s.shape.layers, "Blocks (transformer) or LSTM layers")
      ->check(cli::integer_in(1, 64));
  app.add_option("--heads", s.shape.heads, "Attention heads (transformer; divides --dim)")
      ->check(cli::integer_in(1, 1024));
  app.add_option("--steps", s.steps, "Training steps")->check(cli::integer_in(1, max_int));
  app.add_option("--batch", s.batch, "Windows per rank and step")
      ->check(cli::integer_in(1, max_int));
  app.add_option("--lr", s.lr, "Learning rate")->check(cli::number_above(0));
  app.add_option("--warmup", s.warmup, "Steps of linear learning-rate warm-up")
      ->check(cli::integer_in(0, max_int));
  app.add_option("--lr-schedule", s.lr_schedule,
                 "constant, or cosine: after the warm-up, decay to 0 at the last step")
      ->check(CLI::IsMember({"constant", "cosine"}));
  app.add_option("--momentum", s.momentum, "SGD momentum")->check(cli::number_in(0, 1, true));
  app.add_option("--weight-decay", s.weight_decay, "AdamW weight decay")
      ->check(cli::number_in(0, 1, true));
  app.add_option("--log-every", s.log_every, "Steps between progress lines")
      ->check(cli::integer_in(1, max_int));
  app.add_option("--eval-every", s.eval_every, "Steps between evaluations")
      ->check(cli::integer_in(1, max_int));
  app.add_option("--eval-windows", s.eval_windows, "Held-out windows scored per evaluation")
      ->check(cli::integer_in(1, max_int));
  app.add_option("--threads", s.threads,
                 "Compute threads per rank (torch's intra-op threads and OpenBLAS's pool)")
      ->check(cli::integer_in(1, 1024));
  app.add_option("--seed", s.seed, "Seed of the weights and the windows");
  app.add_option("--device", s.device,
                 "cpu, cuda (each rank on GPU local-rank mod the GPUs it sees) or cuda:N")
      ->check(CLI::Validator([](std::string& v) { return check_device_name(v); }, "DEVICE"));
  app.add_option("--algorithm", algorithm,
                 "allreduce, fp16, bf16, bytegrad, int4, sign, sign-vote, topk, randomk, blockk "
                 "or powersgd, with settings: powersgd:rank=4 or topk:ratio=0.01; local updates: "
                 "diloco:h=50,compress=int4, "
                 "streaming-diloco:h=50,fragments=4,delay=2,alpha=0.5,compress=int4,eager=0 or "
                 "sparseloco:h=50,ratio=0.015625,bits=2");
  app.add_option("--job", job_file, "A job file (troupe run's TOML): its algorithm and links only");
  CLI11_PARSE(app, argc, argv);
  if (s.warmup >= s.steps) {
    std::cerr << "char_lm: --warmup " << s.warmup << " must be below --steps " << s.steps << "\n";
    return 1;
  }
  try {
    RuntimeOptions o;
    if (!job_file.empty()) {
      auto job = load_job_config(job_file);
      s.algorithm = job.algorithm;
      o.links = job.links;
    } else {
      s.algorithm = parse_algorithm_argument(algorithm);
    }
    troupe::set_compute_threads(s.threads);
    Runtime rt(o);
    try {
      train(rt, s);
    } catch (const std::exception& e) {
      rt.fail(e.what());  // the others stop at once, naming this rank and why
      throw;
    }
  } catch (const std::exception& e) {
    std::cerr << "char_lm: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
