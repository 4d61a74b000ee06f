#include "runtime/membership_client.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "comm/status.h"

namespace troupe::elastic {

MembershipClient::MembershipClient(int fd, std::function<void(int, const std::string&)> on_change)
    : fd_(fd), on_change_(std::move(on_change)) {
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
      const std::string why = got == 0 ? "the elastic membership service closed its socket (the "
                                         "launcher ended)"
                                       : std::string("the elastic membership socket failed: ") +
                                             strerror(errno);
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
  if (queue_.empty()) throw comm::Error("elastic membership: " + closed_ + " while waiting for " +
                                        waiting_for);
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
    return a;
  }
}

std::optional<MemberTable> MembershipClient::exchange(int generation, const std::string& address,
                                                      Clock::time_point deadline) {
  send(encode(Message::address, {std::to_string(generation), address}));
  for (;;) {
    auto [type, fields] = next(deadline, "the peer table of generation " +
                                             std::to_string(generation));
    if (type == Message::reform && !fields.empty() && std::stoi(fields[0]) > generation)
      return std::nullopt;
    if (type != Message::table || fields.empty() || std::stoi(fields[0]) != generation) continue;
    MemberTable table;
    for (size_t i = 1; i + 1 < fields.size(); i += 2) {
      table.hosts.push_back(fields[i]);
      table.addresses.push_back(fields[i + 1]);
    }
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
