#include "tools/job_config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <type_traits>
#include <variant>
#include <vector>

#include "comm/compression/settings.h"
#include "comm/overloaded.h"
#include "comm/status.h"
#include "rank/env.h"

namespace troupe {

namespace {

using comm::Error;
using Keys = std::vector<std::string>;

const Keys kTables = {"job", "topology", "algorithm", "trainer", "links"};
const Keys kJobKeys = {"world_size", "mode", "timeout_sec"};
const Keys kTopologyKeys = {"kind", "mixing", "rows", "cols", "edges", "seed"};
const Keys kTrainerKeys = {"program",     "model", "epochs",    "batch", "lr",     "momentum",
                           "lr_schedule", "data",  "log_every", "seed",  "threads"};
const Keys kLinksKeys = {"all", "ranks"};

/// The fields of S a key may set: integers, numbers, flags, and the outer compression where S has
/// one (SparseLoCo has none).
template <class S, class = void>
struct KeyField {
  using type = std::variant<int S::*, size_t S::*, double S::*, bool S::*>;
};
template <class S>
struct KeyField<S, std::void_t<decltype(&S::outer_compression)>> {
  using type = std::variant<int S::*, size_t S::*, double S::*, bool S::*, comm::Compression S::*>;
};

/// One setting of a local-update algorithm (DiLoCo, Streaming DiLoCo, SparseLoCo), for the job
/// file and the command line alike: its keys, the field of S it sets, and what it accepts. The
/// command line takes the job file's key as well as its own shorter one.
template <class S>
struct LocalKey {
  std::string toml;  // the job file's key: "inner_steps"
  std::string cli;   // the command line's: "h"
  typename KeyField<S>::type field;
  // Numbers and integers: the values allowed, and how messages say so ("an integer >= 1"). A
  // flag is true or false; a compression is what comm::parse_compression reads.
  std::function<bool(double)> ok;
  std::string expected;

  bool named(const std::string& key) const { return key == cli || key == toml; }
};

/// The integers in [min, max] (max: kept to what an int holds).
std::function<bool(double)> integers(int64_t min, int64_t max = 1000000000) {
  return [=](double x) {
    return x >= static_cast<double>(min) && x <= static_cast<double>(max) && x == std::floor(x);
  };
}

template <class S>
LocalKey<S> integer_key(std::string toml, std::string cli, int S::*field, int64_t min) {
  return {std::move(toml), std::move(cli), field, integers(min),
          "an integer >= " + std::to_string(min)};
}

template <class S>
LocalKey<S> flag_key(std::string key, bool S::*field) {
  return {key, key, field, nullptr, ""};
}

// The keys every local-update algorithm shares, and those of the outer SGD (DiLoCo and Streaming
// DiLoCo), written once.
template <class S>
LocalKey<S> inner_steps_key() {
  return integer_key("inner_steps", "h", &S::inner_steps, 1);
}
template <class S>
LocalKey<S> outer_lr_key() {
  return {"outer_lr", "outer_lr", &S::outer_lr, [](double x) { return x > 0; }, "a number > 0"};
}
template <class S>
LocalKey<S> outer_momentum_key() {
  return {"outer_momentum", "outer_momentum", &S::outer_momentum,
          [](double x) { return x >= 0 && x < 1; }, "a number in [0, 1)"};
}
template <class S>
LocalKey<S> nesterov_key() {
  return flag_key("nesterov", &S::nesterov);
}
template <class S>
LocalKey<S> outer_compression_key() {
  return {"outer_compression", "compress", &S::outer_compression, nullptr, ""};
}

const std::vector<LocalKey<DiLoCo>>& diloco_keys() {
  static const std::vector<LocalKey<DiLoCo>> keys = {
      inner_steps_key<DiLoCo>(), outer_lr_key<DiLoCo>(), outer_momentum_key<DiLoCo>(),
      nesterov_key<DiLoCo>(), outer_compression_key<DiLoCo>()};
  return keys;
}

const std::vector<LocalKey<StreamingDiLoCo>>& streaming_diloco_keys() {
  using S = StreamingDiLoCo;
  static const std::vector<LocalKey<S>> keys = {
      inner_steps_key<S>(),
      integer_key("fragments", "fragments", &S::fragments, 1),
      integer_key("delay", "delay", &S::delay, 0),
      {"alpha", "alpha", &S::fragment_update_alpha, [](double x) { return x >= 0 && x <= 1; },
       "a number in [0, 1]"},
      outer_lr_key<S>(),
      outer_momentum_key<S>(),
      nesterov_key<S>(),
      outer_compression_key<S>(),
      flag_key("eager", &S::eager)};
  return keys;
}

const std::vector<LocalKey<SparseLoCo>>& sparseloco_keys() {
  using S = SparseLoCo;
  static const std::vector<LocalKey<S>> keys = {
      inner_steps_key<S>(),
      outer_lr_key<S>(),
      {"ratio", "ratio", &S::ratio, [](double x) { return x > 0 && x <= 1; }, "a number in (0, 1]"},
      {"chunk", "chunk", &S::chunk, integers(1, 65536), "an integer in [1, 65536]"},
      {"value_bits", "bits", &S::value_bits,
       [](double x) { return x == 2 || x == 4 || x == 8 || x == 32; }, "2, 4, 8 or 32"},
      {"ef_decay", "beta", &S::ef_decay, [](double x) { return x >= 0 && x <= 1; },
       "a number in [0, 1]"}};
  return keys;
}

/// The keys of a table, in the job file's spelling or the command line's.
template <class S>
Keys toml_keys(const std::vector<LocalKey<S>>& keys) {
  Keys out;
  for (const auto& k : keys) out.push_back(k.toml);
  return out;
}

/// The decentralized and asynchronous algorithms, with the settings each takes beside `name`.
/// The bucket algorithms' names and settings come from comm/compression/settings.h, the table the
/// command line's --algorithm reads too.
const std::vector<std::pair<std::string, Keys>> kGossipAlgorithms = {
    {"decentralized", {"exchange", "communication_interval"}},
    {"low_precision_decentralized", {"gamma", "block"}},
    {"async_model_average", {"warmup_steps", "sync_interval_ms"}},
    {"async_gossip", {"min_interval_ms"}},
    {"diloco", toml_keys(diloco_keys())},
    {"sparseloco", toml_keys(sparseloco_keys())},
    {"streaming_diloco", toml_keys(streaming_diloco_keys())},
};
const char* const kTopologyUsers = "decentralized, low_precision_decentralized and async_gossip";

std::string join(const Keys& items, const std::string& quote = "") {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + quote + item + quote;
  return out;
}

std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

/// A value as messages show it, in TOML syntax: 2, 0.05, "2", [0, 1], { 3 = "20ms" }.
std::string value_text(const toml::node& node) {
  if (auto* v = node.as_string()) return quoted(v->get());
  if (auto* v = node.as_integer()) return std::to_string(v->get());
  if (auto* v = node.as_floating_point()) return comm::number_text(v->get());
  if (auto* v = node.as_boolean()) return v->get() ? "true" : "false";
  if (auto* array = node.as_array()) {
    std::string out;
    for (const auto& item : *array) out += (out.empty() ? "" : ", ") + value_text(item);
    return "[" + out + "]";
  }
  if (auto* table = node.as_table()) {
    std::string out;
    for (const auto& [key, item] : *table)
      out += (out.empty() ? "" : ", ") + std::string(key.str()) + " = " + value_text(item);
    return "{ " + out + " }";
  }
  std::ostringstream out;  // dates and times
  node.visit([&](const auto& n) { out << n; });
  return out.str();
}

/// One table of the job file: reads its keys with the checks of their type and range; every
/// error names the file, the key ("trainer.epochs"), the value and what was expected.
class Section {
 public:
  Section(const std::string& source, std::string name, const toml::table* table)
      : source_(source), name_(std::move(name)), table_(table) {}

  bool present() const { return table_ != nullptr; }
  /// The table itself; only when present().
  const toml::table& table() const { return *table_; }
  std::string key_path(const std::string& key) const { return name_ + "." + key; }
  const toml::node* find(const std::string& key) const {
    return table_ ? table_->get(key) : nullptr;
  }

  /// Throws for the first key not in `allowed`; `whose` says whose keys they are.
  void only(const Keys& allowed, const std::string& whose = "") const {
    if (!table_) return;
    for (const auto& [key, value] : *table_)
      if (std::find(allowed.begin(), allowed.end(), key.str()) == allowed.end())
        throw Error(source_ + ": unknown key " + key_path(std::string(key.str())) + " (allowed" +
                    (whose.empty() ? "" : " for " + whose) + ": " +
                    (allowed.empty() ? "none" : join(allowed)) + ")");
  }

  [[noreturn]] void fail(const std::string& key, const toml::node& value,
                         const std::string& expected) const {
    throw Error(source_ + ": " + key_path(key) + " = " + value_text(value) + ": expected " +
                expected);
  }
  [[noreturn]] void error(const std::string& message) const {
    throw Error(source_ + ": " + message);
  }
  [[noreturn]] void missing(const std::string& key, const std::string& expected) const {
    throw Error(source_ + ": " + key_path(key) + " is missing (expected " + expected + ")");
  }

  /// An integer >= min that T holds. False when absent.
  template <class T>
  bool integer(const std::string& key, T& out, int64_t min) const {
    const toml::node* node = find(key);
    if (!node) return false;
    int64_t max = std::numeric_limits<int64_t>::max();
    if (static_cast<uint64_t>(std::numeric_limits<T>::max()) < static_cast<uint64_t>(max))
      max = static_cast<int64_t>(std::numeric_limits<T>::max());
    const auto* value = node->as_integer();
    if (!value || value->get() < min) fail(key, *node, "an integer >= " + std::to_string(min));
    if (value->get() > max)
      fail(key, *node, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
    out = static_cast<T>(value->get());
    return true;
  }

  /// A finite number (an integer is taken as one) for which `ok` holds, `expected` saying which.
  bool number(const std::string& key, double& out, const std::function<bool(double)>& ok,
              const std::string& expected) const {
    const toml::node* node = find(key);
    if (!node) return false;
    double x = 0;
    if (auto* f = node->as_floating_point())
      x = f->get();
    else if (auto* i = node->as_integer())
      x = static_cast<double>(i->get());
    else
      fail(key, *node, expected);
    if (!std::isfinite(x) || !ok(x)) fail(key, *node, expected);
    out = x;
    return true;
  }

  bool boolean(const std::string& key, bool& out) const {
    const toml::node* node = find(key);
    if (!node) return false;
    const auto* value = node->as_boolean();
    if (!value) fail(key, *node, "true or false");
    out = value->get();
    return true;
  }

  bool text(const std::string& key, std::string& out, bool allow_empty = true) const {
    const toml::node* node = find(key);
    if (!node) return false;
    const auto* value = node->as_string();
    if (!value || (!allow_empty && value->get().empty()))
      fail(key, *node, allow_empty ? "a string" : "a non-empty string");
    out = value->get();
    return true;
  }

  /// One of `names`; returns its index, or -1 when the key is absent.
  int choice(const std::string& key, const Keys& names) const {
    const toml::node* node = find(key);
    if (!node) return -1;
    const auto* value = node->as_string();
    const auto it = value ? std::find(names.begin(), names.end(), value->get()) : names.end();
    if (it == names.end()) fail(key, *node, "one of " + join(names, "\""));
    return static_cast<int>(it - names.begin());
  }

  /// A string handed to one of comm's parsers; its error is given the file and the key.
  template <class Parse>
  auto parsed(const std::string& key, const toml::node& node, Parse parse) const {
    const auto* value = node.as_string();
    if (!value) fail(key, node, "a string");
    try {
      return parse(value->get());
    } catch (const Error& e) {
      throw Error(source_ + ": " + key_path(key) + " = " + value_text(node) + ": " + e.what());
    }
  }

 private:
  const std::string& source_;
  std::string name_;
  const toml::table* table_;
};

const toml::table* table_of(const toml::table& root, const std::string& name,
                            const std::string& source) {
  const toml::node* node = root.get(name);
  if (!node) return nullptr;
  if (!node->is_table())
    throw Error(source + ": " + name + " = " + value_text(*node) + ": expected a table ([" + name +
                "])");
  return node->as_table();
}

comm::TopologySpec read_topology(const Section& t) {
  t.only(kTopologyKeys);
  comm::TopologySpec spec;
  const toml::node* kind = t.find("kind");
  if (!kind) t.missing("kind", "ring, torus, complete, exponential, random_matching or edge_list");
  spec.kind = t.parsed("kind", *kind, comm::parse_topology_kind);
  if (const toml::node* mixing = t.find("mixing"))
    spec.mixing = t.parsed("mixing", *mixing, comm::parse_mixing);

  const std::string kind_text = comm::topology_kind_name(spec.kind);
  auto only_for = [&](const std::string& key, comm::TopologyKind user) {
    if (spec.kind != user && t.find(key))
      t.error(t.key_path(key) +
              " is only used by kind = " + quoted(comm::topology_kind_name(user)) +
              " (topology.kind = " + quoted(kind_text) + ")");
  };
  only_for("rows", comm::TopologyKind::torus);
  only_for("cols", comm::TopologyKind::torus);
  only_for("edges", comm::TopologyKind::edge_list);
  only_for("seed", comm::TopologyKind::random_matching);
  if (spec.kind == comm::TopologyKind::torus) {
    if (!t.integer("rows", spec.rows, 1)) t.missing("rows", "rows and cols of the torus");
    if (!t.integer("cols", spec.cols, 1)) t.missing("cols", "rows and cols of the torus");
  }
  if (spec.kind == comm::TopologyKind::edge_list) {
    const std::string expected = "an array of pairs of ranks, e.g. [[0, 1], [1, 2]]";
    const toml::node* edges = t.find("edges");
    if (!edges) t.missing("edges", expected);
    const toml::array* list = edges->as_array();
    if (!list) t.fail("edges", *edges, expected);
    for (size_t i = 0; i < list->size(); ++i) {
      const toml::node& edge = (*list)[i];
      const toml::array* pair = edge.as_array();
      auto rank_at = [&](size_t j) -> int {
        const auto* r = pair->get(j) ? pair->get(j)->as_integer() : nullptr;
        if (!r || r->get() < 0 || r->get() > std::numeric_limits<int>::max())
          t.fail("edges[" + std::to_string(i) + "]", edge, "a pair of ranks [a, b], each >= 0");
        return static_cast<int>(r->get());
      };
      if (!pair || pair->size() != 2)
        t.fail("edges[" + std::to_string(i) + "]", edge, "a pair of ranks [a, b], each >= 0");
      spec.edges.emplace_back(rank_at(0), rank_at(1));
    }
  }
  t.integer("seed", spec.seed, 0);
  return spec;
}

/// Checks `spec` against the world size and what `algorithm` needs of it.
void check_topology(const comm::TopologySpec& spec, int world_size, const std::string& algorithm,
                    const std::string& source) {
  std::optional<comm::Topology> topology;
  try {
    topology.emplace(spec, world_size);
  } catch (const Error& e) {
    const std::string what = e.what();  // Topology's messages start "topology <kind>: "
    throw Error(source + ": " + (what.rfind("topology", 0) == 0 ? "" : "topology: ") + what +
                " (job.world_size = " + std::to_string(world_size) + ")");
  }
  if (algorithm == "decentralized" && !topology->doubly_stochastic())
    throw Error(source + ": topology " + topology->describe() +
                ": its mixing matrix is not doubly stochastic, which decentralized needs (set "
                "topology.mixing = \"metropolis\")");
  if ((algorithm == "low_precision_decentralized" || algorithm == "async_gossip") &&
      (!topology->undirected() || topology->time_varying()))
    throw Error(source + ": topology " + topology->describe() + ": " + algorithm +
                " needs an undirected, static topology (topology.kind = \"ring\", \"torus\", "
                "\"complete\" or \"edge_list\")");
}

/// A bucket algorithm: each key of [algorithm] but `name` is a setting of its table entry, read
/// as that setting's type and checked against its range.
comm::Compression read_compression(const Section& a, const comm::AlgorithmEntry& entry,
                                   const std::string& source) {
  comm::Compression c = entry.defaults;
  std::vector<const comm::AlgorithmSetting*> seen;
  for (const auto& [key_view, node] : a.table()) {
    const std::string key(key_view.str());
    if (key == "name") continue;
    const comm::AlgorithmSetting* setting = entry.find(key);
    if (!setting)
      a.error("unknown key " + a.key_path(key) + " (allowed for " + entry.name + ": name" +
              (entry.settings.empty() ? "" : ", " + entry.keys()) + ")");
    if (std::find(seen.begin(), seen.end(), setting) != seen.end())
      a.error(a.key_path(key) + ": " + a.key_path(setting->key) + " is given twice");
    seen.push_back(setting);
    std::optional<comm::SettingValue> value;
    if (auto* b = node.as_boolean())
      value = b->get();
    else if (auto* i = node.as_integer())
      value = static_cast<int64_t>(i->get());
    else if (auto* f = node.as_floating_point())
      value = f->get();
    const std::string expected = value ? setting->check(*value) : setting->expected();
    if (!expected.empty()) a.fail(key, node, expected);
    setting->set(c, *value);
  }
  try {
    comm::validate(c);
  } catch (const Error& e) {
    throw Error(source + ": algorithm (" + entry.name + "): " + e.what());
  }
  return c;
}

/// A local-update algorithm: each key of [algorithm] in `keys` read as its field's type and checked
/// against its range.
template <class S>
S read_local_update(const Section& a, const std::vector<LocalKey<S>>& keys) {
  S s;
  for (const auto& k : keys) {
    const toml::node* node = a.find(k.toml);
    if (!node) continue;
    std::visit(Overloaded{
                   [&](bool S::*field) { a.boolean(k.toml, s.*field); },
                   [&](double S::*field) { a.number(k.toml, s.*field, k.ok, k.expected); },
                   [&](comm::Compression S::*field) {
                     s.*field = a.parsed(k.toml, *node, comm::parse_compression);
                   },
                   [&](auto field) {  // an integer
                     const auto* value = node->as_integer();
                     if (!value || !k.ok(static_cast<double>(value->get())))
                       a.fail(k.toml, *node, k.expected);
                     using T = std::remove_reference_t<decltype(s.*field)>;
                     s.*field = static_cast<T>(value->get());
                   },
               },
               k.field);
  }
  return s;
}

JobAlgorithm read_algorithm(const Section& a, const std::string& name,
                            const comm::TopologySpec& topology, const std::string& source) {
  const auto in_range = [](double lo_open, double hi_closed) {
    return [=](double x) { return x > lo_open && x <= hi_closed; };
  };

  if (const comm::AlgorithmEntry* entry = comm::find_compression_algorithm(name))
    return read_compression(a, *entry, source);
  if (name == "decentralized") {
    Decentralized d;
    d.topology = topology;
    if (a.choice("exchange", {"overlap", "after_step"}) == 1)
      d.exchange = Decentralized::Exchange::after_step;
    a.integer("communication_interval", d.communication_interval, 1);
    return d;
  }
  if (name == "low_precision_decentralized") {
    LowPrecisionDecentralized l;
    l.topology = topology;
    a.number("gamma", l.gamma, in_range(0, 1), "a number in (0, 1]");
    a.integer("block", l.block, 1);
    return l;
  }
  if (name == "async_model_average") {
    AsyncModelAverage m;
    a.integer("warmup_steps", m.warmup_steps, 0);
    a.integer("sync_interval_ms", m.sync_interval_ms, 1);
    return m;
  }
  if (name == "diloco") return read_local_update(a, diloco_keys());
  if (name == "sparseloco") return read_local_update(a, sparseloco_keys());
  if (name == "streaming_diloco") {
    const auto d = read_local_update(a, streaming_diloco_keys());
    // The keys that bound each other: fragments <= inner_steps, delay <= inner_steps / fragments.
    const std::string h = "inner_steps = " + std::to_string(d.inner_steps);
    if (d.fragments > d.inner_steps) {
      if (const toml::node* node = a.find("fragments"))
        a.fail("fragments", *node, "an integer in [1, inner_steps] (" + h + ")");
      a.fail("inner_steps", *a.find("inner_steps"),
             "an integer >= fragments (" + std::to_string(d.fragments) + ")");
    }
    const int most = d.inner_steps / d.fragments;
    if (d.delay > most) {
      const std::string bound = "inner_steps / fragments = " + std::to_string(most);
      if (const toml::node* node = a.find("delay"))
        a.fail("delay", *node,
               "an integer in [0, " + bound + "] (one fragment in flight at a time)");
      a.fail(a.find("fragments") ? "fragments" : "inner_steps",
             *a.find(a.find("fragments") ? "fragments" : "inner_steps"),
             "a value leaving " + bound + " >= delay (" + std::to_string(d.delay) + ")");
    }
    return d;
  }
  AsyncGossip g;  // the only name left
  g.topology = topology;
  a.integer("min_interval_ms", g.min_interval_ms, 0);
  return g;
}

TrainerConfig read_trainer(const Section& t) {
  t.only(kTrainerKeys);
  TrainerConfig c;
  t.text("program", c.program, false);
  if (const int model = t.choice("model", {"cnn", "mlp"}); model >= 0)
    c.model = model == 0 ? "cnn" : "mlp";
  t.integer("epochs", c.epochs, 1);
  t.integer("batch", c.batch, 1);
  t.number(
      "lr", c.lr, [](double x) { return x > 0; }, "a number > 0");
  t.number(
      "momentum", c.momentum, [](double x) { return x >= 0 && x < 1; }, "a number in [0, 1)");
  if (const int schedule = t.choice("lr_schedule", {"constant", "cosine"}); schedule >= 0)
    c.lr_schedule = schedule == 0 ? "constant" : "cosine";
  t.text("data", c.data, false);
  t.integer("log_every", c.log_every, 1);
  t.integer("seed", c.seed, 0);
  t.integer("threads", c.threads, 1);
  return c;
}

comm::LinkEmulation read_links(const Section& l, int world_size, const std::string& source) {
  l.only(kLinksKeys);
  comm::LinkEmulation links;
  if (const toml::node* all = l.find("all"))
    links.all = l.parsed("all", *all, comm::parse_link_shape);
  const toml::node* ranks = l.find("ranks");
  if (!ranks) return links;
  if (!ranks->is_table())
    l.fail("ranks", *ranks, "a table of rank = shape, e.g. ranks = { 3 = \"100mbit,20ms\" }");
  const Section by_rank(source, l.key_path("ranks"), ranks->as_table());
  for (const auto& [key, shape] : *ranks->as_table()) {
    const std::string text(key.str());
    const bool digits =
        !text.empty() && text.size() <= 9 &&
        std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
    const std::string expected = "a rank in [0, " + std::to_string(world_size) +
                                 ") (job.world_size = " + std::to_string(world_size) + ")";
    if (!digits) by_rank.fail(text, shape, "the key to be " + expected);
    const int rank = std::stoi(text);
    if (rank >= world_size) by_rank.fail(text, shape, "the key to be " + expected);
    for (const auto& [r, s] : links.ranks)
      if (r == rank)
        by_rank.error(by_rank.key_path(text) + ": rank " + std::to_string(rank) +
                      " is named twice");
    links.ranks.emplace_back(rank, by_rank.parsed(text, shape, comm::parse_link_shape));
  }
  std::sort(links.ranks.begin(), links.ranks.end(),
            [](const auto& x, const auto& y) { return x.first < y.first; });
  return links;
}

}  // namespace

std::string job_algorithm_name(const JobAlgorithm& algorithm) {
  return std::visit(
      Overloaded{
          [](const comm::Compression& c) -> std::string { return comm::compression_entry(c).name; },
          [](const Decentralized&) -> std::string { return "decentralized"; },
          [](const LowPrecisionDecentralized&) -> std::string {
            return "low_precision_decentralized";
          },
          [](const AsyncModelAverage&) -> std::string { return "async_model_average"; },
          [](const AsyncGossip&) -> std::string { return "async_gossip"; },
          [](const DiLoCo&) -> std::string { return "diloco"; },
          [](const SparseLoCo&) -> std::string { return "sparseloco"; },
          [](const StreamingDiLoCo&) -> std::string { return "streaming_diloco"; },
      },
      algorithm);
}

JobConfig parse_job_config(const std::string& text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(std::string_view(text), std::string_view(source));
  } catch (const toml::parse_error& e) {
    const auto& at = e.source().begin;
    throw Error(source + ":" + std::to_string(at.line) + ":" + std::to_string(at.column) +
                ": not valid TOML: " + std::string(e.description()));
  }
  for (const auto& [key, value] : root)
    if (std::find(kTables.begin(), kTables.end(), key.str()) == kTables.end())
      throw Error(source + ": unknown " + (value.is_table() ? "table [" : "key ") +
                  std::string(key.str()) + (value.is_table() ? "]" : "") +
                  " (allowed: the tables " + join(kTables) + ")");

  JobConfig config;
  config.source = source;

  const Section job(source, "job", table_of(root, "job", source));
  if (!job.present())
    throw Error(source + ": the table [job] is missing (expected at least job.world_size)");
  job.only(kJobKeys);
  int64_t world_size = 0;
  if (!job.integer("world_size", world_size, 1)) job.missing("world_size", "an integer >= 1");
  // Every rank of a job file runs on this host: refuse before a process or thread is started.
  if (world_size > kMaxLocalRanks)
    job.fail("world_size", *job.find("world_size"),
             "an integer in [1, " + std::to_string(kMaxLocalRanks) +
                 "] (the most ranks one host starts; troupe run starts every rank here)");
  config.world_size = static_cast<int>(world_size);
  if (job.choice("mode", {"threads", "processes"}) == 0) config.mode = JobConfig::Mode::threads;
  if (config.mode == JobConfig::Mode::threads && world_size > kMaxThreadRanks)
    job.fail("world_size", *job.find("world_size"),
             "an integer in [1, " + std::to_string(kMaxThreadRanks) +
                 "] with mode = \"threads\" (the most ranks one process runs as threads; "
                 "mode = \"processes\" allows " +
                 std::to_string(kMaxLocalRanks) + ")");
  job.number(
      "timeout_sec", config.timeout_sec, [](double x) { return x >= 0; },
      "a number >= 0 (0: no limit)");

  Keys names;
  for (const auto& entry : comm::compression_algorithms()) names.push_back(entry.name);
  for (const auto& [name, keys] : kGossipAlgorithms) names.push_back(name);
  const Section algorithm(source, "algorithm", table_of(root, "algorithm", source));
  if (!algorithm.present())
    throw Error(source +
                ": the table [algorithm] is missing (expected at least algorithm.name, "
                "one of " +
                join(names, "\"") + ")");
  const toml::node* name_node = algorithm.find("name");
  if (!name_node) algorithm.missing("name", "one of " + join(names, "\""));
  const std::string name = names[static_cast<size_t>(algorithm.choice("name", names))];
  for (const auto& [n, keys] : kGossipAlgorithms) {
    if (n != name) continue;
    Keys allowed = {"name"};
    allowed.insert(allowed.end(), keys.begin(), keys.end());
    algorithm.only(allowed, name);  // the bucket algorithms' keys are checked by their table
  }

  const bool uses_topology =
      name == "decentralized" || name == "low_precision_decentralized" || name == "async_gossip";
  const Section topology(source, "topology", table_of(root, "topology", source));
  comm::TopologySpec spec;
  if (topology.present() && !uses_topology)
    throw Error(source + ": [topology] is only used by " + kTopologyUsers +
                " (algorithm.name = " + quoted(name) + ")");
  if (uses_topology) {
    if (!topology.present())
      throw Error(source + ": " + name + " needs a [topology] table (e.g. kind = \"ring\")");
    spec = read_topology(topology);
  }
  config.algorithm = read_algorithm(algorithm, name, spec, source);
  if (uses_topology) check_topology(spec, config.world_size, name, source);

  config.trainer = read_trainer(Section(source, "trainer", table_of(root, "trainer", source)));
  config.links = read_links(Section(source, "links", table_of(root, "links", source)),
                            config.world_size, source);
  return config;
}

namespace {

/// The settings of "name:key=value,...": `take(key, value)` reads each (throwing for a key it
/// does not know); a setting that is not key=value, or a key given twice, is refused here.
void read_settings(const std::string& text, const std::string& head, const std::string& keys,
                   const std::function<void(const std::string&, const std::string&)>& take) {
  if (text.size() == head.size()) return;
  const std::string where = "--algorithm " + text + ": ";
  const std::string rest = text.substr(head.size() + 1);
  std::vector<std::string> seen;
  for (size_t at = 0; at <= rest.size();) {
    size_t end = rest.find(',', at);
    if (end == std::string::npos) end = rest.size();
    const std::string item = rest.substr(at, end - at);
    at = end + 1;
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error(where + "'" + item + "' is not key=value (keys: " + keys + ")");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (std::find(seen.begin(), seen.end(), key) != seen.end())
      throw Error(where + key + " is given twice");
    seen.push_back(key);
    take(key, value);
  }
}

/// One setting's value read as the command line gives it; errors name the key, the value and
/// what was expected.
struct SettingText {
  std::string where, key, value;
  double number(const std::function<bool(double)>& ok, const std::string& expected) const {
    size_t used = 0;
    double x = 0;
    try {
      x = std::stod(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (value.empty() || used != value.size() || !std::isfinite(x) || !ok(x))
      throw Error(where + key + " = '" + value + "', expected " + expected);
    return x;
  }
  bool flag() const {
    if (value != "0" && value != "1" && value != "true" && value != "false")
      throw Error(where + key + " = '" + value + "', expected 0, 1, true or false");
    return value == "1" || value == "true";
  }
};

/// A local-update algorithm from "name:key=value,...": each key in `keys` (either spelling) read as
/// its field's type and checked against its range.
template <class S>
S parse_local_update(const std::string& text, const std::string& head,
                     const std::vector<LocalKey<S>>& keys) {
  std::string names;
  for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k.cli;
  const std::string where = "--algorithm " + text + ": ";
  S s;
  read_settings(text, head, names, [&](const std::string& key, const std::string& value) {
    const auto k =
        std::find_if(keys.begin(), keys.end(), [&](const auto& x) { return x.named(key); });
    if (k == keys.end()) throw Error(where + "unknown key '" + key + "' (allowed: " + names + ")");
    const SettingText v{where, key, value};
    std::visit(Overloaded{
                   [&](bool S::*field) { s.*field = v.flag(); },
                   [&](comm::Compression S::*field) { s.*field = comm::parse_compression(value); },
                   [&](auto field) {  // a number or an integer
                     using T = std::remove_reference_t<decltype(s.*field)>;
                     s.*field = static_cast<T>(v.number(k->ok, k->expected));
                   },
               },
               k->field);
  });
  return s;
}

/// A gossip or asynchronous algorithm from "name:key=value,...": its settings beside
/// topology=KIND and mixing=uniform|metropolis (a topology that needs more than its kind, torus
/// and edge_list, comes from a job file's [topology]).
JobAlgorithm parse_gossip_argument(const std::string& text, const std::string& head) {
  const std::string where = "--algorithm " + text + ": ";
  const bool decentralized = head == "decentralized";
  const bool choco = head == "low_precision_decentralized" || head == "low-precision-decentralized";
  const bool average = head == "async_model_average" || head == "async-model-average";
  std::string names = average ? "" : "topology, mixing, ";
  if (decentralized) names += "exchange, communication_interval";
  if (choco) names += "gamma, block";
  if (average) names += "warmup_steps, sync_interval_ms";
  if (!decentralized && !choco && !average) names += "min_interval_ms";
  comm::TopologySpec topology;
  Decentralized d;
  LowPrecisionDecentralized l;
  AsyncModelAverage m;
  AsyncGossip g;
  const auto integer = [](double x) { return x == std::floor(x) && std::abs(x) < 1e9; };
  read_settings(text, head, names, [&](const std::string& key, const std::string& value) {
    const SettingText v{where, key, value};
    if (!average && key == "topology") {
      topology.kind = comm::parse_topology_kind(value);
      if (topology.kind == comm::TopologyKind::torus ||
          topology.kind == comm::TopologyKind::edge_list)
        throw Error(where + "topology = '" + value +
                    "' needs more than its kind (rows and "
                    "cols, or edges): give it in a job file's [topology] (troupe run / --job)");
    } else if (!average && key == "mixing") {
      topology.mixing = comm::parse_mixing(value);
    } else if (decentralized && key == "exchange") {
      if (value != "overlap" && value != "after_step")
        throw Error(where + "exchange = '" + value + "', expected overlap or after_step");
      d.exchange = value == "overlap" ? Decentralized::Exchange::overlap
                                      : Decentralized::Exchange::after_step;
    } else if (decentralized && key == "communication_interval") {
      d.communication_interval = static_cast<int>(
          v.number([&](double x) { return integer(x) && x >= 1; }, "an integer >= 1"));
    } else if (choco && key == "gamma") {
      l.gamma = v.number([](double x) { return x > 0 && x <= 1; }, "a number in (0, 1]");
    } else if (choco && key == "block") {
      l.block = static_cast<int>(
          v.number([&](double x) { return integer(x) && x >= 1; }, "an integer >= 1"));
    } else if (average && key == "warmup_steps") {
      m.warmup_steps = static_cast<int>(
          v.number([&](double x) { return integer(x) && x >= 0; }, "an integer >= 0"));
    } else if (average && key == "sync_interval_ms") {
      m.sync_interval_ms = static_cast<int>(
          v.number([&](double x) { return integer(x) && x >= 1; }, "an integer >= 1"));
    } else if (!decentralized && !choco && !average && key == "min_interval_ms") {
      g.min_interval_ms = static_cast<int>(
          v.number([&](double x) { return integer(x) && x >= 0; }, "an integer >= 0"));
    } else {
      throw Error(where + "unknown key '" + key + "' (allowed: " + names + ")");
    }
  });
  if (decentralized) {
    d.topology = topology;
    return d;
  }
  if (choco) {
    l.topology = topology;
    return l;
  }
  if (average) return m;
  g.topology = topology;
  return g;
}

}  // namespace

JobAlgorithm parse_algorithm_argument(const std::string& text) {
  const std::string head = text.substr(0, text.find(':'));
  const std::string where = "--algorithm " + text + ": ";
  if (head == "decentralized" || head == "low_precision_decentralized" ||
      head == "low-precision-decentralized" || head == "async_model_average" ||
      head == "async-model-average" || head == "async_gossip" || head == "async-gossip")
    return parse_gossip_argument(text, head);
  if (head == "diloco") return parse_local_update(text, head, diloco_keys());
  if (head == "sparseloco") return parse_local_update(text, head, sparseloco_keys());
  if (head == "streaming-diloco" || head == "streaming_diloco") {
    const auto d = parse_local_update(text, head, streaming_diloco_keys());
    const std::string h = "h = " + std::to_string(d.inner_steps);
    if (d.fragments > d.inner_steps)
      throw Error(where + "fragments = " + std::to_string(d.fragments) +
                  ", expected an integer in [1, h] (" + h + ")");
    const int most = d.inner_steps / d.fragments;
    if (d.delay > most)
      throw Error(where + "delay = " + std::to_string(d.delay) + ", expected an integer in [0, " +
                  std::to_string(most) + "] (h / fragments: one fragment in flight at a time)");
    return d;
  }
  return comm::parse_compression(text);
}

bool tolerates_dead_ranks(const JobAlgorithm& algorithm) {
  return std::holds_alternative<Decentralized>(algorithm) ||
         std::holds_alternative<LowPrecisionDecentralized>(algorithm) ||
         std::holds_alternative<AsyncGossip>(algorithm);
}

JobConfig load_job_config(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error(path + ": cannot read the job file (it is a directory)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot read the job file (" + std::strerror(errno) + ")");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error(path + ": cannot read the job file (" + std::strerror(errno) + ")");
  return parse_job_config(text, path);
}

}  // namespace troupe
