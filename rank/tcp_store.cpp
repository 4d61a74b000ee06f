#include "rank/tcp_store.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <exception>
#include <utility>
#include <vector>

#include "comm/status.h"

namespace troupe {

namespace {

/// c10d's first line, without the C++ stack trace c10::Error appends.
std::string first_line(const std::exception& e) {
  std::string what = e.what();
  const auto end = what.find('\n');
  return end == std::string::npos ? what : what.substr(0, end);
}

}  // namespace

TcpStore::TcpStore(std::string host, int port, std::chrono::milliseconds timeout)
    : host_(std::move(host)), port_(port) {
  if (port < 1 || port > 65535)
    throw comm::Error("TcpStore: port " + std::to_string(port) + " of host '" + host_ +
                      "' (expected 1..65535)");
  if (timeout.count() <= 0)
    throw comm::Error("TcpStore: timeout " + std::to_string(timeout.count()) + " ms for " +
                      where() + " (expected > 0)");
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = timeout;
  try {
    store_ = std::make_unique<c10d::TCPStore>(host_, options);
  } catch (const std::exception& e) {
    throw comm::Error("cannot reach the TCPStore at " + where() + " within " +
                      std::to_string(timeout.count()) + " ms: " + first_line(e));
  }
}

TcpStore::~TcpStore() = default;

std::string TcpStore::where() const { return host_ + ":" + std::to_string(port_); }

void TcpStore::set(const std::string& key, const std::string& value) {
  try {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  } catch (const std::exception& e) {
    throw comm::Error("cannot set key '" + key + "' in the TCPStore at " + where() + ": " +
                      first_line(e));
  }
}

std::string TcpStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0)
    throw comm::Error("TcpStore::get of key '" + key + "' at " + where() + ": timeout " +
                      std::to_string(timeout.count()) + " ms (expected > 0)");
  try {
    store_->wait({key}, timeout);
  } catch (const std::exception& e) {
    throw comm::Error("key '" + key + "' was not set in the TCPStore at " + where() + " within " +
                      std::to_string(timeout.count()) + " ms: " + first_line(e));
  }
  try {
    auto bytes = store_->get(key);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    throw comm::Error("cannot get key '" + key + "' from the TCPStore at " + where() + ": " +
                      first_line(e));
  }
}

}  // namespace troupe
