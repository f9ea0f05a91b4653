#include "server/connections.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>

#include "base/str_cat.h"
#include "engine/json_text.h"
#include "server/completions.h"

namespace oryx::server {

namespace {

// Two members of httplib::Server that the gate needs and httplib does not open to it: process_and_close_socket,
// the private virtual that serves one accepted connection (a subclass may override it, not call it), and
// svr_sock_, the protected listening socket, here another object's. An explicit instantiation may name them
// (its names are not access-checked: [temp.spec.general]); these two are the only ones.
struct ProcessSocket {
  using type = bool (httplib::Server::*)(socket_t);
  friend type Member(ProcessSocket);
};
struct ListeningSocket {
  using type = std::atomic<socket_t> httplib::Server::*;
  friend type Member(ListeningSocket);
};
template <class Tag, typename Tag::type M>
struct Expose {
  friend typename Tag::type Member(Tag) { return M; }
};
template struct Expose<ProcessSocket, &httplib::Server::process_and_close_socket>;
template struct Expose<ListeningSocket, &httplib::Server::svr_sock_>;

// The client's address, an IPv4 one as IPv4 even when it came over an IPv6 socket.
std::string PeerAddress(socket_t sock) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(sock, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char text[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(addr).sin_addr, text, sizeof(text));
  } else if (addr.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6&>(addr).sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      inet_ntop(AF_INET, &a.s6_addr[12], text, sizeof(text));
    } else {
      inet_ntop(AF_INET6, &a, text, sizeof(text));
    }
  } else if (addr.ss_family == AF_UNIX) {
    return "unix";
  }
  return text;
}

}  // namespace

GateServer::GateServer(httplib::Server& serving, int max_per_client, bool tls, bool log)
    : serving_(serving), max_per_client_(max_per_client), tls_(tls), log_(log) {}

void GateServer::OpenServing() { (serving_.*Member(ListeningSocket{})) = svr_sock_.load(); }

void GateServer::CloseServing() { (serving_.*Member(ListeningSocket{})) = INVALID_SOCKET; }

ConnectionStats GateServer::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {open_, refused_};
}

bool GateServer::Enter(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  Client& c = clients_[address];
  if (c.open >= max_per_client_) {
    ++refused_;
    if (log_ && !c.refused) {
      std::fprintf(stderr,
                   "[serve] - 429 %s: %d connections open, the cap per client address (--max-connections-per-client); "
                   "its further ones are refused, without a line, until it holds none\n",
                   address.c_str(), c.open);
    }
    c.refused = true;
    return false;
  }
  ++c.open;
  ++open_;
  return true;
}

void GateServer::Leave(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = clients_.find(address);
  --open_;
  if (--it->second.open == 0) clients_.erase(it);
}

void GateServer::Refuse(socket_t sock, const std::string& address) const {
  if (!tls_) {
    const std::string body = JsonText(ErrorObject(Cat("too many connections from ", address, " (", max_per_client_,
                                                      " at once at most); retry once one has closed"),
                                                  429));
    const std::string reply =
        Cat("HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: ", body.size(),
            "\r\nRetry-After: 1\r\nConnection: close\r\n\r\n", body);
    // A fresh socket's send buffer takes it whole; a client that does not read it loses nothing of ours.
    (void)send(sock, reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  shutdown(sock, SHUT_WR);
  // Closing with unread bytes would reset the connection, and the client could lose the answer: what it has
  // sent so far is read and dropped (without waiting for more).
  char drop[4096];
  for (int i = 0; i < 16 && recv(sock, drop, sizeof(drop), MSG_DONTWAIT) > 0; ++i) {
  }
  close(sock);
}

bool GateServer::process_and_close_socket(socket_t sock) {
  const std::string address = PeerAddress(sock);
  if (!Enter(address)) {
    Refuse(sock, address);
    return false;
  }
  struct Left {
    GateServer& gate;
    const std::string& address;
    ~Left() { gate.Leave(address); }
  } left{*this, address};
  return (serving_.*Member(ProcessSocket{}))(sock);  // serves it (TLS included) and closes it
}

}  // namespace oryx::server
