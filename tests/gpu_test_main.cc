// main() for tests labelled `gpu`: exits 77 (ctest reports "skipped") where no CUDA device is visible.
#include <cstdio>

#include "gtest/gtest.h"
#include "kernels/stream.h"

int main(int argc, char** argv) {
  if (oryx::kernels::cuda::DeviceCount() == 0) {
    std::printf("no CUDA device visible: skipping GPU tests\n");
    return 77;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
