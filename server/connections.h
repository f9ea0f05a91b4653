// The connection layer under the HTTP server (cpp-httplib): a cap of connections per client address, held
// before a connection's first byte is read. It works on the accepted sockets, which httplib's handlers do not
// see.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "httplib.h"
#include "server/metrics.h"

namespace oryx::server {

// httplib::Server as the door of another server. It listens and accepts; each connection it lets in is served
// by `serving` (an httplib Server or SSLServer that holds the routes and settings and never listens itself)
// on the thread the gate runs it on. A connection from an address that holds `max_per_client` already is
// refused without being read: answered 429 and closed (plain HTTP), or closed (TLS: nothing readable can be
// sent before a handshake, which a slow client could stall). The gate's own read and write timeouts set those
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

}  // namespace oryx::server
