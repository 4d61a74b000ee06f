#include "elastic/membership.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "comm/status.h"

namespace troupe::elastic {

namespace {

std::string slots_text(const std::vector<int>& slots) {
  std::string text;
  for (size_t i = 0; i < slots.size(); ++i) text += (i ? ", " : "") + std::to_string(slots[i]);
  return text.empty() ? "none" : text;
}

}  // namespace

Generation close_generation(int number, std::vector<Report> reports,
                            const std::vector<int>& previous, int ended, int min_ranks) {
  Generation g;
  g.number = number;
  std::sort(reports.begin(), reports.end(),
            [](const Report& a, const Report& b) { return a.slot < b.slot; });
  int64_t best = -1;
  int holders = 0;  // members of the previous generation that hold state
  for (size_t i = 0; i < reports.size(); ++i) {
    g.slots.push_back(reports[i].slot);
    if (reports[i].step > best) {
      best = reports[i].step;
      g.source = static_cast<int>(i);
    }
    if (reports[i].step >= 0 && std::count(previous.begin(), previous.end(), reports[i].slot) > 0)
      ++holders;
  }
  g.step = std::max<int64_t>(best, 0);
  const bool first = number == 1;
  const int may_live = static_cast<int>(previous.size()) - ended;
  const bool majority = first || 2 * holders > may_live;
  if (static_cast<int>(g.slots.size()) >= min_ranks && majority && !g.slots.empty()) return g;
  g.error = "generation " + std::to_string(number) + " has no quorum: ranks (launch slots) " +
            slots_text(g.slots) + " reported, " + std::to_string(holders) +
            " of them holding the "
            "state of the " +
            std::to_string(previous.size()) + " ranks before (slots " + slots_text(previous) +
            ", " + std::to_string(ended) +
            " of which ended); expected at "
            "least --min-ranks " +
            std::to_string(min_ranks) + " members" +
            (first ? std::string(")")
                   : " and, holding state, more than half of the ranks before "
                     "that may still live, so that a minority never trains on "
                     "by itself)");
  return g;
}

MembershipServer::MembershipServer(int slots, int min_ranks, std::chrono::milliseconds deadline,
                                   std::ostream& log, int members)
    : min_ranks_(min_ranks),
      members_(members > 0 ? members : slots),
      deadline_(deadline),
      log_(log),
      slots_(static_cast<size_t>(slots)) {
  if (members_ > slots)
    throw comm::Error("membership: " + std::to_string(members) + " members of " +
                      std::to_string(slots) + " slots (expected at most the slots)");
  for (int s = 0; s < members_; ++s) committed_.push_back(s);
  committed_life_.assign(static_cast<size_t>(members_), 1);
}

MembershipServer::~MembershipServer() {
  for (Slot& s : slots_) {
    if (s.fd >= 0) ::close(s.fd);
    if (s.child_fd >= 0) ::close(s.child_fd);
  }
}

int MembershipServer::attach(int slot, bool standby) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  if (s.connected()) gone(slot, "it was started again");
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0)
    throw comm::Error(std::string("membership: socketpair: ") + strerror(errno));
  // Above 2, so that the child's dup2 onto stdin/stdout/stderr never clobbers them.
  for (int& fd : fds)
    if (fd <= 2) {
      const int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
      ::close(fd);
      fd = moved;
    }
  const int life = s.life + 1;
  s = Slot{};
  s.life = life;
  s.standby = standby;
  s.fd = fds[0];
  s.child_fd = fds[1];
  // Messages never block the launcher: a rank that stops reading loses them, not the job.
  fcntl(s.fd, F_SETFL, fcntl(s.fd, F_GETFL) | O_NONBLOCK);
  return s.child_fd;
}

void MembershipServer::attach_remote(int slot, int link, bool standby) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  if (s.connected()) gone(slot, "it was started again");
  const int life = s.life + 1;
  s = Slot{};
  s.life = life;
  s.standby = standby;
  s.link = link;
}

bool MembershipServer::alive(int slot) const {
  const Slot& s = slots_.at(static_cast<size_t>(slot));
  return s.connected() && !s.left;
}

void MembershipServer::on_message(int slot, const std::string& bytes) {
  if (slots_.at(static_cast<size_t>(slot)).link < 0) return;  // ended meanwhile
  handle(slot, bytes);
}

void MembershipServer::on_closed(int slot, const std::string& why) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  if (s.link < 0) return;
  if (s.exit_note.empty()) s.exit_note = why;
  gone(slot, why);
}

bool MembershipServer::short_of_members() const {
  return static_cast<int>(committed_.size()) < members_;
}

bool MembershipServer::standby(int slot) const {
  return slots_.at(static_cast<size_t>(slot)).standby;
}

bool MembershipServer::rank_alive() const {
  for (size_t s = 0; s < slots_.size(); ++s)
    if (alive(static_cast<int>(s)) && !slots_[s].standby && !slots_[s].expelled) return true;
  return false;
}

bool MembershipServer::expelled(int slot) const {
  const Slot& s = slots_.at(static_cast<size_t>(slot));
  return s.connected() && s.expelled;
}

void MembershipServer::set_slot_nodes(std::vector<int> nodes) {
  if (nodes.size() != slots_.size())
    throw comm::Error("membership: nodes of " + std::to_string(nodes.size()) + " slots (expected " +
                      std::to_string(slots_.size()) + ", one per slot)");
  slot_nodes_ = std::move(nodes);
}

std::vector<int> MembershipServer::spares_for(const std::vector<Report>& reports) const {
  auto node = [&](int slot) {
    return slot_nodes_.empty() ? 0 : slot_nodes_[static_cast<size_t>(slot)];
  };
  // Each node's places: the launch's rank slots on it (the first `members_` slots). Its empty
  // places: those minus the members it has in the forming generation.
  std::vector<int> empty;
  auto add = [&](int slot, int count) {
    const size_t n = static_cast<size_t>(node(slot));
    if (empty.size() <= n) empty.resize(n + 1, 0);
    empty[n] += count;
  };
  for (int s = 0; s < members_; ++s) add(s, 1);
  for (const Report& r : reports) add(r.slot, -1);
  std::vector<int> waiting;  // joined spares, in slot order
  for (size_t s = 0; s < slots_.size(); ++s)
    if (slots_[s].joined && slots_[s].standby) {
      waiting.push_back(static_cast<int>(s));
      add(static_cast<int>(s), 0);
    }
  std::vector<int> taken;
  for (int places = members_ - static_cast<int>(reports.size()); places > 0 && !waiting.empty();
       --places) {
    // The spare on the node with the most empty places (the lowest slot among equals).
    auto best = waiting.begin();
    for (auto it = waiting.begin(); it != waiting.end(); ++it)
      if (empty[static_cast<size_t>(node(*it))] > empty[static_cast<size_t>(node(*best))])
        best = it;
    add(*best, -1);
    taken.push_back(*best);
    waiting.erase(best);
  }
  return taken;
}

void MembershipServer::started(int slot) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  if (s.child_fd >= 0) ::close(s.child_fd);
  s.child_fd = -1;
}

void MembershipServer::add_poll_fds(std::vector<pollfd>& fds, std::vector<int>& slots) const {
  for (size_t s = 0; s < slots_.size(); ++s)
    if (slots_[s].fd >= 0) {
      fds.push_back({slots_[s].fd, POLLIN, 0});
      slots.push_back(static_cast<int>(s));
    }
}

void MembershipServer::send(int slot, const std::string& bytes) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.link >= 0) {
    if (remote_send_) remote_send_(s.link, slot, bytes);
    return;
  }
  if (s.fd < 0) return;
  if (::send(s.fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0 && errno != EAGAIN)
    gone(slot, std::string("its membership socket failed: ") + strerror(errno));
}

void MembershipServer::on_readable(int slot) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  std::string buffer(kMaxMessageBytes, '\0');
  for (;;) {
    if (s.fd < 0) return;
    const ssize_t got = ::recv(s.fd, buffer.data(), buffer.size(), MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (got <= 0) {
      gone(slot, s.exit_note.empty() ? "its process ended" : s.exit_note);
      return;
    }
    if (!handle(slot, std::string(buffer.data(), static_cast<size_t>(got)))) return;
  }
}

bool MembershipServer::handle(int slot, const std::string& bytes) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  std::pair<Message, std::vector<std::string>> message;
  try {
    message = decode(bytes, "rank slot " + std::to_string(slot));
  } catch (const comm::Error& e) {
    gone(slot, e.what());
    return false;
  }
  auto& [type, fields] = message;
  try {
    if (type == Message::join && fields.size() == 2) {
      if (fields[1].empty() || fields[1].size() > kMaxHostBytes) {
        gone(slot, "it joined with a host name of " + std::to_string(fields[1].size()) +
                       " bytes (expected 1.." + std::to_string(kMaxHostBytes) + ")");
        return false;
      }
      s.report.slot = slot;
      s.report.step = std::stoll(fields[0]);
      s.host = fields[1];
      s.joined = true;
      if (phase_ == Phase::idle && (!s.standby || short_of_members())) {
        open("rank slot " + std::to_string(slot) +
             (s.report.step < 0 ? " joins" : " asks for a new generation"));
      } else if (phase_ == Phase::joining) {
        maybe_close();
      }  // addressing: it waits for the next generation, opened at commit(); a spare, for one
         // that needs it
    } else if (type == Message::address && fields.size() == 2) {
      if (phase_ != Phase::addressing || std::stoi(fields[0]) != pending_.number) return true;
      if (fields[1].empty() || fields[1].size() > kMaxAddressBytes) {
        gone(slot, "it sent a transport address of " + std::to_string(fields[1].size()) +
                       " bytes (expected 1.." + std::to_string(kMaxAddressBytes) + ")");
        return false;
      }
      s.address = fields[1];
      s.has_address = true;
      const bool all = std::all_of(pending_.slots.begin(), pending_.slots.end(), [&](int m) {
        return slots_[static_cast<size_t>(m)].has_address;
      });
      if (all) commit();
    } else if (type == Message::leave) {
      s.left = true;
      s.joined = false;
    } else {
      gone(slot, "it sent a membership message the service does not expect");
      return false;
    }
  } catch (const std::logic_error& e) {  // a number field that is not one (std::stoll)
    gone(slot, std::string("it sent a malformed membership message: ") + e.what());
    return false;
  }
  return true;
}

void MembershipServer::on_exit(int slot, const std::string& how) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  s.exit_note = how;
  if (s.connected()) gone(slot, how);
}

void MembershipServer::gone(int slot, const std::string& why) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (!s.connected()) return;
  if (s.fd >= 0) ::close(s.fd);
  s.fd = -1;
  s.link = -1;
  s.joined = false;
  if (stopped_) return;
  const bool member = std::count(committed_.begin(), committed_.end(), slot) > 0;
  const std::string what =
      "rank slot " + std::to_string(slot) + " " + (s.left ? "left" : "died (" + why + ")");
  if (phase_ == Phase::addressing &&
      std::count(pending_.slots.begin(), pending_.slots.end(), slot) > 0) {
    fail_pending(what + " while generation " + std::to_string(pending_.number) + " formed");
  } else if (phase_ == Phase::joining) {
    maybe_close();
  } else if (phase_ == Phase::idle && member && !s.left) {
    open(what);
  }
}

void MembershipServer::open(const std::string& why) {
  phase_ = Phase::joining;
  ++number_;
  opened_at_ = Clock::now();
  deadline_at_ = opened_at_ + deadline_;
  log_ << "troupe: elastic: generation " << number_ << " forms: " << why << "\n";
  log_.flush();
  const std::string notice =
      encode(Message::reform,
             {std::to_string(number_), "generation " + std::to_string(number_) + " forms: " + why});
  for (size_t s = 0; s < slots_.size(); ++s)
    if (!slots_[s].joined && !slots_[s].left) send(static_cast<int>(s), notice);
  maybe_close();
}

bool MembershipServer::awaited(int slot) const {
  const Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.joined || s.left || s.expelled) return false;
  // Several nodes: a slot of another node that has not started yet is awaited by the first
  // generation (its node's launcher may connect after this one started its ranks).
  if (s.life == 0)
    return committed_number_ == 0 && std::count(committed_.begin(), committed_.end(), slot) > 0;
  if (!s.connected()) return false;
  // A live member of the generation in force. A process started since (a restart) is not waited
  // for: it joins the next generation, so the survivors go on without waiting for its start-up.
  for (size_t i = 0; i < committed_.size(); ++i)
    if (committed_[i] == slot) return committed_life_[i] == s.life;
  return false;
}

void MembershipServer::maybe_close() {
  if (phase_ != Phase::joining) return;
  bool any = false;  // a member (not a waiting spare) to decide for
  for (size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s].joined && !slots_[s].standby)
      any = true;
    else if (awaited(static_cast<int>(s)))
      return;
  }
  if (any) close();
}

void MembershipServer::close() {
  std::vector<Report> reports;
  for (size_t s = 0; s < slots_.size(); ++s)
    if (slots_[s].joined && !slots_[s].standby) reports.push_back(slots_[s].report);
  // Spares fill the places of the ranks lost, each from the node that lost it when it can; the
  // others wait on.
  for (int s : spares_for(reports)) {
    Slot& spare = slots_[static_cast<size_t>(s)];
    spare.standby = false;
    reports.push_back(spare.report);
    log_ << "troupe: elastic: spare slot " << s << " joins generation " << number_;
    if (!slot_nodes_.empty()) log_ << " (node " << slot_nodes_[static_cast<size_t>(s)] << ")";
    log_ << "\n";
  }
  int ended = 0;
  for (size_t i = 0; i < committed_.size(); ++i) {
    const Slot& m = slots_[static_cast<size_t>(committed_[i])];
    if (m.life != committed_life_[i] || !m.connected()) ++ended;
  }
  pending_ = close_generation(number_, reports, committed_, ended, min_ranks_);
  // Live members that did not join by the deadline are not members any more: they stop.
  for (size_t s = 0; s < slots_.size(); ++s)
    if (awaited(static_cast<int>(s))) {
      slots_[s].expelled = true;
      log_ << "troupe: elastic: rank slot " << s << " did not join generation " << number_
           << " within " << deadline_.count()
           << " ms (--membership-timeout): it forms without "
              "it, and the slot's process is ended once the job is over\n";
      send(static_cast<int>(s),
           encode(Message::stop, {"rank slot " + std::to_string(s) + " did not join generation " +
                                  std::to_string(number_) + " within " +
                                  std::to_string(deadline_.count()) + " ms"}));
    }
  if (!pending_.error.empty()) {
    stopped_ = true;
    stop_reason_ = pending_.error;
    log_ << "troupe: elastic: " << stop_reason_ << "\n";
    log_.flush();
    for (int m : pending_.slots) send(m, encode(Message::stop, {pending_.error}));
    phase_ = Phase::idle;
    deadline_at_ = Clock::time_point::max();
    return;
  }
  phase_ = Phase::addressing;
  deadline_at_ = Clock::now() + deadline_;
  const std::string world = std::to_string(pending_.slots.size());
  for (size_t r = 0; r < pending_.slots.size(); ++r) {
    Slot& s = slots_[static_cast<size_t>(pending_.slots[r])];
    s.joined = false;
    s.has_address = false;
    send(pending_.slots[r],
         encode(Message::assign, {std::to_string(pending_.number), std::to_string(r), world,
                                  std::to_string(pending_.source), std::to_string(pending_.step),
                                  std::to_string(members_)}));
  }
}

void MembershipServer::fail_pending(const std::string& why) {
  phase_ = Phase::idle;
  open(why);
}

void MembershipServer::commit() {
  std::vector<std::string> hosts, addresses;
  for (int m : pending_.slots) {
    hosts.push_back(slots_[static_cast<size_t>(m)].host);
    addresses.push_back(slots_[static_cast<size_t>(m)].address);
  }
  std::vector<std::string> fields = {std::to_string(pending_.number)};
  for (size_t r = 0; r < hosts.size(); ++r) {
    fields.push_back(hosts[r]);
    fields.push_back(addresses[r]);
  }
  const std::string table = encode(Message::table, fields);
  for (int m : pending_.slots) send(m, table);
  committed_ = pending_.slots;
  committed_life_.clear();
  for (int m : committed_) committed_life_.push_back(slots_[static_cast<size_t>(m)].life);
  committed_number_ = pending_.number;
  phase_ = Phase::idle;
  deadline_at_ = Clock::time_point::max();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - opened_at_);
  log_ << "troupe: elastic: generation " << committed_number_ << " in force after " << ms.count()
       << " ms: " << committed_.size() << " ranks (launch slots " << slots_text(committed_)
       << "), continuing from step " << pending_.step << " (state from slot "
       << pending_.slots[static_cast<size_t>(pending_.source)] << ")\n";
  log_.flush();
  for (size_t s = 0; s < slots_.size(); ++s)
    if (slots_[s].joined && (!slots_[s].standby || short_of_members())) {
      open("rank slot " + std::to_string(s) + " joins");
      return;
    }
}

void MembershipServer::tick() {
  if (Clock::now() < deadline_at_) return;
  if (phase_ == Phase::joining) {
    const bool any = std::any_of(slots_.begin(), slots_.end(),
                                 [](const Slot& s) { return s.joined && !s.standby; });
    if (any) {
      close();
    } else {
      deadline_at_ = Clock::now() + deadline_;  // nobody to decide for yet
    }
  } else if (phase_ == Phase::addressing) {
    std::vector<int> missing;
    for (int m : pending_.slots)
      if (!slots_[static_cast<size_t>(m)].has_address) missing.push_back(m);
    fail_pending("slots " + slots_text(missing) + " sent no transport address within " +
                 std::to_string(deadline_.count()) + " ms");
  }
}

Clock::time_point MembershipServer::next_deadline() const { return deadline_at_; }

}  // namespace troupe::elastic
