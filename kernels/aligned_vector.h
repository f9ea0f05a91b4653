// Float buffers on 64-byte boundaries, for every buffer a CPU kernel reads or writes.
//
// Why it matters for results, not only speed: Eigen's vectorised reductions (sums, max, dot products) peel
// the elements before the first aligned address and then add whole packets, so the order of the additions,
// and with it the last bits of the result, follows the buffer's address modulo the packet size. With
// malloc's 16-byte alignment that address varies with what was allocated before (which differs between a
// sequence and its clone, and between the worker threads' scratch buffers), and the same forward on the
// same state could give different bits. Buffers on 64-byte boundaries (a multiple of every packet: SSE,
// AVX, AVX-512) make every offset's alignment a function of the offset alone, so a forward's result depends
// only on its inputs and the batch's shape, never on allocation or thread timing.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace oryx::kernels {

template <typename T>
struct AlignedAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};

  AlignedAllocator() noexcept = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor)

  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, std::size_t n) noexcept { ::operator delete(p, n * sizeof(T), kAlignment); }

  template <typename U>
  bool operator==(const AlignedAllocator<U>&) const noexcept {
    return true;
  }
};

template <typename T>
using AlignedVector = std::vector<T, AlignedAllocator<T>>;

}  // namespace oryx::kernels
