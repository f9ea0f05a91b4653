// Mamba-2 and Gated DeltaNet scans: step, token-by-token reference, and chunked parallel form.
//
// Both recurrences have the form S_t = a_t * M_t S_{t-1} + s_t k_t v_t^T with a_t = exp(log_decay_t),
// s_t = scale_t, and M_t = I (mamba2) or I - s_t k_t k_t^T (gdn); the output is S_t^T q_t.
#include "train/linear_mixers.h"

#include <ATen/autocast_mode.h>

#include "train/cuda_ops.h"

namespace oryx::train {

namespace {

class AutocastOff {
 public:
  explicit AutocastOff(at::DeviceType device) : device_(device), was_(at::autocast::is_autocast_enabled(device)) {
    at::autocast::set_autocast_enabled(device_, false);
  }
  ~AutocastOff() { at::autocast::set_autocast_enabled(device_, was_); }
  AutocastOff(const AutocastOff&) = delete;
  AutocastOff& operator=(const AutocastOff&) = delete;

 private:
  at::DeviceType device_;
  bool was_;
};

// Within a chunk: decay[t, s] = exp(G_t - G_s) for s <= t (else 0), with G the inclusive cumulative log
// decay. Masked before exp so that nothing overflows. g: [..., C] -> [..., C, C].
torch::Tensor CausalDecay(const torch::Tensor& g, bool strict) {
  const int64_t c = g.size(-1);
  auto diff = g.unsqueeze(-1) - g.unsqueeze(-2);  // [.., t, s] = G_t - G_s
  auto keep = torch::ones({c, c}, torch::dtype(torch::kBool).device(g.device())).tril(strict ? -1 : 0);
  return torch::where(keep, diff, torch::full({}, -INFINITY, diff.options())).exp();
}

// Mamba-2's state passing in closed form: with chunk decays a_n = exp(log_a_n) and contributions C_n,
// the state entering chunk n is S_n = exp(sum_{j<n} log_a_j) S_0 + sum_{m<n} exp(sum_{m<j<n} log_a_j) C_m.
// One batched product over all chunks instead of a sequential loop; each exponent is summed over its own
// span (not a difference of two long prefix sums), so long sequences lose no precision.
// log_a [B,H,N], contribution [B,H,N,dh,dh], initial [B,H,dh,dh] or undefined (zero: its term is skipped,
// which in training saves a product, a sum and their backwards over all N+1 states)
// -> (starts [B,H,N,dh,dh], final state).
std::pair<torch::Tensor, torch::Tensor> PassStatesLinear(const torch::Tensor& log_a, const torch::Tensor& contribution,
                                                         const torch::Tensor& initial) {
  const int64_t N = log_a.size(-1), dh = contribution.size(-1);
  auto opts = torch::TensorOptions().dtype(torch::kBool).device(log_a.device());
  // span[n, m] = sum_{m<j<n} log_a_j for n in 0..N, m < n: the inclusive cumsum over j of log_a_j [j > m].
  auto after = torch::ones({N, N}, opts).tril(-1);                          // [j, m]: j > m
  auto z = torch::where(after, log_a.unsqueeze(-1), torch::zeros({}, log_a.options()));  // [B,H,j,m]
  auto span = torch::cat({torch::zeros_like(z.narrow(-2, 0, 1)), z.cumsum(-2)}, -2);     // [B,H,N+1,m]
  auto before = torch::ones({N + 1, N}, opts).tril(-1);                     // [n, m]: m < n
  auto weights = torch::where(before, span, torch::full({}, -INFINITY, span.options())).exp();
  auto flat = contribution.flatten(-2);  // [B,H,N,dh*dh]
  torch::Tensor decay_from_start;         // [B,H,N+1]: exp(sum_{j<n} log_a_j)
  if (initial.defined()) {
    decay_from_start = torch::cat({torch::zeros_like(log_a.narrow(-1, 0, 1)), log_a.cumsum(-1)}, -1).exp();
  }
  // The starts and the final state as two products, not one split afterwards: the starts come out packed
  // (the chunk output takes them without a copy), and the final state, unused in training, takes no
  // backward. (split, not narrow: a narrow's backward writes a zero tensor of its input's size.)
  const auto rows = weights.split({N, 1}, -2);
  auto states = [&](int part, int64_t first, int64_t count) {  // [B,H,count,dh,dh]
    auto s = torch::matmul(rows[part], flat);
    if (initial.defined()) {
      s = s + decay_from_start.narrow(-1, first, count).unsqueeze(-1) * initial.flatten(-2).unsqueeze(2);
    }
    return s.unflatten(-1, {dh, dh});
  };
  return {states(0, 0, N), states(1, N, 1).squeeze(2)};
}

// GDN's chunk-to-chunk state passing as one autograd function (the math: GdnStatesForward in
// train/cuda_train_kernels.h). Its recurrence runs in one CUDA kernel each way where there is one, else as
// a loop of LibTorch ops; either way autograd sees one node, not a dozen per chunk. The backward's
// sequential part yields the state's gradient after each chunk; the weight-like gradients then come from
// products over all chunks at once.
// Inputs: x [B,H,N,C,2dh] = [U0 W], k_end [B,H,N,C,dh], decay [B,H,N] (a_n), initial [B,H,dh,dh] (or an
// empty tensor: zero). Outputs: s0 [B,H,N,dh,dh], u [B,H,N,C,dh], the final state [B,H,dh,dh].
class GdnStatesFunction : public torch::autograd::Function<GdnStatesFunction> {
 public:
  static torch::autograd::tensor_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x_in,
                                              const torch::Tensor& k_end_in, const torch::Tensor& decay_in,
                                              const torch::Tensor& initial_in) {
    auto x = x_in.contiguous(), k_end = k_end_in.contiguous(), decay = decay_in.contiguous();
    const auto initial = initial_in.numel() > 0 ? initial_in.contiguous() : torch::Tensor();
    torch::Tensor s0, u, last;
    if (ChunkOutputAvailable(k_end)) {
      const auto out = GdnStatesKernelForward(x, k_end, decay, initial);
      s0 = out[0], u = out[1], last = out[2];
    } else {
      const int64_t B = x.size(0), H = x.size(1), N = x.size(2), C = x.size(3), dh = x.size(4) / 2;
      s0 = x.new_empty({B, H, N, dh, dh});
      u = x.new_empty({B, H, N, C, dh});
      last = initial.defined() ? initial.clone() : x.new_zeros({B, H, dh, dh});
      const auto u0 = x.narrow(-1, 0, dh), w = x.narrow(-1, dh, dh);
      for (int64_t n = 0; n < N; ++n) {
        s0.select(2, n).copy_(last);
        auto un = u.select(2, n);
        torch::sub_out(un, u0.select(2, n), torch::matmul(w.select(2, n), last));
        last = decay.select(2, n).unsqueeze(-1).unsqueeze(-1) * last +
               torch::matmul(k_end.select(2, n).transpose(-1, -2), un);
      }
    }
    ctx->save_for_backward({x, k_end, decay, s0, u});
    ctx->saved_data["initial"] = initial.defined();
    return {s0, u, last};
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &k_end = saved[1], &decay = saved[2], &s0 = saved[3], &u = saved[4];
    const bool has_initial = ctx->saved_data["initial"].toBool();
    auto packed = [](const torch::Tensor& g) { return g.defined() ? g.contiguous() : g; };
    const auto gs0 = packed(grads[0]), gu = packed(grads[1]), gfinal = packed(grads[2]);
    torch::Tensor ds_next, du, dinitial;
    if (ChunkOutputAvailable(k_end)) {
      const auto out = GdnStatesKernelBackward(x, k_end, decay, gs0, gu, gfinal, has_initial);
      ds_next = out[0], du = out[1], dinitial = out[2];
    } else {
      const int64_t N = x.size(2), dh = x.size(4) / 2;
      ds_next = torch::empty_like(s0);
      du = torch::empty_like(u);
      auto ds = gfinal.defined() ? gfinal : torch::zeros_like(s0.select(2, 0));
      const auto w = x.narrow(-1, dh, dh);
      for (int64_t n = N - 1; n >= 0; --n) {
        ds_next.select(2, n).copy_(ds);
        auto dun = du.select(2, n);
        torch::matmul_out(dun, k_end.select(2, n), ds);
        if (gu.defined()) dun.add_(gu.select(2, n));
        ds = decay.select(2, n).unsqueeze(-1).unsqueeze(-1) * ds - torch::matmul(w.select(2, n).transpose(-1, -2), dun);
        if (gs0.defined()) ds = ds + gs0.select(2, n);
      }
      if (has_initial) dinitial = ds;
    }
    // S_n+1 = a_n S_n + Ke_n^T u_n and u_n = U0_n - W_n S_n, with dS_n+1 and du_n known for every chunk:
    auto dk_end = torch::matmul(u, ds_next.transpose(-1, -2));
    auto ddecay = (ds_next * s0).sum({-2, -1});
    auto dw = -torch::matmul(du, s0.transpose(-1, -2));
    return {torch::cat({du, dw}, -1), dk_end, ddecay, has_initial ? dinitial : torch::Tensor()};
  }
};

// -> (s0, u, final state) of GdnStatesFunction; an undefined initial state is zero.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> PassStatesGdn(const torch::Tensor& x,
                                                                      const torch::Tensor& k_end,
                                                                      const torch::Tensor& decay,
                                                                      const torch::Tensor& initial) {
  auto out = GdnStatesFunction::apply(x, k_end, decay, initial.defined() ? initial : x.new_empty({0}));
  return {out[0], out[1], out[2]};
}

}  // namespace

ScanResult ScanStep(ScanKind kind, const torch::Tensor& state, const torch::Tensor& q, const torch::Tensor& k,
                    const torch::Tensor& v, const torch::Tensor& log_decay, const torch::Tensor& scale) {
  // state [B,H,dh,dh]; q,k,v [B,H,dh]; log_decay, scale [B,H]
  auto a = log_decay.exp().unsqueeze(-1).unsqueeze(-1);  // [B,H,1,1]
  auto s = scale.unsqueeze(-1);                          // [B,H,1]
  torch::Tensor next;
  if (kind == ScanKind::kMamba2) {
    next = a * state + (s * k).unsqueeze(-1) * v.unsqueeze(-2);
  } else {
    // alpha (S - beta k (k^T S)) + beta k v^T
    auto kts = torch::einsum("bhi,bhij->bhj", {k, state});  // k^T S: [B,H,dh]
    next = a * (state - (s * k).unsqueeze(-1) * kts.unsqueeze(-2)) + (s * k).unsqueeze(-1) * v.unsqueeze(-2);
  }
  auto out = torch::einsum("bhij,bhi->bhj", {next, q});  // S^T q
  return {out, next};
}

ScanResult ScanRecurrent(ScanKind kind, const ScanInputs& in, const torch::Tensor& state) {
  const int64_t t_len = in.q.size(1);
  torch::Tensor s = state;
  std::vector<torch::Tensor> outs;
  outs.reserve(t_len);
  for (int64_t t = 0; t < t_len; ++t) {
    auto r = ScanStep(kind, s, in.q.select(1, t), in.k.select(1, t), in.v.select(1, t),
                      in.log_decay.select(1, t), in.scale.select(1, t));
    outs.push_back(r.out);
    s = r.state;
  }
  return {torch::stack(outs, 1), s};
}

ScanResult ScanChunked(ScanKind kind, const ScanInputs& in, const torch::Tensor& state, int64_t chunk) {
  // Under CUDA autocast every product here would first copy its fp32 operands to bf16 (measured: a tenth
  // of a training step's kernel time with the copies' backward); they run in fp32 (TF32 where allowed).
  AutocastOff autocast_off(at::kCUDA);
  // Work head-major in fp32 (fp64 when given fp64, for gradient checks), every chunk at once:
  // [B, H, N, C, dh] and [B, H, N, C] with N chunks of C tokens. Only GDN's passing of the state from chunk
  // to chunk is sequential (a few small ops per chunk).
  const auto dtype = in.q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), dh = in.q.size(3);
  const int64_t C = std::min(chunk, T), N = (T + C - 1) / C, pad = N * C - T;
  // Padding tokens decay nothing (log a = 0) and write nothing (scale = 0): the state passes unchanged.
  auto chunks = [&](const torch::Tensor& x) {  // [B,T,H,...] -> [B,H,N,C,...]
    // One copy that converts and transposes (to(), then reshape() of the transposed view, made two).
    auto t = x.transpose(1, 2).to(dtype, /*non_blocking=*/false, /*copy=*/false, torch::MemoryFormat::Contiguous);
    if (pad > 0) {
      std::vector<int64_t> padding = x.dim() == 4 ? std::vector<int64_t>{0, 0, 0, pad} : std::vector<int64_t>{0, pad};
      t = torch::constant_pad_nd(t, padding, 0);
    }
    std::vector<int64_t> shape = {B, H, N, C};
    if (x.dim() == 4) shape.push_back(dh);
    return t.reshape(shape);
  };
  auto sc = chunks(in.scale);
  const auto initial = state.defined() ? state.to(dtype) : torch::Tensor();
  auto g = chunks(in.log_decay).cumsum(-1);  // [B,H,N,C] G_t = sum_{r<=t in chunk} log a_r
  auto g_last = g.narrow(-1, C - 1, 1);      // [B,H,N,1]
  auto to_end = (g_last - g).exp();          // decay from t to chunk end

  // u, the values that enter the state, is U0 - W S0 with S0 the state at the chunk's start (W = 0 for
  // mamba2). GDN's WY/UT form: (I + diag(beta) A) U = diag(beta) (V - diag(gamma) K S0) with
  // A[t,s] = gamma_t/gamma_s k_t.k_s for s < t (gamma = exp(G), the decay from the chunk's start to t),
  // solved once for both right-hand sides.
  torch::Tensor q, k, sv, k_end;  // sv = diag(scale) V (mamba2's U0), k_end = diag(to_end) K
  // GDN's q and k come normalised in fp32 and its v raw: v converted to their dtype so that one kernel
  // serves (a conversion of v is cheaper than the chunk copies and products it saves, each way).
  const auto v_in = kind == ScanKind::kGdn ? in.v.to(in.q.scalar_type()) : in.v;
  if (ChunkPrepareAvailable(in.q, in.k, v_in, sc)) {
    // One kernel each way for the chunk copies and both products (on the GPU).
    const auto parts = ChunkPrepare(in.q, in.k, v_in, sc, to_end);
    q = parts[0], k = parts[1], sv = parts[2], k_end = parts[3];
  } else {
    q = chunks(in.q), k = chunks(in.k);
    sv = sc.unsqueeze(-1) * chunks(in.v);
    k_end = to_end.unsqueeze(-1) * k;
  }
  torch::Tensor wu;  // gdn: [U0 W]
  if (kind == ScanKind::kGdn) {
    // L = diag(beta) A, strictly lower triangular: one kernel each way on the GPU.
    auto l = ChunkOutputAvailable(k)
                 ? GdnMatrix(k, g, sc)
                 : sc.unsqueeze(-1) * torch::matmul(k, k.transpose(-1, -2)) * CausalDecay(g, /*strict=*/true);
    // [U0 W] = (I + L)^-1 [diag(beta) V, diag(beta e^G) K]: one kernel each way on the GPU, which also
    // builds the right-hand side (LibTorch's batched solve goes through cuBLAS's column-major trsm).
    auto f = sc * g.exp();
    wu = ChunkOutputAvailable(k)
             ? GdnSolve(l, sv, k, f)
             : torch::linalg_solve_triangular(torch::eye(C, q.options()) + l, torch::cat({sv, f.unsqueeze(-1) * k}, -1),
                                              /*upper=*/false, /*left=*/true,
                                              /*unitriangular=*/true);
  }
  torch::Tensor s0;  // [B,H,N,dh,dh]: the state entering each chunk
  torch::Tensor s;   // the final state
  torch::Tensor u;   // [B,H,N,C,dh]: what each token writes into the state, U0 - W S0
  if (kind == ScanKind::kMamba2) {
    // State entering each chunk: S_n+1 = a_n S_n + K_n^T diag(to_end) U0_n.
    auto contribution = torch::matmul(k_end.transpose(-1, -2), sv);  // [B,H,N,dh,dh]
    std::tie(s0, s) = PassStatesLinear(g_last.squeeze(-1), contribution, initial);
    u = sv;
  } else {
    // GDN's passing is not linear in the state (the W_n S_n term): chunk by chunk, in one autograd node.
    std::tie(s0, u, s) = PassStatesGdn(wu, k_end, g_last.squeeze(-1).exp(), initial);
  }
  // out_t = gamma_t S0^T q_t + sum_{s<=t} gamma_t/gamma_s (q_t.k_s) u_s: one kernel each way on the GPU.
  auto out = ChunkOutputAvailable(q)
                 ? ChunkOutput(q, k, u, g, s0)
                 : g.exp().unsqueeze(-1) * torch::matmul(q, s0) +
                       torch::matmul(torch::matmul(q, k.transpose(-1, -2)) * CausalDecay(g, /*strict=*/false), u);
  // [B,H,N,C,dh]
  out = out.reshape({B, H, N * C, dh});
  if (pad > 0) out = out.narrow(2, 0, T);  // (a narrow to the whole length would still copy in the backward)
  // [B,T,H,dh] as a view of the head-major layout: the caller's next op reads it where it lies (the
  // trainer's CombineMixers does; a copy to pack it was a forward and a backward pass over the output).
  return {out.transpose(1, 2), s};
}

}  // namespace oryx::train
