#pragma once
/// The rendezvous wire: the bytes between a rank and rank 0's front door (actors/front_door.h).
///
/// CAF's own network layer (BASP) is never exposed: it allocates whatever size a header claims
/// and has no credential, so any process that reached the port could exhaust rank 0's memory or
/// register as a rank. Instead, every connection starts with a fixed-size mutual handshake that
/// proves both sides hold the job's secret, and only then carries frames, each with a size
/// checked against a cap before anything is allocated:
///
///   rank -> door   hello     magic "TROUPE" 0x01 0x00 (8 bytes), rank nonce (32 bytes)
///   door -> rank   challenge door nonce (32), HMAC-SHA256(secret, "door" | rank nonce | door
///   nonce) rank -> door   proof     HMAC-SHA256(secret, "rank" | door nonce | rank nonce) (32)
///   door -> rank   welcome   one byte, 1
///   then frames    u32 body length (little-endian), u8 type, body
///
/// A door that does not like what it reads (wrong magic or version, a wrong proof, too slow, too
/// many connections from one address) closes the connection without a word: an outsider learns
/// nothing about the job. A rank learns why from where the handshake stopped.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct ssl_st;
struct ssl_ctx_st;

namespace troupe::actors::wire {

using Clock = std::chrono::steady_clock;

inline constexpr char kMagic[8] = {'T', 'R', 'O', 'U', 'P', 'E', 1, 0};
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;
inline constexpr size_t kHelloBytes = sizeof(kMagic) + kNonceBytes;
inline constexpr size_t kChallengeBytes = kNonceBytes + kMacBytes;
inline constexpr size_t kFrameHeaderBytes = 5;

/// The largest frame a rank may send to the door: a registration carries a host name (<= 255),
/// a transport address (a UCX worker address is a few hundred bytes) and rank 0's extra bytes
/// (an NCCL unique id: 128). Anything larger is an attack or a bug, and ends the connection.
inline constexpr uint32_t kMaxRankFrame = 256 * 1024;
inline constexpr size_t kMaxHostBytes = 255;
inline constexpr size_t kMaxAddressBytes = 64 * 1024;
inline constexpr size_t kMaxExtraBytes = 64 * 1024;
inline constexpr size_t kMaxReasonBytes = 4096;

enum class Frame : uint8_t {
  register_rank = 1,  // rank -> door: rank, world size, host, address, extra
  table = 2,          // door -> rank: ok, error, hosts, addresses, extras
  failed = 3,         // rank -> door: reason
  leave = 4,          // rank -> door: nothing
  peer_down = 5,      // door -> rank: rank, reason, fatal
};

/// `n` bytes from the kernel's random source (getrandom). Throws comm::Error when it fails.
std::string random_bytes(size_t n);

/// 2n lowercase hex digits of n random bytes: a fresh job secret.
std::string random_secret(size_t n = 32);

/// HMAC-SHA256(secret, role | a | b).
std::string mac(const std::string& secret, const char* role, const std::string& a,
                const std::string& b);

/// The key of a job's handshakes: HMAC-SHA256(secret, "job" | job id), or the secret itself
/// when the job has no id. Two jobs that share a secret but not an id never accept each other.
std::string job_key(const std::string& secret, const std::string& job_id);

/// Constant-time comparison of two MACs.
bool same_mac(const std::string& a, const std::string& b);

/// A frame's bytes: header and body.
std::string frame(Frame type, const std::string& body);

/// Builds a frame body.
class Writer {
 public:
  Writer& i32(int32_t v);
  Writer& u8(uint8_t v);
  Writer& str(const std::string& s);
  Writer& strs(const std::vector<std::string>& v);
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

/// Reads a frame body; every read checks the bounds and throws comm::Error naming `what` (the
/// frame) when the body is short or a length exceeds `max`.
class Reader {
 public:
  Reader(const std::string& body, std::string what) : body_(body), what_(std::move(what)) {}
  int32_t i32();
  uint8_t u8();
  std::string str(size_t max);
  std::vector<std::string> strs(size_t max_count, size_t max_each);
  /// Throws unless every byte was read.
  void done() const;

 private:
  void need(size_t n) const;
  const std::string& body_;
  std::string what_;
  size_t at_ = 0;
};

/// TLS for the control plane: this rank's certificate and key, and the certificate of the
/// authority that signed every rank's (TROUPE_TLS_CERT, TROUPE_TLS_KEY, TROUPE_TLS_CA, PEM files).
/// With them, each connection to the front door is TLS 1.3 with both sides' certificates checked
/// against the CA, and the handshake above runs inside it. Empty: plain TCP.
struct TlsFiles {
  std::string cert, key, ca;
  bool enabled() const { return !cert.empty(); }
};

/// An OpenSSL context for the door (server) or a rank (client). Throws comm::Error naming the
/// variable and file that cannot be loaded, or a key that does not match its certificate.
std::shared_ptr<ssl_ctx_st> tls_context(const TlsFiles& files, bool server);

/// A connected, non-blocking socket, plain or TLS, which it owns. Its calls are serialised, so one
/// thread may wait to read while another writes.
class Stream {
 public:
  /// `context` null: plain. Else a TLS session of that context (server or client as it was made).
  Stream(int fd, const std::shared_ptr<ssl_ctx_st>& context);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  enum class Io { done, want_read, want_write, closed, failed };
  /// One step of the TLS handshake (done at once when plain).
  Io handshake();
  /// Moves some of `n` bytes (`moved`); done when any moved.
  Io read_some(void* data, size_t n, size_t& moved);
  Io write_some(const void* data, size_t n, size_t& moved);
  /// TLS bytes already taken from the socket and not yet read: poll would not show them.
  bool buffered();
  /// What failed last (OpenSSL's reason, or errno's).
  std::string error();
  /// Ends both directions of the socket (wakes a thread waiting to read), keeping it open.
  void shutdown();
  int fd() const { return fd_; }

 private:
  Io result(int r, bool reading);
  std::mutex mutex_;
  int fd_;
  ssl_st* ssl_ = nullptr;
  std::shared_ptr<ssl_ctx_st> context_;
  std::string error_;
};

/// Blocking I/O on a stream with a deadline (poll). Each throws comm::Error naming `what` on a
/// timeout ("timed out" in the message), an error or, for reads, the peer closing first.
void tls_handshake(Stream& s, Clock::time_point deadline, const std::string& what);
void send_all(Stream& s, const void* data, size_t n, Clock::time_point deadline,
              const std::string& what);
void recv_exact(Stream& s, void* data, size_t n, Clock::time_point deadline,
                const std::string& what);

/// Reads one frame (type and body) whose body may have at most `max_body` bytes.
std::pair<Frame, std::string> recv_frame(Stream& s, uint32_t max_body, Clock::time_point deadline,
                                         const std::string& what);

/// The IPv4 address `host` resolves to ("localhost" and names included), as dotted quad. Throws
/// comm::Error naming `what` and the host when it does not resolve.
std::string resolve_ipv4(const std::string& host, const std::string& what);

}  // namespace troupe::actors::wire
