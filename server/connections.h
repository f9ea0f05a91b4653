// The connection layer under the HTTP server (cpp-httplib): a cap of connections per client address, held
// before a connection's first byte is read, and a watch that tells when the client of a waiting request has
// gone. Both work on the accepted sockets, which httplib's handlers do not see.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "httplib.h"
#include "server/metrics.h"

namespace oryx::server {

// httplib::Server as the door of another server. It listens and accepts; each connection it lets in is served
// by `serving` (an httplib Server or SSLServer that holds the routes and settings and never listens itself)
// on the thread the gate runs it on. A connection from an address that holds `max_per_client` already is
// refused without being read: answered 429 and closed (plain HTTP), or closed (TLS: nothing readable can be
// sent before a handshake, which a slow client could stall). What the client has sent by then is read and
// dropped, so that the close does not reset the connection; a client whose request comes after the close
// sees a reset instead of the 429 (either says: retry later). The gate's own read and write timeouts set those
// of the accepted sockets (SO_RCVTIMEO, SO_SNDTIMEO); give it the serving server's.
class GateServer : public httplib::Server {
 public:
  // `log`: one line on stderr when an address is first refused (none again until it holds no connection).
  GateServer(httplib::Server& serving, int max_per_client, bool tls, bool log);

  // The serving server runs its connection loops while its listening socket is valid (httplib's test for
  // "not stopped"): Open gives it the gate's after binding; Close, before stop(), ends its kept-alive
  // connections and streams as stop() would.
  void OpenServing();
  void CloseServing();

  ConnectionStats stats() const;
  int max_per_client() const { return max_per_client_; }
  // The connection being served on the calling thread: a handler's own (INVALID_SOCKET elsewhere).
  static socket_t CurrentConnection();

 private:
  bool process_and_close_socket(socket_t sock) override;
  // Counts a connection from `address`; false, counting nothing, when the address holds the cap already.
  bool Enter(const std::string& address);
  void Leave(const std::string& address);
  void Refuse(socket_t sock, const std::string& address) const;

  httplib::Server& serving_;
  const int max_per_client_;
  const bool tls_, log_;
  mutable std::mutex mu_;
  struct Client {
    int open = 0;
    bool refused = false;  // one of its connections was refused (logged once)
  };
  std::map<std::string, Client> clients_;  // guarded by mu_: the addresses that hold connections
  int64_t open_ = 0, refused_ = 0;         // guarded by mu_
};

// Watches the sockets of waiting requests on a thread of its own (epoll): when a client closes its connection
// or resets it, its callback runs. Bytes it sends (a pipelined next request, a TLS alert) are not a close; a
// client that shuts down only its sending side is taken to have gone, as nginx takes it (EPOLLRDHUP).
// Thread-safe.
class DisconnectWatch {
 public:
  DisconnectWatch();
  ~DisconnectWatch();  // stops the thread; every Watching must be gone by then
  DisconnectWatch(const DisconnectWatch&) = delete;
  DisconnectWatch& operator=(const DisconnectWatch&) = delete;

  // While it lives, `gone` is called once, on the watch's thread, if the client goes (at once if it has gone
  // already). Drop it before the socket is closed. It should return quickly.
  class Watching {
   public:
    Watching() = default;
    Watching(Watching&& other) noexcept : watch_(other.watch_), id_(other.id_) { other.watch_ = nullptr; }
    Watching& operator=(Watching&&) = delete;
    ~Watching();

   private:
    friend class DisconnectWatch;
    Watching(DisconnectWatch* watch, uint64_t id) : watch_(watch), id_(id) {}
    DisconnectWatch* watch_ = nullptr;
    uint64_t id_ = 0;
  };
  // An invalid socket (or one epoll does not take) is not watched: `gone` is never called.
  [[nodiscard]] Watching Watch(socket_t connection, std::function<void()> gone);

 private:
  void Loop();
  void Unwatch(uint64_t id);

  int epoll_ = -1, stop_ = -1;  // the epoll instance; an eventfd that ends Loop
  std::mutex mu_;
  struct Watched {
    socket_t socket;
    std::function<void()> gone;
  };
  std::map<uint64_t, Watched> watched_;  // guarded by mu_, by id (from 1: 0 is stop_)
  uint64_t next_id_ = 1;                 // guarded by mu_
  std::thread thread_;
};

}  // namespace oryx::server
