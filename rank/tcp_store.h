#pragma once
/// TcpStore: a client of a c10d TCPStore, the key-value store torchrun's agent runs. Under
/// torchrun's default (static) rendezvous the agent already listens on MASTER_PORT with one
/// (TORCHELASTIC_USE_AGENT_STORE=True), so troupe's directory cannot: rank 0 publishes it on a
/// free port and writes that port into the agent's store, where the other ranks read it
/// (rank/runtime.cpp). The client is LibTorch's own c10d::TCPStore, so it speaks the wire
/// protocol of the LibTorch troupe is built with; a torchrun from a torch with another protocol
/// is not supported.
#include <chrono>
#include <memory>
#include <string>

namespace c10d {
class TCPStore;
}

namespace troupe {

/// A connection to the c10d TCPStore at host:port. Every call has a deadline; every error names
/// the host, the port and, for a key's value, the key.
class TcpStore {
 public:
  /// Connects, retrying until `timeout` (the server may not be up yet). Throws comm::Error naming
  /// host:port and the timeout when it cannot; also when port is not in 1..65535 or timeout <= 0.
  TcpStore(std::string host, int port, std::chrono::milliseconds timeout);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  /// Sets `key` to `value` (binary-safe). Throws comm::Error naming host:port and the key.
  void set(const std::string& key, const std::string& value);
  /// Waits up to `timeout` for `key` to be set, then returns its value. Throws comm::Error naming
  /// host:port, the key and the timeout when it is not set in time, or the connection fails.
  std::string get(const std::string& key, std::chrono::milliseconds timeout);

  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  std::string where() const;

  std::string host_;
  int port_;
  std::unique_ptr<c10d::TCPStore> store_;
};

}  // namespace troupe
