// The tiny corpus that the trainer's end-to-end tests train on: this repository's own sources.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

#include "gtest/gtest.h"
#include "train/corpus.h"

namespace oryx::train {

// Copies the repo's engine/ and tasks/ sources (about 250 KB of C++; ORYX_SOURCE_DIR, which ctest sets)
// to root/text and prepares them into root/corpus, tokenised with vocab 512, 15% for validation. Returns
// the corpus directory.
inline std::string PrepareSourceCorpus(const std::string& root) {
  namespace fs = std::filesystem;
  const char* src = std::getenv("ORYX_SOURCE_DIR");
  EXPECT_NE(src, nullptr) << "ORYX_SOURCE_DIR is not set (run through ctest)";
  const std::string text_dir = root + "/text";
  fs::create_directories(text_dir);
  for (const char* sub : {"engine", "tasks"}) {
    fs::copy(fs::path(src) / sub, fs::path(text_dir) / sub, fs::copy_options::recursive);
  }
  PrepareCorpusOptions o;
  o.out_dir = root + "/corpus";
  o.input_dir = text_dir;
  o.vocab_size = 512;
  o.val_fraction = 0.15;
  o.install_packages = false;
  o.progress = false;
  auto summary = PrepareCorpus(o);
  EXPECT_TRUE(summary.ok()) << summary.status();
  return o.out_dir;
}

}  // namespace oryx::train
