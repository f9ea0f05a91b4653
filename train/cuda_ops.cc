// Autograd wrappers of the trainer's CUDA kernels.
#include "train/cuda_ops.h"

#include <limits>

#if defined(ORYX_TRAIN_CUDA_KERNELS)
#include <c10/cuda/CUDAStream.h>

#include "train/cuda_train_kernels.h"
#endif

namespace oryx::train {

#if defined(ORYX_TRAIN_CUDA_KERNELS)

bool HaveCudaTrainOps() { return true; }

namespace {

cuda::ActDType DTypeOf(const torch::Tensor& x) {
  switch (x.scalar_type()) {
    case torch::kBFloat16:
      return cuda::ActDType::kBF16;
    case torch::kFloat32:
      return cuda::ActDType::kF32;
    case torch::kFloat64:
      return cuda::ActDType::kF64;
    default:
      TORCH_CHECK(false, "trainer CUDA op: x must be bf16, fp32 or fp64, got ", x.scalar_type());
  }
}

cudaStream_t StreamOf(const torch::Tensor& x) { return c10::cuda::getCurrentCUDAStream(x.device().index()); }

void Check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, what, ": ", cudaGetErrorString(e));
}

// x [B, T, C] as rows r = b * T + t, ld_x = stride(1) elements apart, with unit column stride; copied when
// its layout is not that.
torch::Tensor Rows(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1);
  const bool rows_ok = x.stride(2) == 1 && (B == 1 || x.stride(0) == T * x.stride(1));
  return rows_ok ? x : x.contiguous();
}

cuda::ConvShape ShapeOf(const torch::Tensor& x, const torch::Tensor& weight) {
  cuda::ConvShape s;
  s.rows = x.size(0) * x.size(1);
  s.time = static_cast<int>(x.size(1));
  s.channels = static_cast<int>(x.size(2));
  s.width = static_cast<int>(weight.size(1));
  s.ld_x = x.stride(1);
  return s;
}

class CausalConvFunction : public torch::autograd::Function<CausalConvFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x_in,
                               const torch::Tensor& weight, const torch::Tensor& bias) {
    auto x = Rows(x_in);
    auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
    Check(cuda::CausalConvForward(DTypeOf(x), ShapeOf(x, weight), x.data_ptr(), weight.data_ptr(), bias.data_ptr(),
                                  out.data_ptr(), StreamOf(x)),
          "causal conv forward");
    ctx->save_for_backward({x, weight});
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& weight = saved[1];
    auto dout = grads[0].to(x.scalar_type()).contiguous();
    auto dx = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
    const int64_t C = weight.size(0), W = weight.size(1);
    auto dw_and_bias = torch::empty({C, W + 1}, weight.options());
    const auto shape = ShapeOf(x, weight);
    auto workspace = torch::empty({cuda::ConvWorkspaceBytes(DTypeOf(x), shape)}, x.options().dtype(torch::kUInt8));
    Check(cuda::CausalConvBackward(DTypeOf(x), shape, x.data_ptr(), weight.data_ptr(), dout.data_ptr(), dx.data_ptr(),
                                   dw_and_bias.data_ptr(), workspace.data_ptr(),
                                   StreamOf(x)),
          "causal conv backward");
    return {dx, dw_and_bias.narrow(1, 0, W).contiguous(), dw_and_bias.select(1, W).contiguous()};
  }
};

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x_in,
                               const torch::Tensor& weight, double eps, bool bf16_out) {
    auto x = x_in.contiguous();
    const auto types = x.scalar_type() == torch::kFloat64 ? cuda::NormTypes::kF64
                       : bf16_out                         ? cuda::NormTypes::kF32ToBF16
                                                          : cuda::NormTypes::kF32ToF32;
    auto y = torch::empty(x.sizes(), x.options().dtype(bf16_out ? torch::kBFloat16 : x.scalar_type()));
    auto rstd = torch::empty({x.numel() / x.size(-1)}, x.options());
    const cuda::NormShape shape{.rows = rstd.numel(), .cols = static_cast<int>(x.size(-1)), .eps = eps};
    Check(cuda::RmsNormForward(types, shape, x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(),
                               StreamOf(x)),
          "rms norm forward");
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["types"] = static_cast<int64_t>(types);
    ctx->saved_data["y_dtype"] = y.scalar_type();
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const auto types = static_cast<cuda::NormTypes>(ctx->saved_data["types"].toInt());
    auto dy = grads[0].to(ctx->saved_data["y_dtype"].toScalarType()).contiguous();
    auto dx = torch::empty_like(x);
    auto dw = torch::empty_like(weight);
    const cuda::NormShape shape{.rows = rstd.numel(), .cols = static_cast<int>(x.size(-1)), .eps = 0};
    auto workspace = torch::empty({cuda::NormWorkspaceBytes(types, shape)}, x.options().dtype(torch::kUInt8));
    Check(cuda::RmsNormBackward(types, shape, x.data_ptr(), weight.data_ptr(), dy.data_ptr(), rstd.data_ptr(),
                                dx.data_ptr(), dw.data_ptr(), workspace.data_ptr(),
                                StreamOf(x)),
          "rms norm backward");
    return {dx, dw, torch::Tensor(), torch::Tensor()};
  }
};

torch::Tensor RopeCall(const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin, bool inverse) {
  auto x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
  auto out = torch::empty(x.sizes(), x.options());
  const cuda::RopeShape r{.batch = x.size(0), .time = static_cast<int>(x.size(1)), .heads = static_cast<int>(x.size(2)),
                          .half = static_cast<int>(x.size(3) / 2), .sb = x.stride(0), .st = x.stride(1),
                          .sh = x.stride(2)};
  Check(cuda::ApplyRope(DTypeOf(x), r, x.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr(),
                        inverse, StreamOf(x)),
        "rope");
  return out;
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return RopeCall(x, cos, sin, /*inverse=*/false);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {RopeCall(grads[0], saved[0], saved[1], /*inverse=*/true), torch::Tensor(), torch::Tensor()};
  }
};

// t packed, and 32-byte aligned for the tensor-core chunk-output kernels' loads and stores (a packed view
// may start anywhere in its storage).
torch::Tensor PackedAligned(const torch::Tensor& t) {
  auto c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 32 == 0 ? c : c.clone();
}

class ChunkOutputFunction : public torch::autograd::Function<ChunkOutputFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q_in,
                               const torch::Tensor& k_in, const torch::Tensor& u_in, const torch::Tensor& g_in,
                               const torch::Tensor& s0_in) {
    auto q = PackedAligned(q_in), k = PackedAligned(k_in), u = PackedAligned(u_in), g = PackedAligned(g_in),
         s0 = PackedAligned(s0_in);
    auto out = torch::empty_like(q);
    const int C = static_cast<int>(q.size(-2)), D = static_cast<int>(q.size(-1));
    Check(cuda::ChunkOutputForward(q.scalar_type() == torch::kFloat64, C, D, q.numel() / (C * D), q.data_ptr(),
                                   k.data_ptr(), u.data_ptr(), g.data_ptr(), s0.data_ptr(), out.data_ptr(),
                                   StreamOf(q)),
          "chunk output forward");
    ctx->save_for_backward({q, k, u, g, s0});
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &u = saved[2], &g = saved[3], &s0 = saved[4];
    auto dout = PackedAligned(grads[0]);
    auto dq = torch::empty_like(q), dk = torch::empty_like(k), du = torch::empty_like(u), dg = torch::empty_like(g),
         ds0 = torch::empty_like(s0);
    const int C = static_cast<int>(q.size(-2)), D = static_cast<int>(q.size(-1));
    Check(cuda::ChunkOutputBackward(q.scalar_type() == torch::kFloat64, C, D, q.numel() / (C * D), q.data_ptr(),
                                    k.data_ptr(), u.data_ptr(), g.data_ptr(), s0.data_ptr(), dout.data_ptr(),
                                    dq.data_ptr(), dk.data_ptr(), du.data_ptr(), dg.data_ptr(), ds0.data_ptr(),
                                    StreamOf(q)),
          "chunk output backward");
    return {dq, dk, du, dg, ds0};
  }
};

class GdnMatrixFunction : public torch::autograd::Function<GdnMatrixFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& k_in,
                               const torch::Tensor& g_in, const torch::Tensor& beta_in) {
    auto k = k_in.contiguous(), g = g_in.contiguous(), beta = beta_in.contiguous();
    const int C = static_cast<int>(k.size(-2)), D = static_cast<int>(k.size(-1));
    auto sizes = k.sizes().vec();
    sizes.back() = C;
    auto l = torch::empty(sizes, k.options());
    Check(cuda::GdnMatrixForward(k.scalar_type() == torch::kFloat64, C, D, k.numel() / (C * D), k.data_ptr(),
                                 g.data_ptr(), beta.data_ptr(), l.data_ptr(), StreamOf(k)),
          "gdn matrix forward");
    ctx->save_for_backward({k, g, beta});
    return l;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &k = saved[0], &g = saved[1], &beta = saved[2];
    auto dl = grads[0].contiguous();
    auto dk = torch::empty_like(k), dg = torch::empty_like(g), dbeta = torch::empty_like(beta);
    const int C = static_cast<int>(k.size(-2)), D = static_cast<int>(k.size(-1));
    Check(cuda::GdnMatrixBackward(k.scalar_type() == torch::kFloat64, C, D, k.numel() / (C * D), k.data_ptr(),
                                  g.data_ptr(), beta.data_ptr(), dl.data_ptr(), dk.data_ptr(), dg.data_ptr(),
                                  dbeta.data_ptr(), StreamOf(k)),
          "gdn matrix backward");
    return {dk, dg, dbeta};
  }
};

class GdnSolveFunction : public torch::autograd::Function<GdnSolveFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& l_in,
                               const torch::Tensor& sv_in, const torch::Tensor& k_in, const torch::Tensor& f_in) {
    auto l = l_in.contiguous(), sv = sv_in.contiguous(), k = k_in.contiguous(), f = f_in.contiguous();
    const int C = static_cast<int>(k.size(-2)), D = static_cast<int>(k.size(-1));
    auto sizes = k.sizes().vec();
    sizes.back() = 2 * D;
    auto x = torch::empty(sizes, k.options());
    Check(cuda::GdnSolveForward(k.scalar_type() == torch::kFloat64, C, D, k.numel() / (C * D), l.data_ptr(),
                                sv.data_ptr(), k.data_ptr(), f.data_ptr(), x.data_ptr(), StreamOf(k)),
          "gdn solve forward");
    ctx->save_for_backward({l, x, k, f});
    return x;
  }

  // x = (I + L)^-1 r with r = [sv, diag(f) k]: dr = (I + L)^-T dx, dL = -dr x^T below the diagonal, and
  // the kernel turns dr's second half into dk and df.
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &l = saved[0], &x = saved[1], &k = saved[2], &f = saved[3];
    auto dx = grads[0].contiguous();
    auto dr = torch::empty_like(x), dk = torch::empty_like(k), df = torch::empty_like(f);
    const int C = static_cast<int>(k.size(-2)), D = static_cast<int>(k.size(-1));
    Check(cuda::GdnSolveBackward(k.scalar_type() == torch::kFloat64, C, D, k.numel() / (C * D), l.data_ptr(),
                                 k.data_ptr(), f.data_ptr(), dx.data_ptr(), dr.data_ptr(), dk.data_ptr(), df.data_ptr(),
                                 StreamOf(k)),
          "gdn solve backward");
    auto dl = -torch::matmul(dr, x.transpose(-1, -2)).tril(-1);
    return {dl, dr.narrow(-1, 0, D), dk, df};
  }
};

// t [..., cols] as [rows, cols] with unit column stride and one row stride, copied when it is not.
torch::Tensor AsRows(const torch::Tensor& t) {
  auto rows = t.dim() == 1 ? t.unsqueeze(0) : t.flatten(0, -2);
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

class SiluMulFunction : public torch::autograd::Function<SiluMulFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& x) {
    auto g = AsRows(gate), v = AsRows(x);
    auto out = torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
    Check(cuda::SiluMulForward(DTypeOf(v), ShapeOf(g, v), g.data_ptr(), v.data_ptr(), out.data_ptr(), StreamOf(v)),
          "silu mul forward");
    ctx->save_for_backward({gate, x});
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto g = AsRows(saved[0]), v = AsRows(saved[1]);
    auto dout = grads[0].to(v.scalar_type()).contiguous();
    auto dgate = torch::empty(saved[0].sizes(), v.options()), dx = torch::empty(saved[1].sizes(), v.options());
    Check(cuda::SiluMulBackward(DTypeOf(v), ShapeOf(g, v), g.data_ptr(), v.data_ptr(), dout.data_ptr(),
                                dgate.data_ptr(), dx.data_ptr(), StreamOf(v)),
          "silu mul backward");
    return {dgate, dx};
  }

 private:
  static cuda::GateShape ShapeOf(const torch::Tensor& g, const torch::Tensor& v) {
    return {.rows = v.size(0), .cols = static_cast<int>(v.size(1)), .ld_gate = g.stride(0), .ld_x = v.stride(0)};
  }
};

cuda::CombineShape::Strides StridesOf(const torch::Tensor& t) {
  if (!t.defined()) return {};
  return {.b = t.stride(0), .t = t.stride(1), .h = t.stride(2)};
}

void* DataOrNull(const torch::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// A kernel shape's batch, time, heads and head_dim from x [B, T, H, dh].
template <typename Shape>
Shape HeadsShapeOf(const torch::Tensor& x) {
  Shape s;
  s.batch = x.size(0);
  s.time = static_cast<int>(x.size(1));
  s.heads = static_cast<int>(x.size(2));
  s.head_dim = static_cast<int>(x.size(3));
  return s;
}

// attn, skip and is_attn are absent when empty (CombineMixers passes them so).
class CombineMixersFunction : public torch::autograd::Function<CombineMixersFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& attn_in,
                               const torch::Tensor& lin, const torch::Tensor& v, const torch::Tensor& skip_in,
                               const torch::Tensor& is_attn_in) {
    const auto attn = Given(attn_in), skip = Given(skip_in), is_attn = Given(is_attn_in);
    auto s = HeadsShapeOf<cuda::CombineShape>(lin);
    s.attn = StridesOf(attn);
    s.lin = StridesOf(lin);
    s.v = StridesOf(v);
    auto out = torch::empty(lin.sizes(), lin.options().memory_format(torch::MemoryFormat::Contiguous));
    const auto attn_dtype = attn.defined() ? DTypeOf(attn) : DTypeOf(v);
    Check(cuda::CombineMixersForward(attn_dtype, DTypeOf(v), s, DataOrNull(attn), lin.data_ptr(), v.data_ptr(), DataOrNull(skip),
                                     is_attn.defined() ? is_attn.data_ptr<bool>() : nullptr, out.data_ptr(),
                                     StreamOf(lin)),
          "combine mixers forward");
    ctx->save_for_backward({v, skip_in, is_attn_in});
    ctx->saved_data["attn_dtype"] = attn.defined() ? attn.scalar_type() : torch::ScalarType::Undefined;
    ctx->saved_data["lin_strides"] = lin.strides().vec();
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &v = saved[0], skip = Given(saved[1]), is_attn = Given(saved[2]);
    const auto attn_type = ctx->saved_data["attn_dtype"].toScalarType();
    // dout in the output's dtype, lin's: fp64 with fp64 operands, else fp32.
    auto dout = grads[0].to(v.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32).contiguous();
    auto s = HeadsShapeOf<cuda::CombineShape>(dout);
    s.v = StridesOf(v);
    // lin's gradient in lin's own layout (for ScanChunked's view, the head-major layout its producer wrote),
    // so that no copy packs it on the way back.
    const auto lin_strides = ctx->saved_data["lin_strides"].toIntVector();
    auto dlin = torch::empty_strided(dout.sizes(), lin_strides, dout.options());
    if (!dlin.is_non_overlapping_and_dense()) dlin = torch::empty_like(dout);
    s.dlin = StridesOf(dlin);
    torch::Tensor dattn, dv, dskip_cols, workspace;
    if (attn_type != torch::ScalarType::Undefined) dattn = torch::empty(dout.sizes(), dout.options().dtype(attn_type));
    if (skip.defined()) {
      dv = torch::empty(dout.sizes(), v.options().memory_format(torch::MemoryFormat::Contiguous));
      dskip_cols = torch::empty({s.heads * s.head_dim}, skip.options());
      workspace = torch::empty({cuda::CombineWorkspaceBytes(DTypeOf(v), s)}, dout.options().dtype(torch::kUInt8));
    }
    const auto attn_dtype = dattn.defined() ? DTypeOf(dattn) : DTypeOf(v);
    Check(cuda::CombineMixersBackward(attn_dtype, DTypeOf(v), s, v.data_ptr(), DataOrNull(skip),
                                      is_attn.defined() ? is_attn.data_ptr<bool>() : nullptr, dout.data_ptr(),
                                      DataOrNull(dattn), dlin.data_ptr(), DataOrNull(dv), DataOrNull(dskip_cols), DataOrNull(workspace),
                                      StreamOf(dout)),
          "combine mixers backward");
    auto dskip = skip.defined() ? dskip_cols.view({s.heads, s.head_dim}).sum(1) : torch::Tensor();
    return {dattn, dlin, dv, dskip, torch::Tensor()};
  }

 private:
  static torch::Tensor Given(const torch::Tensor& t) { return t.numel() > 0 ? t : torch::Tensor(); }
};

// t with strides and pointer that allow 4-element accesses: as it is, or a packed copy.
torch::Tensor FourAligned(const torch::Tensor& t) {
  auto fits = [](const torch::Tensor& x) {
    if (x.stride(-1) != 1) return false;
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      if (x.stride(d) % 4 != 0) return false;
    }
    return reinterpret_cast<uintptr_t>(x.data_ptr()) % (4 * x.element_size()) == 0;
  };
  if (fits(t)) return t;
  auto c = t.contiguous();
  return fits(c) ? c : c.clone();
}

class ChunkPrepareFunction : public torch::autograd::Function<ChunkPrepareFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q_in,
                                                const torch::Tensor& k_in, const torch::Tensor& v_in,
                                                const torch::Tensor& dt_in, const torch::Tensor& to_end_in) {
    auto q = FourAligned(q_in), k = FourAligned(k_in), v = FourAligned(v_in);
    auto dt = dt_in.contiguous(), to_end = to_end_in.contiguous();
    auto s = ShapeOf(q, dt);
    s.q = StridesOf(q);
    s.k = StridesOf(k);
    s.v = StridesOf(v);
    std::vector<int64_t> out_shape = dt.sizes().vec();
    out_shape.push_back(q.size(3));
    auto q32 = torch::empty(out_shape, dt.options()), k32 = torch::empty(out_shape, dt.options()),
         u = torch::empty(out_shape, dt.options()), kend = torch::empty(out_shape, dt.options());
    Check(cuda::ChunkPrepareForward(DTypeOf(q), s, q.data_ptr(), k.data_ptr(), v.data_ptr(), dt.data_ptr(),
                                    to_end.data_ptr(), q32.data_ptr(), k32.data_ptr(), u.data_ptr(), kend.data_ptr(),
                                    StreamOf(q)),
          "chunk prepare forward");
    ctx->save_for_backward({k, v, dt, to_end});
    return {q32, k32, u, kend};
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &k = saved[0], &v = saved[1], &dt = saved[2], &to_end = saved[3];
    std::vector<torch::Tensor> g(4);
    for (int i = 0; i < 4; ++i) {
      if (grads[i].defined()) g[i] = grads[i].to(dt.scalar_type()).contiguous();
    }
    auto dq = torch::empty(k.sizes(), k.options().memory_format(torch::MemoryFormat::Contiguous));
    auto dk = torch::empty_like(dq), dv = torch::empty_like(dq);
    auto ddt = torch::empty_like(dt), dto_end = torch::empty_like(dt);
    auto s = ShapeOf(k, dt);
    s.k = StridesOf(k);
    s.v = StridesOf(v);
    Check(cuda::ChunkPrepareBackward(DTypeOf(k), s, k.data_ptr(), v.data_ptr(), dt.data_ptr(), to_end.data_ptr(),
                                     DataOrNull(g[0]), DataOrNull(g[1]), DataOrNull(g[2]), DataOrNull(g[3]),
                                     dq.data_ptr(), dk.data_ptr(),
                                     dv.data_ptr(), ddt.data_ptr(), dto_end.data_ptr(), StreamOf(k)),
          "chunk prepare backward");
    return {dq, dk, dv, ddt, dto_end};
  }

 private:
  static cuda::ChunkPrepShape ShapeOf(const torch::Tensor& x, const torch::Tensor& dt) {
    auto s = HeadsShapeOf<cuda::ChunkPrepShape>(x);
    s.padded = static_cast<int>(dt.size(2) * dt.size(3));
    return s;
  }
};

}  // namespace

bool ChunkPrepareAvailable(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& dt) {
  if (!q.is_cuda() || q.dim() != 4 || k.sizes() != q.sizes() || v.sizes() != q.sizes()) return false;
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) return false;
  const bool f64 = q.scalar_type() == torch::kFloat64;
  if (!(f64 || q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16)) return false;
  if (dt.scalar_type() != (f64 ? torch::kFloat64 : torch::kFloat32)) return false;
  const int64_t dh = q.size(3);
  return dh >= 4 && dh <= 128 && (dh & (dh - 1)) == 0 && q.size(1) <= std::numeric_limits<int>::max();
}

std::vector<torch::Tensor> ChunkPrepare(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& dt, const torch::Tensor& to_end) {
  TORCH_CHECK(ChunkPrepareAvailable(q, k, v, dt), "ChunkPrepare: no kernel for q ", q.sizes(), " ",
              q.scalar_type(), " on ", q.device(), " with dt ", dt.scalar_type());
  TORCH_CHECK(dt.dim() == 4 && dt.size(0) == q.size(0) && dt.size(1) == q.size(2) &&
                  dt.size(2) * dt.size(3) >= q.size(1) && to_end.sizes() == dt.sizes() &&
                  to_end.scalar_type() == dt.scalar_type() && dt.device() == q.device() &&
                  to_end.device() == q.device() &&
                  dt.size(2) * dt.size(3) <= std::numeric_limits<int>::max(),
              "ChunkPrepare: dt and to_end must be [B, H, N, C] with N C >= T, got ", dt.sizes(), " and ",
              to_end.sizes(), " for q ", q.sizes());
  return ChunkPrepareFunction::apply(q, k, v, dt, to_end);
}

torch::Tensor CombineMixers(const torch::Tensor& attn, const torch::Tensor& lin, const torch::Tensor& v,
                            const torch::Tensor& skip, const torch::Tensor& is_attn) {
  TORCH_CHECK(lin.is_cuda() && lin.dim() == 4 && lin.stride(3) == 1 && v.sizes() == lin.sizes() &&
                  v.stride(3) == 1 && v.device() == lin.device() &&
                  lin.size(1) <= std::numeric_limits<int>::max() &&
                  lin.size(2) * lin.size(3) <= std::numeric_limits<int>::max(),
              "CombineMixers: lin and v must be [B, T, H, dh] CUDA tensors with a packed last dimension, got ",
              lin.sizes(), " and ", v.sizes());
  TORCH_CHECK(attn.defined() == is_attn.defined(), "CombineMixers: attn and is_attn come together");
  const bool f64 = lin.scalar_type() == torch::kFloat64;
  auto fits = [&](const torch::Tensor& t) {
    return f64 ? t.scalar_type() == torch::kFloat64
               : t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kFloat32;
  };
  TORCH_CHECK((f64 || lin.scalar_type() == torch::kFloat32) && fits(v) && (!attn.defined() || fits(attn)) &&
                  (!skip.defined() || skip.scalar_type() == lin.scalar_type()),
              "CombineMixers: attn and v bf16 or fp32 with lin and skip fp32, or all fp64");
  torch::Tensor mask;
  if (attn.defined()) {
    TORCH_CHECK(attn.sizes() == lin.sizes() && attn.stride(3) == 1 && attn.device() == lin.device(),
                "CombineMixers: attn must be ", lin.sizes(), " with a packed last dimension, got ", attn.sizes());
    TORCH_CHECK(is_attn.scalar_type() == torch::kBool && is_attn.numel() == lin.size(0) * lin.size(1) &&
                    is_attn.device() == lin.device(),
                "CombineMixers: is_attn must be a bool [B, T] on lin's device");
    mask = is_attn.reshape({lin.size(0), lin.size(1)}).contiguous();
  }
  TORCH_CHECK(!skip.defined() || (skip.dim() == 1 && skip.size(0) == lin.size(2) && skip.is_contiguous() &&
                                  skip.device() == lin.device()),
              "CombineMixers: skip must be a packed [H] on lin's device");
  // autograd takes no undefined inputs: an absent one travels as an empty tensor.
  auto present = [&](const torch::Tensor& t) { return t.defined() ? t : lin.new_empty({0}); };
  return CombineMixersFunction::apply(present(attn), lin, v, present(skip),
                                      mask.defined() ? mask : torch::empty({0}, lin.options().dtype(torch::kBool)));
}

bool ChunkOutputAvailable(const torch::Tensor& q) {
  const bool f64 = q.scalar_type() == torch::kFloat64;
  return q.is_cuda() && (f64 || q.scalar_type() == torch::kFloat32) && q.dim() >= 2 &&
         cuda::ChunkOutputSupported(f64, static_cast<int>(q.size(-2)), static_cast<int>(q.size(-1)));
}

torch::Tensor ChunkOutput(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& u,
                          const torch::Tensor& g, const torch::Tensor& s0) {
  TORCH_CHECK(ChunkOutputAvailable(q), "ChunkOutput: no kernel for ", q.sizes(), " ", q.scalar_type(), " on ",
              q.device());
  const int64_t C = q.size(-2), D = q.size(-1);
  TORCH_CHECK(k.sizes() == q.sizes() && u.sizes() == q.sizes() && g.numel() == q.numel() / D &&
                  g.size(-1) == C && s0.numel() == q.numel() / C * D && s0.size(-1) == D && s0.size(-2) == D,
              "ChunkOutput: shapes do not match: q ", q.sizes(), ", k ", k.sizes(), ", u ", u.sizes(), ", g ",
              g.sizes(), ", s0 ", s0.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && u.scalar_type() == q.scalar_type() &&
                  g.scalar_type() == q.scalar_type() && s0.scalar_type() == q.scalar_type(),
              "ChunkOutput: all inputs must have q's dtype");
  return ChunkOutputFunction::apply(q, k, u, g, s0);
}

torch::Tensor GdnMatrix(const torch::Tensor& k, const torch::Tensor& g, const torch::Tensor& beta) {
  TORCH_CHECK(ChunkOutputAvailable(k), "GdnMatrix: no kernel for ", k.sizes(), " ", k.scalar_type(), " on ",
              k.device());
  const int64_t C = k.size(-2), D = k.size(-1);
  TORCH_CHECK(g.numel() == k.numel() / D && g.size(-1) == C && beta.sizes() == g.sizes() &&
                  g.scalar_type() == k.scalar_type() && beta.scalar_type() == k.scalar_type() &&
                  g.device() == k.device() && beta.device() == k.device(),
              "GdnMatrix: g and beta must be [..., ", C, "] of k's dtype and device, got ", g.sizes(), " and ",
              beta.sizes());
  return GdnMatrixFunction::apply(k, g, beta);
}

torch::Tensor GdnSolve(const torch::Tensor& l, const torch::Tensor& sv, const torch::Tensor& k,
                       const torch::Tensor& f) {
  TORCH_CHECK(ChunkOutputAvailable(k), "GdnSolve: no kernel for ", k.sizes(), " ", k.scalar_type(), " on ", k.device());
  const int64_t C = k.size(-2);
  TORCH_CHECK(sv.sizes() == k.sizes() && l.dim() == k.dim() && l.size(-1) == C && l.size(-2) == C &&
                  l.numel() / C == k.numel() / k.size(-1) && f.numel() == k.numel() / k.size(-1) && f.size(-1) == C,
              "GdnSolve: l must be [..., ", C, ", ", C, "], sv like k ", k.sizes(), " and f [..., ", C, "], got ",
              l.sizes(), ", ", sv.sizes(), " and ", f.sizes());
  for (const auto* t : {&l, &sv, &f}) {
    TORCH_CHECK(t->scalar_type() == k.scalar_type() && t->device() == k.device(),
                "GdnSolve: all operands must have k's dtype and device");
  }
  return GdnSolveFunction::apply(l, sv, k, f);
}

namespace {

// Checks GdnStates* operands: k_end [B, H, N, C, dh] with a kernel (ChunkOutputAvailable), x [B, H, N, C, 2dh]
// and the rest to match, packed, one dtype and device.
void CheckGdnOperands(const torch::Tensor& x, const torch::Tensor& k_end,
                      std::initializer_list<std::pair<const torch::Tensor*, std::vector<int64_t>>> expected) {
  TORCH_CHECK(ChunkOutputAvailable(k_end) && k_end.dim() == 5, "GdnStates: no kernel for k_end ", k_end.sizes(), " ",
              k_end.scalar_type(), " on ", k_end.device());
  for (const auto& [t, sizes] : expected) {
    if (!t->defined()) continue;
    TORCH_CHECK(t->sizes() == c10::IntArrayRef(sizes) && t->is_contiguous() && t->scalar_type() == x.scalar_type() &&
                    t->device() == x.device(),
                "GdnStates: an operand is ", t->sizes(), " ", t->scalar_type(), ", expected packed ", sizes, " ",
                x.scalar_type());
  }
}

}  // namespace

std::vector<torch::Tensor> GdnStatesKernelForward(const torch::Tensor& x, const torch::Tensor& k_end,
                                                  const torch::Tensor& decay, const torch::Tensor& initial) {
  const int64_t B = k_end.size(0), H = k_end.size(1), N = k_end.size(2), C = k_end.size(3), dh = k_end.size(4);
  CheckGdnOperands(
      x, k_end,
      {{&x, {B, H, N, C, 2 * dh}}, {&k_end, {B, H, N, C, dh}}, {&decay, {B, H, N}}, {&initial, {B, H, dh, dh}}});
  auto s0 = x.new_empty({B, H, N, dh, dh}), u = x.new_empty({B, H, N, C, dh}), last = x.new_empty({B, H, dh, dh});
  Check(cuda::GdnStatesForward(x.scalar_type() == torch::kFloat64, static_cast<int>(C), static_cast<int>(dh), B * H,
                               static_cast<int>(N), x.data_ptr(), k_end.data_ptr(), decay.data_ptr(),
                               DataOrNull(initial), s0.data_ptr(), u.data_ptr(), last.data_ptr(), StreamOf(x)),
        "gdn states forward");
  return {s0, u, last};
}

std::vector<torch::Tensor> GdnStatesKernelBackward(const torch::Tensor& x, const torch::Tensor& k_end,
                                                   const torch::Tensor& decay, const torch::Tensor& gs0,
                                                   const torch::Tensor& gu, const torch::Tensor& gfinal,
                                                   bool want_initial) {
  const int64_t B = k_end.size(0), H = k_end.size(1), N = k_end.size(2), C = k_end.size(3), dh = k_end.size(4);
  CheckGdnOperands(x, k_end,
                   {{&x, {B, H, N, C, 2 * dh}},
                    {&k_end, {B, H, N, C, dh}},
                    {&decay, {B, H, N}},
                    {&gs0, {B, H, N, dh, dh}},
                    {&gu, {B, H, N, C, dh}},
                    {&gfinal, {B, H, dh, dh}}});
  auto ds_next = x.new_empty({B, H, N, dh, dh}), du = x.new_empty({B, H, N, C, dh});
  auto dinitial = want_initial ? x.new_empty({B, H, dh, dh}) : torch::Tensor();
  Check(cuda::GdnStatesBackward(x.scalar_type() == torch::kFloat64, static_cast<int>(C), static_cast<int>(dh), B * H,
                                static_cast<int>(N), x.data_ptr(), k_end.data_ptr(), decay.data_ptr(), DataOrNull(gs0),
                                DataOrNull(gu), DataOrNull(gfinal), ds_next.data_ptr(), du.data_ptr(),
                                DataOrNull(dinitial), StreamOf(x)),
        "gdn states backward");
  return {ds_next, du, dinitial};
}

torch::Tensor FusedSiluMul(const torch::Tensor& gate, const torch::Tensor& x) {
  TORCH_CHECK(gate.is_cuda() && x.is_cuda() && gate.sizes() == x.sizes() && gate.scalar_type() == x.scalar_type() &&
                  x.dim() >= 1 && x.size(-1) <= std::numeric_limits<int>::max(),
              "FusedSiluMul: gate and x must be CUDA tensors of one shape and dtype, got ", gate.sizes(), " ",
              gate.scalar_type(), " and ", x.sizes(), " ", x.scalar_type());
  DTypeOf(x);  // bf16, fp32 or fp64
  return SiluMulFunction::apply(gate, x);
}

torch::Tensor FusedRope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && x.size(3) % 2 == 0, "FusedRope: x must be [B, T, H, dh] on the GPU");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(1) && cos.size(1) == x.size(3) / 2 &&
                  sin.sizes() == cos.sizes(),
              "FusedRope: cos and sin must be packed fp32 [T, dh/2]");
  return RopeFunction::apply(x, cos, sin);
}

torch::Tensor FusedRmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool bf16_out) {
  const bool f64 = x.scalar_type() == torch::kFloat64;
  TORCH_CHECK(x.is_cuda() && (f64 || x.scalar_type() == torch::kFloat32) && !(f64 && bf16_out),
              "FusedRmsNorm: x must be an fp32 or fp64 CUDA tensor (bf16 output only from fp32), got ",
              x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous() && cuda::NormColsSupported(static_cast<int>(x.size(-1))),
              "FusedRmsNorm: weight must be [", x.size(-1), "] of x's dtype, and at most 16384 wide");
  return RmsNormFunction::apply(x, weight, eps, bf16_out);
}

torch::Tensor CausalDepthwiseConv(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3, "CausalDepthwiseConv: x must be a [B, T, C] CUDA tensor");
  const auto wtype = x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == x.size(2) && weight.scalar_type() == wtype &&
                  weight.is_contiguous() && bias.dim() == 1 && bias.size(0) == x.size(2) &&
                  bias.scalar_type() == wtype && cuda::ConvWidthSupported(static_cast<int>(weight.size(1))),
              "CausalDepthwiseConv: weight must be [C, 1..8] and bias [C], ", wtype, ", for x of ", x.sizes());
  return CausalConvFunction::apply(x, weight, bias);
}

#else

bool HaveCudaTrainOps() { return false; }

torch::Tensor FusedRmsNorm(const torch::Tensor&, const torch::Tensor&, double, bool) {
  TORCH_CHECK(false, "FusedRmsNorm: this build has no CUDA kernels for the trainer");
}

torch::Tensor FusedRope(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "FusedRope: this build has no CUDA kernels for the trainer");
}

torch::Tensor CausalDepthwiseConv(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "CausalDepthwiseConv: this build has no CUDA kernels for the trainer");
}

bool ChunkOutputAvailable(const torch::Tensor&) { return false; }

torch::Tensor ChunkOutput(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          const torch::Tensor&) {
  TORCH_CHECK(false, "ChunkOutput: this build has no CUDA kernels for the trainer");
}

torch::Tensor GdnMatrix(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "GdnMatrix: this build has no CUDA kernels for the trainer");
}

torch::Tensor GdnSolve(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "GdnSolve: this build has no CUDA kernels for the trainer");
}

std::vector<torch::Tensor> GdnStatesKernelForward(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                  const torch::Tensor&) {
  TORCH_CHECK(false, "GdnStatesKernelForward: this build has no CUDA kernels for the trainer");
}

std::vector<torch::Tensor> GdnStatesKernelBackward(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                   const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                   bool) {
  TORCH_CHECK(false, "GdnStatesKernelBackward: this build has no CUDA kernels for the trainer");
}

torch::Tensor FusedSiluMul(const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "FusedSiluMul: this build has no CUDA kernels for the trainer");
}

bool ChunkPrepareAvailable(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  return false;
}

std::vector<torch::Tensor> ChunkPrepare(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                        const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "ChunkPrepare: this build has no CUDA kernels for the trainer");
}

torch::Tensor CombineMixers(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                            const torch::Tensor&) {
  TORCH_CHECK(false, "CombineMixers: this build has no CUDA kernels for the trainer");
}

#endif

}  // namespace oryx::train
