// The CUDA side of a training step (label gpu): a graphed micro-batch gives the eager gradients, for new
// batches too; the CUDA training forward equals the CPU one; each kernel equals its LibTorch form. (The
// fused AdamW and clipping are tested on every device in fused_optimizer_test.)
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "tests/train/testing_models.h"
#include "train/cuda_ops.h"
#include "train/cuda_step.h"
#include "train/linear_mixers.h"
#include "train/model.h"

namespace oryx::train {
namespace {

const torch::Device kCuda(torch::kCUDA, 0);

struct MicroBatch {
  torch::Tensor inputs, targets, is_attn;
};

MicroBatch RandomBatch(int64_t vocab, int64_t batch, int64_t len, uint64_t seed) {
  torch::manual_seed(seed);
  auto opts = torch::TensorOptions().dtype(torch::kInt64);
  MicroBatch b;
  b.inputs = torch::randint(vocab, {batch, len}, opts).to(kCuda);
  b.targets = torch::randint(vocab, {batch, len}, opts).to(kCuda);
  // Fragments of 8 tokens in random modes, with both modes present.
  auto frag = torch::rand({batch, len / 8}) < 0.4;
  frag.index_put_({0, 0}, true);
  frag.index_put_({0, 1}, false);
  b.is_attn = frag.repeat_interleave(8, 1).to(kCuda);
  return b;
}

torch::Tensor LossOf(OryxModel& model, const torch::Tensor& inputs, const torch::Tensor& targets,
                     const torch::Tensor& is_attn) {
  auto logits = model->Forward(inputs, is_attn, {.any_attn = true, .any_lin = true});
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), targets.view({-1}));
}

std::vector<torch::Tensor> GradsCopy(OryxModel& model) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.grad().clone());
  return out;
}

void ZeroGrads(OryxModel& model) {
  for (auto& p : model->parameters()) p.mutable_grad().zero_();
}

// Each tensor within rtol of its own largest entry, or with global_scale, of the largest entry of all: the
// rounding of sums in a different order (another device's kernels) is relative to the sums' terms, and the
// gradients of some tensors are far smaller than the terms that produce them.
void ExpectClose(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, double rtol,
                 bool global_scale = false) {
  ASSERT_EQ(got.size(), want.size());
  double largest = 0;
  for (const auto& w : want) largest = std::max(largest, w.abs().max().item<double>());
  for (size_t i = 0; i < got.size(); ++i) {
    const double scale = (global_scale ? largest : want[i].abs().max().item<double>()) + 1e-12;
    const double err = (got[i] - want[i]).abs().max().item<double>();
    EXPECT_LE(err, rtol * scale) << "tensor " << i << " of " << got.size();
  }
}

// Largest difference of a from the fp64 reference b, relative to b's largest entry.
double RelativeError(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kFloat64) - b).abs().max() / b.abs().max()).item<double>();
}

class GraphedBackwardTest : public ::testing::TestWithParam<LinearMixer> {};

TEST_P(GraphedBackwardTest, ReplaysGiveTheEagerGradientsOfEachNewBatch) {
  const ModelConfig c = SmallModel(GetParam());
  OryxModel model(c, 5);
  model->to(kCuda, torch::kFloat64);  // fp64: replays and eager runs agree to rounding, not bf16 noise
  model->scan_chunk = 16;
  TrainingStream stream(kCuda);
  for (auto& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);
  const MicroBatch b1 = RandomBatch(c.vocab_size, 2, 48, 1), b2 = RandomBatch(c.vocab_size, 2, 48, 2);

  // Eager references.
  LossOf(model, b1.inputs, b1.targets, b1.is_attn).backward();
  const auto want1 = GradsCopy(model);
  ZeroGrads(model);
  LossOf(model, b2.inputs, b2.targets, b2.is_attn).backward();
  const auto want2 = GradsCopy(model);
  const double loss2 = LossOf(model, b2.inputs, b2.targets, b2.is_attn).item<double>();
  ZeroGrads(model);

  GraphedBackward graphed(
      [&](const torch::Tensor& in, const torch::Tensor& tg, const torch::Tensor& m) { return LossOf(model, in, tg, m); },
      /*warmup=*/1);
  graphed.Run(b1.inputs, b1.targets, b1.is_attn);  // eager warm-up
  EXPECT_FALSE(graphed.recorded());
  ExpectClose(GradsCopy(model), want1, 1e-9);
  ZeroGrads(model);
  auto loss = graphed.Run(b2.inputs, b2.targets, b2.is_attn);  // records, then replays
  EXPECT_TRUE(graphed.recorded());
  EXPECT_NEAR(loss.item<double>(), loss2, 1e-9 * std::abs(loss2));
  ExpectClose(GradsCopy(model), want2, 1e-9);
  ZeroGrads(model);
  graphed.Run(b1.inputs, b1.targets, b1.is_attn);  // a replay on the other batch's data
  ExpectClose(GradsCopy(model), want1, 1e-9);
  // Without zeroing, a replay adds to the gradients, as eager backward does.
  graphed.Run(b2.inputs, b2.targets, b2.is_attn);
  std::vector<torch::Tensor> sum;
  for (size_t i = 0; i < want1.size(); ++i) sum.push_back(want1[i] + want2[i]);
  ExpectClose(GradsCopy(model), sum, 1e-9);
}

INSTANTIATE_TEST_SUITE_P(BothMixers, GraphedBackwardTest, ::testing::Values(LinearMixer::kMamba2, LinearMixer::kGdn),
                         [](const auto& info) { return info.param == LinearMixer::kGdn ? "gdn" : "mamba2"; });

// The training forward on the GPU (the fused conv kernel, the graph-safe RoPE tables) against the same
// model on the CPU (LibTorch's conv1d), in fp64: logits and every gradient.
TEST_P(GraphedBackwardTest, CudaForwardAndGradientsEqualTheCpuOnes) {
  const ModelConfig c = SmallModel(GetParam());
  OryxModel cpu(c, 9), gpu(c, 9);
  cpu->to(torch::kFloat64);
  gpu->to(kCuda, torch::kFloat64);
  cpu->scan_chunk = gpu->scan_chunk = 16;
  const MicroBatch b = RandomBatch(c.vocab_size, 2, 40, 4);
  auto loss_gpu = LossOf(gpu, b.inputs, b.targets, b.is_attn);
  auto loss_cpu = LossOf(cpu, b.inputs.cpu(), b.targets.cpu(), b.is_attn.cpu());
  EXPECT_NEAR(loss_gpu.item<double>(), loss_cpu.item<double>(), 1e-10);
  loss_gpu.backward();
  loss_cpu.backward();
  std::vector<torch::Tensor> got, want;
  for (const auto& p : gpu->parameters()) got.push_back(p.grad().cpu());
  for (const auto& p : cpu->parameters()) want.push_back(p.grad());
  // Measured on the H200: errors up to 2e-12 absolute, in tensors whose largest gradient is about 6e-5,
  // which is 3e-8 of their own scale. A wrong gradient would be off by its own size.
  ExpectClose(got, want, 1e-9, /*global_scale=*/true);
}

TEST(CausalDepthwiseConv, EqualsConv1dForwardAndBackward) {
  torch::manual_seed(21);
  const int64_t B = 3, T = 37, C = 20, W = 4;
  for (auto dtype : {torch::kFloat64, torch::kFloat32, torch::kBFloat16}) {
    const auto wtype = dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    // x is a column slice of a wider tensor, as the projections' k, v are.
    auto wide = torch::randn({B, T, C + 7}, torch::dtype(dtype).device(kCuda));
    auto x = wide.narrow(-1, 2, C).detach().requires_grad_(true);
    auto w = torch::randn({C, W}, torch::dtype(wtype).device(kCuda)).requires_grad_(true);
    auto bias = torch::randn({C}, torch::dtype(wtype).device(kCuda)).requires_grad_(true);
    auto out = CausalDepthwiseConv(x, w, bias);
    auto dout = torch::randn_like(out);
    auto grads = torch::autograd::grad({out}, {x, w, bias}, {dout});

    auto x64 = x.detach().to(torch::kFloat64).requires_grad_(true);
    auto w64 = w.detach().to(torch::kFloat64).requires_grad_(true);
    auto b64 = bias.detach().to(torch::kFloat64).requires_grad_(true);
    auto ref = torch::conv1d(torch::constant_pad_nd(x64.transpose(1, 2), {W - 1, 0}), w64.unsqueeze(1), b64,
                             at::IntArrayRef{1}, at::IntArrayRef{0}, at::IntArrayRef{1}, C)
                   .transpose(1, 2);
    auto ref_grads = torch::autograd::grad({ref}, {x64, w64, b64}, {dout.to(torch::kFloat64).contiguous()});
    // fp64 to rounding; fp32 to its rounding over a few terms; bf16: inputs exact, sums in fp32, output
    // rounded to bf16 (2^-8 relative), and the weight gradient summed over B*T bf16 products.
    const double tol = dtype == torch::kFloat64 ? 1e-12 : dtype == torch::kFloat32 ? 1e-5 : 1e-2;
    EXPECT_LE(RelativeError(out, ref), tol) << dtype;
    EXPECT_LE(RelativeError(grads[0], ref_grads[0]), tol) << "dx " << dtype;
    EXPECT_LE(RelativeError(grads[1], ref_grads[1]), tol) << "dw " << dtype;
    EXPECT_LE(RelativeError(grads[2], ref_grads[2]), tol) << "dbias " << dtype;
  }
}

TEST(FusedRmsNorm, EqualsTheLibTorchFormulaForwardAndBackward) {
  torch::manual_seed(22);
  struct Case {
    torch::Dtype dtype;
    bool bf16_out;
    int64_t cols;
    double tol;  // relative to the largest entry: fp64 rounding; fp32 over a few hundred terms; bf16 output
  };
  for (const Case& c : {Case{torch::kFloat64, false, 768, 1e-12}, Case{torch::kFloat32, false, 768, 1e-5},
                        Case{torch::kFloat32, true, 768, 1e-2}, Case{torch::kFloat32, false, 64, 1e-5},
                        Case{torch::kFloat32, false, 3000, 1e-5}, Case{torch::kFloat64, false, 5, 1e-12}}) {
    auto x = torch::randn({3, 7, c.cols}, torch::dtype(c.dtype).device(kCuda)).requires_grad_(true);
    auto w = (1 + 0.1 * torch::randn({c.cols}, torch::dtype(c.dtype).device(kCuda))).requires_grad_(true);
    auto y = FusedRmsNorm(x, w, 1e-6, c.bf16_out);
    EXPECT_EQ(y.scalar_type(), c.bf16_out ? torch::kBFloat16 : c.dtype);
    auto dy = torch::randn(y.sizes(), y.options());
    auto grads = torch::autograd::grad({y}, {x, w}, {dy});

    auto x64 = x.detach().to(torch::kFloat64).requires_grad_(true);
    auto w64 = w.detach().to(torch::kFloat64).requires_grad_(true);
    auto ref = x64 * torch::rsqrt(x64.pow(2).mean(-1, true) + 1e-6) * w64;
    auto ref_grads = torch::autograd::grad({ref}, {x64, w64}, {dy.to(torch::kFloat64)});
    EXPECT_LE(RelativeError(y, ref), c.tol) << c.dtype << " cols " << c.cols;
    EXPECT_LE(RelativeError(grads[0], ref_grads[0]), c.tol) << "dx " << c.dtype << " cols " << c.cols;
    EXPECT_LE(RelativeError(grads[1], ref_grads[1]), c.tol) << "dw " << c.dtype << " cols " << c.cols;
  }
}

TEST(FusedRope, EqualsTheLibTorchRotationForwardAndBackward) {
  torch::manual_seed(23);
  const int64_t B = 2, T = 19, H = 3, dh = 16;
  auto [cos, sin] = RopeTables(10000.0, dh, 0, T, kCuda);
  // A strided view, as q and k are: heads of a wider projection. At an offset of 8 the kernel takes 4 pairs
  // per thread; at 2 (strides and start not multiples of 4) one.
  for (int64_t offset : {8, 2}) {
    for (auto dtype : {torch::kFloat64, torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE("offset " + std::to_string(offset));
      auto wide = torch::randn({B, T, H * dh + offset}, torch::dtype(dtype).device(kCuda));
      auto x = wide.narrow(-1, offset, H * dh).view({B, T, H, dh}).detach().requires_grad_(true);
      auto y = FusedRope(x, cos, sin);
      EXPECT_TRUE(y.is_contiguous());
      auto dy = torch::randn_like(y);
      auto dx = torch::autograd::grad({y}, {x}, {dy})[0];
      // The reference: the same rotation in fp64, written out with LibTorch ops.
      auto x64 = x.detach().to(torch::kFloat64).requires_grad_(true);
      auto c = cos.to(torch::kFloat64).unsqueeze(-2), s = sin.to(torch::kFloat64).unsqueeze(-2);
      auto x1 = x64.narrow(-1, 0, dh / 2), x2 = x64.narrow(-1, dh / 2, dh / 2);
      auto ref = torch::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
      auto ref_dx = torch::autograd::grad({ref}, {x64}, {dy.to(torch::kFloat64)})[0];
      const double tol = dtype == torch::kFloat64 ? 1e-12 : dtype == torch::kFloat32 ? 1e-6 : 1e-2;
      EXPECT_LE(RelativeError(y, ref), tol) << dtype;
      EXPECT_LE(RelativeError(dx, ref_dx), tol) << "dx " << dtype;
    }
  }
}

TEST(FusedSiluMul, EqualsTheLibTorchFormulaForwardAndBackward) {
  torch::manual_seed(29);
  const int64_t B = 2, T = 37;
  // 300 columns at an offset of 20 take the kernel's one-element path, 256 at 16 its 16-byte path.
  for (const auto& [C, offset] : std::vector<std::pair<int64_t, int64_t>>{{300, 20}, {256, 16}}) {
    for (auto dtype : {torch::kFloat64, torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE("columns " + std::to_string(C));
      // The gate a strided part of a wider projection (as the mixer's gate is), x packed.
      auto wide = torch::randn({B, T, C + offset}, torch::dtype(dtype).device(kCuda)) * 3;
      auto gate = wide.narrow(-1, offset, C).detach().requires_grad_(true);
      auto x = torch::randn({B, T, C}, torch::dtype(dtype).device(kCuda)).requires_grad_(true);
      auto y = FusedSiluMul(gate, x);
      EXPECT_TRUE(y.is_contiguous());
      auto dy = torch::randn_like(y);
      auto grads = torch::autograd::grad({y}, {gate, x}, {dy});
      auto g64 = gate.detach().to(torch::kFloat64).requires_grad_(true);
      auto x64 = x.detach().to(torch::kFloat64).requires_grad_(true);
      auto ref = torch::silu(g64) * x64;
      auto ref_grads = torch::autograd::grad({ref}, {g64, x64}, {dy.to(torch::kFloat64)});
      // One bf16 rounding of each output (2^-9 relative), fp32 and fp64 to their precision.
      const double tol = dtype == torch::kFloat64 ? 1e-12 : dtype == torch::kFloat32 ? 1e-6 : 4e-3;
      EXPECT_LE(RelativeError(y, ref), tol) << dtype;
      EXPECT_LE(RelativeError(grads[0], ref_grads[0]), tol) << "dgate " << dtype;
      EXPECT_LE(RelativeError(grads[1], ref_grads[1]), tol) << "dx " << dtype;
    }
  }
  EXPECT_THROW(FusedSiluMul(torch::zeros({3}, torch::dtype(torch::kFloat32).device(kCuda)),
                            torch::zeros({4}, torch::dtype(torch::kFloat32).device(kCuda))),
               c10::Error);
}

// The mixers' combination against model.cc's LibTorch form, where(is_attn, attn, lin + skip v), in fp64:
// lin as ScanChunked's head-major view (with padding), v as a split of a wider tensor, with and without
// attention tokens and the skip term, on the kernel's 4-wide path (dh 8) and its one-element path (dh 6).
TEST(CombineMixers, EqualsTheLibTorchFormForwardAndBackward) {
  torch::manual_seed(31);
  struct Types {
    torch::Dtype attn, v, lin;
  };
  const int64_t B = 2, T = 37, H = 3, pad = 11;
  for (const Types ty : {Types{torch::kFloat64, torch::kFloat64, torch::kFloat64},
                         Types{torch::kBFloat16, torch::kBFloat16, torch::kFloat32},
                         Types{torch::kBFloat16, torch::kFloat32, torch::kFloat32}}) {
    for (int64_t dh : {8, 6}) {
      for (bool with_attn : {true, false}) {
        for (bool with_skip : {true, false}) {
          SCOPED_TRACE(testing::Message() << "attn " << ty.attn << " v " << ty.v << " lin " << ty.lin << " dh " << dh
                                          << " attn " << with_attn << " skip " << with_skip);
          auto leaf = [](torch::Tensor t) { return t.requires_grad_(true); };
          auto lin_base = leaf(torch::randn({B, H, T + pad, dh}, torch::dtype(ty.lin).device(kCuda)));
          auto v_base = leaf(torch::randn({B, T, 2 * H * dh}, torch::dtype(ty.v).device(kCuda)));
          auto attn_base = leaf(torch::randn({B, H, T, dh}, torch::dtype(ty.attn).device(kCuda)));
          auto skip = leaf(torch::randn({H}, torch::dtype(ty.lin).device(kCuda)));
          auto is_attn = torch::rand({B, T}, torch::dtype(torch::kFloat32).device(kCuda)) < 0.5;
          auto views = [&](const torch::Tensor& lb, const torch::Tensor& vb, const torch::Tensor& ab) {
            return std::tuple{lb.narrow(2, 0, T).transpose(1, 2), vb.narrow(-1, H * dh, H * dh).reshape({B, T, H, dh}),
                              ab.transpose(1, 2)};
          };
          auto [lin, v, attn] = views(lin_base, v_base, attn_base);
          auto out = CombineMixers(with_attn ? attn : torch::Tensor(), lin, v, with_skip ? skip : torch::Tensor(),
                                   with_attn ? is_attn : torch::Tensor());
          EXPECT_TRUE(out.is_contiguous());
          EXPECT_EQ(out.scalar_type(), ty.lin);
          auto dout = torch::randn_like(out);
          std::vector<torch::Tensor> inputs = {lin_base, v_base, attn_base, skip};
          auto grads = torch::autograd::grad({out}, inputs, {dout}, /*retain_graph=*/false, /*create_graph=*/false,
                                             /*allow_unused=*/true);

          auto w = [](const torch::Tensor& t) { return t.detach().to(torch::kFloat64).requires_grad_(true); };
          std::vector<torch::Tensor> inputs64 = {w(lin_base), w(v_base), w(attn_base), w(skip)};
          auto [lin64, v64, attn64] = views(inputs64[0], inputs64[1], inputs64[2]);
          auto ref = with_skip ? lin64 + inputs64[3].view({1, 1, H, 1}) * v64 : lin64;
          if (with_attn) ref = torch::where(is_attn.view({B, T, 1, 1}), attn64, ref);
          auto ref_grads = torch::autograd::grad({ref}, inputs64, {dout.to(torch::kFloat64)}, false, false, true);
          // fp64 to rounding; fp32 to its rounding of lin + skip v; a bf16 gradient is dout rounded once (2^-9).
          auto tol = [](torch::Dtype t) { return t == torch::kFloat64 ? 1e-12 : t == torch::kFloat32 ? 1e-6 : 4e-3; };
          EXPECT_LE(RelativeError(out, ref), tol(ty.lin));
          EXPECT_LE(RelativeError(grads[0], ref_grads[0]), tol(ty.lin)) << "dlin";
          EXPECT_EQ(grads[1].defined(), with_skip);
          EXPECT_EQ(grads[2].defined(), with_attn);
          EXPECT_EQ(grads[3].defined(), with_skip);
          if (with_skip) {
            EXPECT_LE(RelativeError(grads[1], ref_grads[1]), tol(ty.v)) << "dv";
            // dskip: fp32 sums of B T dh = 592 products, each rounded to 2^-24.
            EXPECT_LE(RelativeError(grads[3], ref_grads[3]), ty.lin == torch::kFloat64 ? 1e-12 : 1e-4) << "dskip";
          }
          if (with_attn) {
            EXPECT_LE(RelativeError(grads[2], ref_grads[2]), tol(ty.attn)) << "dattn";
          }
        }
      }
    }
  }
  auto f32 = torch::dtype(torch::kFloat32).device(kCuda);
  EXPECT_THROW(CombineMixers(torch::zeros({1, 2, 3, 4}, f32), torch::zeros({1, 2, 3, 4}, f32),
                             torch::zeros({1, 2, 3, 4}, f32), torch::Tensor(), torch::Tensor()),
               c10::Error);  // attn without is_attn
}

// The chunk operands' kernel against ScanChunked's LibTorch form (transposed, padded copies and the two
// products), forward and backward: q a strided part of a wider tensor, T not a multiple of the chunk (a
// padded tail), and the operand dtypes the trainer gives it.
TEST(ChunkPrepare, EqualsTheLibTorchFormForwardAndBackward) {
  torch::manual_seed(37);
  const int64_t B = 2, T = 37, H = 3, C = 16, N = 3;
  for (const auto dtype : {torch::kFloat64, torch::kFloat32, torch::kBFloat16}) {
    for (int64_t dh : {8, 64}) {
      SCOPED_TRACE(testing::Message() << dtype << " dh " << dh);
      const auto wide = dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
      auto leaf = [](torch::Tensor t) { return t.requires_grad_(true); };
      auto q_base = leaf(torch::randn({B, T, H * dh + 8}, torch::dtype(dtype).device(kCuda)));
      auto k = leaf(torch::randn({B, T, H, dh}, torch::dtype(dtype).device(kCuda)));
      auto v = leaf(torch::randn({B, T, H, dh}, torch::dtype(dtype).device(kCuda)));
      auto dt = leaf(torch::rand({B, H, N, C}, torch::dtype(wide).device(kCuda)));
      auto to_end = leaf(torch::rand({B, H, N, C}, torch::dtype(wide).device(kCuda)));
      auto q = q_base.narrow(-1, 8, H * dh).view({B, T, H, dh});
      ASSERT_TRUE(ChunkPrepareAvailable(q, k, v, dt));
      const auto outs = ChunkPrepare(q, k, v, dt, to_end);
      ASSERT_EQ(outs.size(), 4u);
      std::vector<torch::Tensor> douts;
      for (const auto& o : outs) {
        EXPECT_EQ(o.sizes(), (std::vector<int64_t>{B, H, N, C, dh}));
        EXPECT_EQ(o.scalar_type(), wide);
        douts.push_back(torch::randn_like(o));
      }
      std::vector<torch::Tensor> inputs = {q_base, k, v, dt, to_end};
      auto grads = torch::autograd::grad(outs, inputs, douts);

      auto w = [](const torch::Tensor& t) { return t.detach().to(torch::kFloat64).requires_grad_(true); };
      std::vector<torch::Tensor> in64;
      for (const auto& t : inputs) in64.push_back(w(t));
      auto chunks = [&](const torch::Tensor& x) {  // [B,T,H,dh] -> [B,H,N,C,dh], zeros past T
        return torch::constant_pad_nd(x.transpose(1, 2), {0, 0, 0, N * C - T}, 0).reshape({B, H, N, C, dh});
      };
      auto q64 = chunks(in64[0].narrow(-1, 8, H * dh).view({B, T, H, dh})), k64 = chunks(in64[1]),
           v64 = chunks(in64[2]);
      std::vector<torch::Tensor> refs = {q64, k64, in64[3].unsqueeze(-1) * v64, in64[4].unsqueeze(-1) * k64};
      std::vector<torch::Tensor> douts64;
      for (const auto& d : douts) douts64.push_back(d.to(torch::kFloat64));
      auto ref_grads = torch::autograd::grad(refs, in64, douts64);
      // The outputs: exact conversions, and one product rounded in fp32 (2^-24). The operands' gradients are
      // rounded to their dtype once (bf16: 2^-9); dk adds two terms first. dt and to_end: fp32 sums of dh
      // products.
      const double out_tol = dtype == torch::kFloat64 ? 1e-14 : 1e-6;
      const double grad_tol = dtype == torch::kFloat64 ? 1e-14 : dtype == torch::kFloat32 ? 1e-6 : 4e-3;
      const double sum_tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
      const char* names[] = {"q", "k", "u", "kend"};
      for (int i = 0; i < 4; ++i) EXPECT_LE(RelativeError(outs[i], refs[i]), out_tol) << names[i];
      EXPECT_LE(RelativeError(grads[0], ref_grads[0]), grad_tol) << "dq";
      EXPECT_LE(RelativeError(grads[1], ref_grads[1]), grad_tol) << "dk";
      EXPECT_LE(RelativeError(grads[2], ref_grads[2]), grad_tol) << "dv";
      EXPECT_LE(RelativeError(grads[3], ref_grads[3]), sum_tol) << "ddt";
      EXPECT_LE(RelativeError(grads[4], ref_grads[4]), sum_tol) << "dto_end";
      // The padded steps' gradients are zero.
      EXPECT_EQ(grads[3].flatten(2).narrow(-1, T, N * C - T).abs().max().item<double>(), 0.0);
    }
  }
  const auto f32 = torch::dtype(torch::kFloat32).device(kCuda);
  EXPECT_FALSE(ChunkPrepareAvailable(torch::zeros({1, 4, 2, 6}, f32), torch::zeros({1, 4, 2, 6}, f32),
                                     torch::zeros({1, 4, 2, 6}, f32), torch::zeros({1, 2, 1, 4}, f32)));  // dh 6
  EXPECT_THROW(ChunkPrepare(torch::zeros({1, 4, 2, 8}, f32), torch::zeros({1, 4, 2, 8}, f32),
                            torch::zeros({1, 4, 2, 8}, f32), torch::zeros({1, 2, 1, 2}, f32),
                            torch::zeros({1, 2, 1, 2}, f32)),
               c10::Error);  // N C = 2 < T = 4
}

// The chunk-output kernel against its LibTorch form (ScanChunked's fallback), forward and backward.
TEST(ChunkOutput, EqualsTheLibTorchFormForwardAndBackward) {
  torch::manual_seed(24);
  struct Case {
    torch::Dtype dtype;
    int64_t C, D;
    double tol;
  };
  // fp64 (CUDA cores): to rounding. fp32 (tensor cores, TF32 operands as the cuBLAS products the trainer
  // allows for the scans): each operand rounded to 2^-11, twice along the chain q k^T -> A -> A u, in sums of
  // 64 products; dg is a difference of two such sums.
  for (const Case& c : {Case{torch::kFloat64, 16, 8, 1e-12}, Case{torch::kFloat32, 64, 64, 5e-3}}) {
    const auto opts = torch::dtype(c.dtype).device(kCuda);
    const int64_t B = 2, H = 3, N = 5;
    auto make = [&](std::vector<int64_t> shape, double scale) {
      return (torch::randn(shape, opts) * scale).requires_grad_(true);
    };
    auto q = make({B, H, N, c.C, c.D}, 0.3), k = make({B, H, N, c.C, c.D}, 0.3), u = make({B, H, N, c.C, c.D}, 1);
    auto s0 = make({B, H, N, c.D, c.D}, 0.5);
    // g: cumulative sums of negative log decays, as the scan makes them.
    auto g = (-torch::rand({B, H, N, c.C}, opts) * 0.2).cumsum(-1).detach().requires_grad_(true);
    ASSERT_TRUE(ChunkOutputAvailable(q));
    auto out = ChunkOutput(q, k, u, g, s0);
    auto dout = torch::randn_like(out);
    auto grads = torch::autograd::grad({out}, {q, k, u, g, s0}, {dout});

    auto w = [](const torch::Tensor& t) { return t.detach().to(torch::kFloat64).requires_grad_(true); };
    auto q64 = w(q), k64 = w(k), u64 = w(u), g64 = w(g), s64 = w(s0);
    auto diff = g64.unsqueeze(-1) - g64.unsqueeze(-2);
    auto keep = torch::ones({c.C, c.C}, torch::dtype(torch::kBool).device(kCuda)).tril();
    auto decay = torch::where(keep, diff, torch::full({}, -INFINITY, diff.options())).exp();
    auto ref = g64.exp().unsqueeze(-1) * torch::matmul(q64, s64) +
               torch::matmul(torch::matmul(q64, k64.transpose(-1, -2)) * decay, u64);
    auto ref_grads = torch::autograd::grad({ref}, {q64, k64, u64, g64, s64}, {dout.to(torch::kFloat64)});
    EXPECT_LE(RelativeError(out, ref), c.tol) << c.dtype;
    const char* names[] = {"dq", "dk", "du", "dg", "ds0"};
    for (int i = 0; i < 5; ++i) EXPECT_LE(RelativeError(grads[i], ref_grads[i]), c.tol) << names[i] << " " << c.dtype;
  }
}

// ScanChunked's GDN form on the GPU (its UT transform in GdnMatrix and GdnSolve, its state passing in GdnStates*
// kernels, its outputs in the chunk-output kernel) against the same form on the CPU (a loop of LibTorch ops), forward
// and backward, with a padded last chunk, an initial state, and a loss that reads the final state too.
TEST(GdnStates, ScanChunkedOnTheGpuEqualsTheCpuForwardAndBackward) {
  struct Case {
    torch::Dtype dtype;
    int64_t chunk, dh;
    double tol;
  };
  // fp64: to rounding. fp32: the chunk-output kernel's TF32 products (see ChunkOutput above).
  for (const Case& c : {Case{torch::kFloat64, 16, 8, 1e-11}, Case{torch::kFloat32, 64, 64, 5e-3}}) {
    torch::manual_seed(31);
    const int64_t B = 2, T = 3 * c.chunk + 5, H = 3;
    const auto cpu = torch::dtype(torch::kFloat64);
    auto k = torch::randn({B, T, H, c.dh}, cpu), q = torch::randn({B, T, H, c.dh}, cpu);
    k = k / k.norm(2, -1, true);
    q = q / q.norm(2, -1, true) / std::sqrt(static_cast<double>(c.dh));
    std::vector<torch::Tensor> host = {q,
                                       k,
                                       torch::randn({B, T, H, c.dh}, cpu),
                                       -torch::rand({B, T, H}, cpu) * 0.3,
                                       torch::rand({B, T, H}, cpu),
                                       torch::randn({B, H, c.dh, c.dh}, cpu) * 0.3};
    auto w_out = torch::randn({B, T, H, c.dh}, cpu), w_state = torch::randn({B, H, c.dh, c.dh}, cpu);
    auto run = [&](torch::Device device, torch::Dtype dtype) {
      std::vector<torch::Tensor> x;
      for (const auto& t : host) x.push_back(t.to(device, dtype).requires_grad_(true));
      ScanResult r = ScanChunked(ScanKind::kGdn, {x[0], x[1], x[2], x[3], x[4]}, x[5], c.chunk);
      auto loss = (r.out * w_out.to(device, dtype)).sum() + (r.state * w_state.to(device, dtype)).sum();
      auto grads = torch::autograd::grad({loss}, x);
      std::vector<torch::Tensor> all = {r.out, r.state};
      for (auto& g : grads) all.push_back(g.to(torch::kCPU, torch::kFloat64));
      all[0] = all[0].to(torch::kCPU, torch::kFloat64), all[1] = all[1].to(torch::kCPU, torch::kFloat64);
      return all;
    };
    const auto opts = torch::dtype(c.dtype).device(kCuda);
    ASSERT_TRUE(ChunkOutputAvailable(torch::zeros({1, 1, 1, c.chunk, c.dh}, opts)));  // all four kernels
    const auto gpu = run(kCuda, c.dtype), ref = run(torch::kCPU, torch::kFloat64);
    const char* names[] = {"out", "state", "dq", "dk", "dv", "dlog_decay", "dscale", "dinitial"};
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_LE(RelativeError(gpu[i], ref[i]), c.tol) << names[i] << " " << c.dtype;
  }
  EXPECT_FALSE(ChunkOutputAvailable(torch::zeros({1, 1, 1, 32, 64}, torch::dtype(torch::kFloat32).device(kCuda))));
}

}  // namespace
}  // namespace oryx::train
