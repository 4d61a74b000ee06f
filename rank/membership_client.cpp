#include "rank/membership_client.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "comm/status.h"

namespace troupe::elastic {

namespace {
// Beyond the service's own deadlines: its messages travel through a launcher or two.
constexpr std::chrono::seconds kServiceSlack{5};
}  // namespace

MembershipClient::MembershipClient(int fd, std::function<void(int, const std::string&)> on_change)
    : fd_(fd), on_change_(std::move(on_change)) {
  if (const char* round = std::getenv("TROUPE_MEMBERSHIP_TIMEOUT_MS")) {
    try {
      service_round_ = std::chrono::milliseconds(std::max(0LL, std::stoll(round)));
    } catch (const std::logic_error&) {
      throw comm::Error(std::string("TROUPE_MEMBERSHIP_TIMEOUT_MS='") + round +
                        "' (expected milliseconds, as troupe launch --elastic sets it)");
    }
  }
  reader_ = std::thread([this] { read_loop(); });
}

MembershipClient::~MembershipClient() {
  ::shutdown(fd_, SHUT_RDWR);  // wakes the reader
  if (reader_.joinable()) reader_.join();
  ::close(fd_);
}

void MembershipClient::read_loop() {
  std::string buffer(kMaxMessageBytes, '\0');
  for (;;) {
    const ssize_t got = ::recv(fd_, buffer.data(), buffer.size(), 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const std::string why =
          got == 0 ? "the elastic membership service closed its socket (the "
                     "launcher ended)"
                   : std::string("the elastic membership socket failed: ") + strerror(errno);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        closed_ = why;
      }
      arrived_.notify_all();
      if (on_change_) on_change_(-1, why);
      return;
    }
    std::pair<Message, std::vector<std::string>> message;
    try {
      message = decode(std::string(buffer.data(), static_cast<size_t>(got)), "membership service");
    } catch (const comm::Error&) {
      continue;  // the launcher is ours: a malformed message is a bug, dropped rather than fatal
    }
    int notice = 0;
    std::string why;
    if (message.first == Message::reform && message.second.size() == 2) {
      notice = std::stoi(message.second[0]);
      why = message.second[1];
    } else if (message.first == Message::stop && !message.second.empty()) {
      notice = -1;
      why = message.second[0];
    }
    bool newer = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      newer = notice < 0 || notice > in_force_;
      queue_.push_back(std::move(message));
    }
    arrived_.notify_all();
    if (notice != 0 && newer && on_change_) on_change_(notice, why);
  }
}

void MembershipClient::send(const std::string& bytes) {
  if (::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0)
    throw comm::Error(std::string("cannot reach the elastic membership service: ") +
                      strerror(errno) + " (expected the launcher of `troupe launch --elastic`)");
}

std::pair<Message, std::vector<std::string>> MembershipClient::next(
    Clock::time_point deadline, const std::string& waiting_for) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!arrived_.wait_until(lock, deadline, [&] { return !queue_.empty() || !closed_.empty(); }))
    throw comm::Error("elastic membership: timed out waiting for " + waiting_for);
  if (queue_.empty())
    throw comm::Error("elastic membership: " + closed_ + " while waiting for " + waiting_for);
  auto message = std::move(queue_.front());
  queue_.pop_front();
  if (message.first == Message::stop)
    throw comm::Error("elastic membership: the job stops: " +
                      (message.second.empty() ? std::string("no reason") : message.second[0]));
  return message;
}

Assignment MembershipClient::join(int64_t step, const std::string& host,
                                  Clock::time_point deadline) {
  send(encode(Message::join, {std::to_string(step), host}));
  // The service may wait a round for the members that have not joined, then a round for the
  // addresses of a generation that fails and re-forms: this wait outlasts both.
  if (service_round_.count() > 0)
    deadline = std::max(deadline, Clock::now() + 2 * service_round_ + kServiceSlack);
  for (;;) {
    auto [type, fields] = next(deadline, "this rank's assignment in a new generation");
    if (type != Message::assign || fields.size() != 6) continue;  // notices already acted on
    Assignment a;
    a.generation = std::stoi(fields[0]);
    a.rank = std::stoi(fields[1]);
    a.world_size = std::stoi(fields[2]);
    a.source = std::stoi(fields[3]);
    a.step = std::stoll(fields[4]);
    a.ranks = std::stoi(fields[5]);
    std::lock_guard<std::mutex> lock(mutex_);
    assigned_world_ = a.world_size;
    return a;
  }
}

void MembershipClient::check_table(const MemberTable& table, int generation,
                                   const std::string& own) const {
  const std::string where =
      "elastic membership: the peer table of generation " + std::to_string(generation) + " ";
  int world = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    world = assigned_world_;
  }
  if (static_cast<int>(table.addresses.size()) != world)
    throw comm::Error(where + "holds " + std::to_string(table.addresses.size()) +
                      " ranks (expected the " + std::to_string(world) +
                      " of this rank's "
                      "assignment)");
  auto hex = [](char c) {
    const char* digits = "0123456789abcdef";
    const auto b = static_cast<unsigned char>(c);
    return std::string("0x") + digits[b >> 4] + digits[b & 15];
  };
  for (size_t r = 0; r < table.addresses.size(); ++r) {
    const std::string& a = table.addresses[r];
    // UCX trusts the header of an address it unpacks (a wrong version byte aborts the process
    // in ucp_address_unpack): every rank runs this build of UCX, so a peer's header byte (the
    // address version and its flags) must be this rank's own.
    const bool sized = !a.empty() && a.size() <= kMaxAddressBytes;
    if (!sized || own.empty() || a[0] != own[0])
      throw comm::Error(where + "gives rank " + std::to_string(r) + " (host '" +
                        table.hosts[r].substr(0, kMaxHostBytes) + "') a transport address of " +
                        std::to_string(a.size()) + " bytes" +
                        (a.empty() ? std::string() : " with header byte " + hex(a[0])) +
                        " (expected a UCX worker address of 1.." +
                        std::to_string(kMaxAddressBytes) + " bytes with header byte " +
                        (own.empty() ? std::string("?") : hex(own[0])) +
                        ", as this rank's own); refused before UCX sees it");
  }
}

std::optional<MemberTable> MembershipClient::exchange(int generation, const std::string& address,
                                                      Clock::time_point deadline) {
  send(encode(Message::address, {std::to_string(generation), address}));
  if (service_round_.count() > 0)
    deadline = std::max(deadline, Clock::now() + service_round_ + kServiceSlack);
  for (;;) {
    auto [type, fields] =
        next(deadline, "the peer table of generation " + std::to_string(generation));
    if (type == Message::reform && !fields.empty() && std::stoi(fields[0]) > generation)
      return std::nullopt;
    if (type != Message::table || fields.empty() || std::stoi(fields[0]) != generation) continue;
    MemberTable table;
    for (size_t i = 1; i + 1 < fields.size(); i += 2) {
      table.hosts.push_back(fields[i]);
      table.addresses.push_back(fields[i + 1]);
    }
    check_table(table, generation, address);
    std::lock_guard<std::mutex> lock(mutex_);
    in_force_ = generation;
    return table;
  }
}

int MembershipClient::generation() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_force_;
}

void MembershipClient::leave() {
  try {
    send(encode(Message::leave, {}));
  } catch (const comm::Error&) {
    // The launcher is gone: there is nobody to tell.
  }
}

}  // namespace troupe::elastic
