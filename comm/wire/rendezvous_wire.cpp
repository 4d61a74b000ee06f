#include "comm/wire/rendezvous_wire.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "comm/status.h"

namespace troupe::actors::wire {

namespace {

// OpenSSL writes to the socket with write(2) — inside SSL_read too, where TLS 1.3 answers what
// the peer sent — and write(2) to a socket whose peer has closed raises SIGPIPE, whose default
// action ends the process (seen: a rank's directory thread killed the test binary when rank 0
// closed). While an SSL call runs, SIGPIPE is blocked for the calling thread, and one that the
// call raised is taken back before the mask is restored; the call then sees EPIPE and reports a
// closed connection. A SIGPIPE already pending before the call is left alone.
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &before_);
  }
  ~SigpipeBlocked() {
    if (!was_pending_) {
      const timespec now{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &now) == SIGPIPE) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &before_, nullptr);
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  sigset_t pipe_;
  sigset_t before_;
  bool was_pending_ = false;
};

}  // namespace

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw comm::Error(std::string("getrandom failed: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

std::string random_secret(size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : random_bytes(n)) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string mac(const std::string& secret, const char* role, const std::string& a,
                const std::string& b) {
  const std::string data = std::string(role) + a + b;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
            reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len))
    throw comm::Error("HMAC-SHA256 failed (OpenSSL)");
  return std::string(reinterpret_cast<const char*>(out), len);
}

std::string job_key(const std::string& secret, const std::string& job_id) {
  return job_id.empty() ? secret : mac(secret, "job", job_id, "");
}

bool same_mac(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string frame(Frame type, const std::string& body) {
  std::string out(kFrameHeaderBytes, '\0');
  const auto n = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out[4] = static_cast<char>(type);
  return out + body;
}

Writer& Writer::i32(int32_t v) {
  const auto u = static_cast<uint32_t>(v);
  for (int i = 0; i < 4; ++i) bytes_ += static_cast<char>((u >> (8 * i)) & 0xff);
  return *this;
}

Writer& Writer::u8(uint8_t v) {
  bytes_ += static_cast<char>(v);
  return *this;
}

Writer& Writer::str(const std::string& s) {
  i32(static_cast<int32_t>(s.size()));
  bytes_ += s;
  return *this;
}

Writer& Writer::strs(const std::vector<std::string>& v) {
  i32(static_cast<int32_t>(v.size()));
  for (const auto& s : v) str(s);
  return *this;
}

void Reader::need(size_t n) const {
  if (body_.size() - at_ < n)
    throw comm::Error(what_ + ": the frame ends early (" + std::to_string(body_.size()) +
                      " bytes)");
}

int32_t Reader::i32() {
  need(4);
  uint32_t u = 0;
  for (int i = 0; i < 4; ++i)
    u |= static_cast<uint32_t>(static_cast<unsigned char>(body_[at_ + i])) << (8 * i);
  at_ += 4;
  return static_cast<int32_t>(u);
}

uint8_t Reader::u8() {
  need(1);
  return static_cast<uint8_t>(body_[at_++]);
}

std::string Reader::str(size_t max) {
  const int32_t n = i32();
  if (n < 0 || static_cast<size_t>(n) > max)
    throw comm::Error(what_ + ": a field of " + std::to_string(n) + " bytes (expected 0.." +
                      std::to_string(max) + ")");
  need(static_cast<size_t>(n));
  std::string s = body_.substr(at_, static_cast<size_t>(n));
  at_ += static_cast<size_t>(n);
  return s;
}

std::vector<std::string> Reader::strs(size_t max_count, size_t max_each) {
  const int32_t n = i32();
  if (n < 0 || static_cast<size_t>(n) > max_count)
    throw comm::Error(what_ + ": a list of " + std::to_string(n) + " entries (expected 0.." +
                      std::to_string(max_count) + ")");
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) out.push_back(str(max_each));
  return out;
}

void Reader::done() const {
  if (at_ != body_.size())
    throw comm::Error(what_ + ": " + std::to_string(body_.size() - at_) +
                      " unexpected bytes at the end of the frame");
}

std::shared_ptr<ssl_ctx_st> tls_context(const TlsFiles& files, bool server) {
  auto openssl_error = [] {
    char buf[256] = {};
    ERR_error_string_n(ERR_get_error(), buf, sizeof(buf));
    return std::string(buf);
  };
  std::shared_ptr<ssl_ctx_st> ctx(SSL_CTX_new(server ? TLS_server_method() : TLS_client_method()),
                                  SSL_CTX_free);
  if (!ctx) throw comm::Error("cannot make a TLS context: " + openssl_error());
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_3_VERSION);
  auto fail = [&](const char* variable, const std::string& file, const char* expected) {
    return comm::Error(std::string(variable) + "='" + file +
                       "' cannot be used: " + openssl_error() + " (expected " + expected + ")");
  };
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), files.cert.c_str()) != 1)
    throw fail("TROUPE_TLS_CERT", files.cert, "a PEM certificate file");
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), files.key.c_str(), SSL_FILETYPE_PEM) != 1)
    throw fail("TROUPE_TLS_KEY", files.key, "a PEM private key file without a passphrase");
  if (SSL_CTX_check_private_key(ctx.get()) != 1)
    throw fail("TROUPE_TLS_KEY", files.key, "the key of the certificate in TROUPE_TLS_CERT");
  if (SSL_CTX_load_verify_locations(ctx.get(), files.ca.c_str(), nullptr) != 1)
    throw fail("TROUPE_TLS_CA", files.ca,
               "a PEM file of the authority that signs the ranks' certificates");
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  return ctx;
}

Stream::Stream(int fd, const std::shared_ptr<ssl_ctx_st>& context) : fd_(fd), context_(context) {
  if (!context_) return;
  ssl_ = SSL_new(context_.get());
  if (!ssl_ || SSL_set_fd(ssl_, fd) != 1) throw comm::Error("cannot make a TLS session");
}

Stream::~Stream() {
  if (ssl_) SSL_free(ssl_);
  ::close(fd_);
}

Stream::Io Stream::result(int r, bool reading) {
  if (r > 0) return Io::done;
  const int e = SSL_get_error(ssl_, r);
  if (e == SSL_ERROR_WANT_READ) return Io::want_read;
  if (e == SSL_ERROR_WANT_WRITE) return Io::want_write;
  if (e == SSL_ERROR_ZERO_RETURN) return Io::closed;
  if (e == SSL_ERROR_SYSCALL && reading && errno == 0) return Io::closed;
  char buf[256] = {};
  const unsigned long code = ERR_get_error();
  if (code) ERR_error_string_n(code, buf, sizeof(buf));
  error_ = std::string("OpenSSL: ") + (code ? buf : std::strerror(errno));
  const long verify = SSL_get_verify_result(ssl_);
  if (verify != X509_V_OK)
    error_ +=
        std::string(" (the peer's certificate: ") + X509_verify_cert_error_string(verify) + ")";
  ERR_clear_error();
  return Io::failed;
}

Stream::Io Stream::handshake() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!ssl_) return Io::done;
  ERR_clear_error();
  errno = 0;
  SigpipeBlocked no_sigpipe;
  return result(SSL_is_server(ssl_) ? SSL_accept(ssl_) : SSL_connect(ssl_), true);
}

Stream::Io Stream::read_some(void* data, size_t n, size_t& moved) {
  std::lock_guard<std::mutex> lock(mutex_);
  moved = 0;
  if (ssl_) {
    ERR_clear_error();
    errno = 0;
    SigpipeBlocked no_sigpipe;
    const int r = SSL_read(ssl_, data, static_cast<int>(std::min<size_t>(n, 1 << 30)));
    if (r > 0) moved = static_cast<size_t>(r);
    return result(r, true);
  }
  while (true) {
    const ssize_t r = ::recv(fd_, data, n, MSG_DONTWAIT);
    if (r > 0) {
      moved = static_cast<size_t>(r);
      return Io::done;
    }
    if (r == 0) return Io::closed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Io::want_read;
    error_ = std::strerror(errno);
    return Io::failed;
  }
}

Stream::Io Stream::write_some(const void* data, size_t n, size_t& moved) {
  std::lock_guard<std::mutex> lock(mutex_);
  moved = 0;
  if (ssl_) {
    ERR_clear_error();
    errno = 0;
    SigpipeBlocked no_sigpipe;
    const int r = SSL_write(ssl_, data, static_cast<int>(std::min<size_t>(n, 1 << 30)));
    if (r > 0) moved = static_cast<size_t>(r);
    return result(r, false);
  }
  while (true) {
    const ssize_t r = ::send(fd_, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r >= 0) {
      moved = static_cast<size_t>(r);
      return Io::done;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Io::want_write;
    error_ = std::strerror(errno);
    return errno == EPIPE || errno == ECONNRESET ? Io::closed : Io::failed;
  }
}

bool Stream::buffered() {
  std::lock_guard<std::mutex> lock(mutex_);
  return ssl_ && SSL_pending(ssl_) > 0;
}

std::string Stream::error() {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void Stream::shutdown() { ::shutdown(fd_, SHUT_RDWR); }

namespace {
// Waits until `fd` is ready for `events` or the deadline passes.
void wait_ready(int fd, short events, Clock::time_point deadline, const std::string& what) {
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) throw comm::Error(what + ": timed out");
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
    if (r > 0) return;
    if (r < 0 && errno != EINTR) throw comm::Error(what + ": poll: " + std::strerror(errno));
  }
}

// Waits as `io` asks, or throws for a closed or failed stream.
void wait_for(Stream& s, Stream::Io io, Clock::time_point deadline, const std::string& what) {
  switch (io) {
    case Stream::Io::want_read:
      if (!s.buffered()) wait_ready(s.fd(), POLLIN, deadline, what);
      return;
    case Stream::Io::want_write:
      wait_ready(s.fd(), POLLOUT, deadline, what);
      return;
    case Stream::Io::closed:
      throw comm::Error(what + ": the connection was closed");
    case Stream::Io::failed:
      throw comm::Error(what + ": " + s.error());
    case Stream::Io::done:
      return;
  }
}
}  // namespace

void tls_handshake(Stream& s, Clock::time_point deadline, const std::string& what) {
  for (auto io = s.handshake(); io != Stream::Io::done; io = s.handshake())
    wait_for(s, io, deadline, what);
}

void send_all(Stream& s, const void* data, size_t n, Clock::time_point deadline,
              const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    size_t moved = 0;
    const auto io = s.write_some(p, n, moved);
    p += moved;
    n -= moved;
    if (io != Stream::Io::done) wait_for(s, io, deadline, what);
  }
}

void recv_exact(Stream& s, void* data, size_t n, Clock::time_point deadline,
                const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    size_t moved = 0;
    const auto io = s.read_some(p, n, moved);
    p += moved;
    n -= moved;
    if (io != Stream::Io::done) wait_for(s, io, deadline, what);
  }
}

std::pair<Frame, std::string> recv_frame(Stream& s, uint32_t max_body, Clock::time_point deadline,
                                         const std::string& what) {
  unsigned char header[kFrameHeaderBytes];
  recv_exact(s, header, sizeof(header), deadline, what);
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(header[i]) << (8 * i);
  if (n > max_body)
    throw comm::Error(what + ": a frame of " + std::to_string(n) + " bytes (expected at most " +
                      std::to_string(max_body) + ")");
  std::string body(n, '\0');
  recv_exact(s, body.data(), n, deadline, what);
  return {static_cast<Frame>(header[4]), std::move(body)};
}

std::string resolve_ipv4(const std::string& host, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || !found)
    throw comm::Error(what + " '" + host + "' does not resolve to an IPv4 address (" +
                      gai_strerror(rc) + ")");
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr, buf, sizeof(buf));
  ::freeaddrinfo(found);
  return buf;
}

}  // namespace troupe::actors::wire
