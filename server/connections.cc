#include "server/connections.h"

#include <arpa/inet.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
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
// (its names are not access-checked: [temp.spec.general]); these two are the only ones. A pointer to a virtual
// member calls the object's own override, so the gate could not reach httplib's version through itself: the
// connection goes to a second server object, which has no override.
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

thread_local socket_t current_connection = INVALID_SOCKET;

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

socket_t GateServer::CurrentConnection() { return current_connection; }

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
  current_connection = sock;
  struct Left {
    GateServer& gate;
    const std::string& address;
    ~Left() {
      current_connection = INVALID_SOCKET;
      gate.Leave(address);
    }
  } left{*this, address};
  return (serving_.*Member(ProcessSocket{}))(sock);  // serves it (TLS included) and closes it
}

DisconnectWatch::DisconnectWatch()
    : epoll_(epoll_create1(EPOLL_CLOEXEC)), stop_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = 0;
  if (epoll_ >= 0 && stop_ >= 0) epoll_ctl(epoll_, EPOLL_CTL_ADD, stop_, &e);
  thread_ = std::thread([this] { Loop(); });
}

DisconnectWatch::~DisconnectWatch() {
  const uint64_t one = 1;
  if (stop_ >= 0) (void)write(stop_, &one, sizeof(one));
  thread_.join();
  for (int fd : {epoll_, stop_}) {
    if (fd >= 0) close(fd);
  }
}

void DisconnectWatch::Loop() {
  if (epoll_ < 0 || stop_ < 0) return;  // nothing is watched (Watch checks the same)
  epoll_event events[16];
  for (;;) {
    const int n = epoll_wait(epoll_, events, 16, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;
    for (int i = 0; i < n; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == 0) return;
      std::function<void()> gone;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = watched_.find(id);
        if (it == watched_.end()) continue;                            // unwatched since epoll_wait returned
        epoll_ctl(epoll_, EPOLL_CTL_DEL, it->second.socket, nullptr);  // still open: Unwatch has not run
        gone = std::move(it->second.gone);
        watched_.erase(it);
      }
      gone();
    }
  }
}

DisconnectWatch::Watching DisconnectWatch::Watch(socket_t connection, std::function<void()> gone) {
  if (connection == INVALID_SOCKET || epoll_ < 0 || stop_ < 0) return {};
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  epoll_event e{};
  // EPOLLHUP and EPOLLERR (a reset) come unasked; no EPOLLIN: bytes to read are not a close. One shot: the
  // loop removes it.
  e.events = EPOLLRDHUP | EPOLLONESHOT;
  e.data.u64 = id;
  if (epoll_ctl(epoll_, EPOLL_CTL_ADD, connection, &e) != 0) return {};
  watched_.emplace(id, Watched{connection, std::move(gone)});
  return Watching(this, id);
}

void DisconnectWatch::Unwatch(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = watched_.find(id);
  if (it == watched_.end()) return;  // it fired
  epoll_ctl(epoll_, EPOLL_CTL_DEL, it->second.socket, nullptr);
  watched_.erase(it);
}

DisconnectWatch::Watching::~Watching() {
  if (watch_ != nullptr) watch_->Unwatch(id_);
}

}  // namespace oryx::server
