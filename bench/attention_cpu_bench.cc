// The CPU decode step's attention kernel alone (kernels/cpu/attention.cc, one query): one thread over
// `layers` x `heads` heads of a paged KV cache laid out as the CPU backend lays it out (a block holds every
// layer's keys head by head, its values likewise), with the caches flushed before each pass, so that the
// cache streams from memory as it does in a decode step. Prints one JSON line per (KV type, context): the
// median time of a pass and the bytes of keys and values it read per second.
//
//   bench_attention_cpu [--contexts 1024,4096] [--kv-dtype int8,bf16,f32] [--block-tokens 64] [--passes 9]
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "engine/json_text.h"
#include "kernels/aligned_vector.h"
#include "kernels/ops.h"

namespace {

namespace k = oryx::kernels;

struct Options {
  std::vector<int64_t> contexts = {1024, 4096};
  std::vector<std::string> kv_dtypes = {"int8", "bf16", "f32"};
  int64_t block_tokens = 64;
  int passes = 9;
  // The 130m config's attention: 24 layers of 12 heads of 64.
  int64_t layers = 24, heads = 12, head_dim = 64;
};

k::KvFormat FormatOf(const std::string& name) {
  return name == "int8" ? k::KvFormat::kInt8 : name == "bf16" ? k::KvFormat::kBf16 : k::KvFormat::kF32;
}

// One (KV type, context) point.
nlohmann::json Measure(const Options& o, const std::string& dtype, int64_t context, std::vector<char>& flush) {
  const k::KvFormat format = FormatOf(dtype);
  const int64_t dh = o.head_dim, bt = o.block_tokens, row = k::KvHeadRowElements(format, dh);
  const int64_t blocks = (context + bt - 1) / bt, layer_stride = o.heads * bt * row;
  const int64_t block_bytes = o.layers * layer_stride * k::KvElementBytes(format);
  std::vector<k::AlignedVector<char>> key_blocks, value_blocks;
  std::vector<const void*> keys, values;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> x(dh);
  for (int64_t j = 0; j < blocks; ++j) {
    for (auto* side : {&key_blocks, &value_blocks}) {
      side->emplace_back(block_bytes);
      char* data = side->back().data();
      for (int64_t r = 0; r < o.layers * o.heads * bt; ++r) {  // every row of the block, in its format
        for (float& v : x) v = normal(rng);
        char* at = data + r * row * k::KvElementBytes(format);
        if (format == k::KvFormat::kInt8) {
          k::cpu::QuantizeKvRow(x.data(), dh, reinterpret_cast<int8_t*>(at));
        } else if (format == k::KvFormat::kBf16) {
          k::cpu::RoundToBf16(x.data(), dh, reinterpret_cast<uint16_t*>(at));
        } else {
          std::memcpy(at, x.data(), dh * sizeof(float));
        }
      }
    }
    keys.push_back(key_blocks.back().data());
    values.push_back(value_blocks.back().data());
  }
  std::vector<float> q(o.heads * dh), out(o.heads * dh), scratch(context), widen(bt * dh);
  for (float& v : q) v = normal(rng);
  std::vector<double> seconds;
  for (int pass = 0; pass < o.passes + 1; ++pass) {
    for (size_t i = 0; i < flush.size(); i += 64) ++flush[i];
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t layer = 0; layer < o.layers; ++layer) {
      for (int64_t h = 0; h < o.heads; ++h) {
        k::cpu::Attention({.q_tokens = 1,
                           .kv_tokens = context,
                           .heads = 1,
                           .head_dim = dh,
                           .q_token_stride = o.heads * dh,
                           .kv_token_stride = row,
                           .out_token_stride = o.heads * dh,
                           .q_ptr = q.data() + h * dh,
                           .k_ptr = nullptr,
                           .v_ptr = nullptr,
                           .out_ptr = out.data() + h * dh,
                           .scratch_ptr = scratch.data(),
                           .kv_block_tokens = bt,
                           .k_blocks = keys.data(),
                           .v_blocks = values.data(),
                           .kv_col = layer * layer_stride + h * bt * row,
                           .kv_format = format,
                           .widen_ptr = widen.data()});
      }
    }
    if (pass > 0) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double bytes = 2.0 * o.layers * o.heads * context * row * k::KvElementBytes(format);
  const double median = oryx::bench::Median(seconds);
  return {{"bench", "attention_cpu"},
          {"kv_dtype", dtype},
          {"context", context},
          {"layers", o.layers},
          {"heads", o.heads},
          {"head_dim", dh},
          {"block_tokens", bt},
          {"threads", 1},
          {"passes", o.passes},
          {"kv_bytes", bytes},
          {"ms_per_pass", median * 1e3},
          {"gb_per_s", bytes / median / 1e9}};
}

// "1024,4096" -> its parts (empty on a bad list).
std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ',');) parts.push_back(part);
  return parts;
}

bool ParseArgs(int argc, char** argv, Options* o) {
  auto fail = [](const std::string& why) {
    std::cerr << "bench_attention_cpu: error: " << why << " (see --help)\n";
    return false;
  };
  auto positive = [](const std::string& s, int64_t* v) {
    char* end = nullptr;
    const long long x = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || x <= 0 || x > (int64_t{1} << 24)) return false;
    *v = x;
    return true;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << "usage: bench_attention_cpu [--contexts 1024,4096] [--kv-dtype int8,bf16,f32] [--block-tokens 64]"
                   " [--passes 9]\n"
                   "Times the CPU decode attention kernel alone, one thread, over 24 layers x 12 heads x 64 (the 130m\n"
                   "config) of a paged KV cache, caches flushed before each pass; JSON lines.\n";
      std::exit(0);
    }
    if (i + 1 >= argc) return fail("'" + a + "' needs a value");
    const std::string v = argv[++i];
    if (a == "--contexts") {
      o->contexts.clear();
      for (const std::string& part : Split(v)) {
        int64_t c = 0;
        if (!positive(part, &c)) return fail("--contexts: '" + part + "' is not a positive integer");
        o->contexts.push_back(c);
      }
    } else if (a == "--kv-dtype") {
      o->kv_dtypes = Split(v);
      for (const std::string& d : o->kv_dtypes) {
        if (d != "int8" && d != "bf16" && d != "f32")
          return fail("--kv-dtype: unknown type '" + d + "' (int8, bf16, f32)");
      }
    } else if (a == "--block-tokens") {
      if (!positive(v, &o->block_tokens)) return fail("--block-tokens: '" + v + "' is not a positive integer");
    } else if (a == "--passes") {
      int64_t p = 0;
      if (!positive(v, &p) || p > 1000) return fail("--passes: '" + v + "' is not an integer in 1..1000");
      o->passes = static_cast<int>(p);
    } else {
      return fail("unknown argument '" + a + "'");
    }
  }
  if (o->contexts.empty() || o->kv_dtypes.empty()) return fail("nothing to measure");
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, &o)) return 2;
  std::vector<char> flush(size_t{600} << 20, 1);  // more than this machine's caches, touched before each pass
  for (const std::string& dtype : o.kv_dtypes) {
    for (int64_t context : o.contexts) {
      nlohmann::json r = Measure(o, dtype, context, flush);
      r["machine"] = oryx::bench::MachineInfo();
      r["git"] = oryx::bench::GitRevision();
      r["time"] = oryx::bench::UtcTimestamp();
      std::cout << oryx::JsonText(r) << std::endl;
    }
  }
  return 0;
}
