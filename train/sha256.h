// SHA-256 (FIPS 180-4), for the checksums in corpus manifests. Small and dependency-free; not constant
// time and not meant for secrets.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace oryx {

// Incremental hasher: Update() any number of times, then HexDigest() or Digest() once.
class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t size);
  void Update(std::string_view bytes) { Update(bytes.data(), bytes.size()); }
  std::array<uint8_t, 32> Digest();  // finalises; the hasher must not be updated afterwards
  std::string HexDigest();           // 64 lowercase hex digits; finalises

 private:
  void Block(const uint8_t* block);

  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

// The hex SHA-256 of `bytes`.
std::string Sha256Hex(std::string_view bytes);

}  // namespace oryx
