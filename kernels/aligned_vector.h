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

#include <sys/mman.h>

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

  // Buffers of 2 MiB and more start on a 2 MiB boundary and ask for transparent huge pages, so that streaming
  // through them (weights, KV blocks) walks a page table a 512th as often.
  static constexpr std::size_t kHugePage = std::size_t{2} << 20, kHugeFrom = kHugePage;
  static constexpr std::align_val_t kHugeAlignment{kHugePage};

  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes < kHugeFrom) return static_cast<T*>(::operator new(bytes, kAlignment));
    void* p = ::operator new(bytes, kHugeAlignment);
    ::madvise(p, bytes & ~(kHugePage - 1), MADV_HUGEPAGE);  // a hint: without it, ordinary pages
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    const std::size_t bytes = n * sizeof(T);
    ::operator delete(p, bytes, bytes < kHugeFrom ? kAlignment : kHugeAlignment);
  }

  template <typename U>
  bool operator==(const AlignedAllocator<U>&) const noexcept {
    return true;
  }
};

template <typename T>
using AlignedVector = std::vector<T, AlignedAllocator<T>>;

}  // namespace oryx::kernels
