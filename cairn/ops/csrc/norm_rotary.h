// The attention layer's input op, included at the end of norm.cpp (one library, one build; it uses norm.cpp's
// norm_row and ATen's sum order).
//
// norm_rotary_write does for a step's q, k and v (bf16 on CPU) what the gated attention layer did in about 40 ATen
// calls per layer: the q and k RMSNorms over head_dim, rotary on both (the first rotary_dim dims in halves), and the
// writes of the rotated k and of v into the layer's KV pages at each token's slot. It gives the reference's bits
// (cairn/ops/attention.py: norm_rotary_write): the norm is norm_row, and rotary rounds where ATen's bf16 arithmetic
// rounds, once per product and once for their sum:
//
//     out[i] = bf16(bf16(n[i] * cos[i]) + bf16(r[i] * sin[i]))     r = [-n[half:rd], n[:half]], i < rotary_dim
//     out[i] = n[i]                                                i >= rotary_dim
//
// (a product of two bf16 values is exact in fp32, so no contraction or order can change it). What it is not: a
// kernel for the plain attention of the Mamba2 hybrids (no q / k norm there), nor for fp32 / fp16.

#include <cstring>

namespace {

// rotary on one normed row n [D] into dst (may be a page of the pool): the first rd dims rotated in halves
void rotate_row(const at::BFloat16* n, const at::BFloat16* c, const at::BFloat16* s, int64_t rd, int64_t D,
                at::BFloat16* dst) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < rd; ++i) {
    const float r = i < half ? -float(n[i + half]) : float(n[i - half]);
    const float a = float(c10::BFloat16(float(n[i]) * float(c[i])));
    const float b = float(c10::BFloat16(r * float(s[i])));
    dst[i] = c10::BFloat16(a + b);
  }
  for (int64_t i = rd; i < D; ++i) dst[i] = n[i];
}

template <typename W>
void norm_rotate(const at::BFloat16* x, const W* w, bool zero_centred, int64_t D, float eps, int64_t lanes,
                 const at::BFloat16* c, const at::BFloat16* s, int64_t rd, float* buf, at::BFloat16* normed,
                 at::BFloat16* dst) {
  norm_row(x, static_cast<const at::BFloat16*>(nullptr), nullptr, normed, w, zero_centred, D, eps, lanes, buf);
  rotate_row(normed, c, s, rd, D, dst);
}

}  // namespace

// q [T, H, D] and k, v [T, KVH, D] bf16 (head rows contiguous, evenly spaced: q may be a strided view);
// q_weight, k_weight [D] (bf16 or fp32); cos, sin [T, rd] bf16; k_pool, v_pool [pages, page_size, KVH, D]
// bf16 contiguous; slots [T] long (flat token index into the pool). Writes rotate(norm(k)) and v at each
// token's slot; returns rotate(norm(q)) [T, H, D].
torch::Tensor norm_rotary_write(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& q_weight, const torch::Tensor& k_weight, double eps,
                                bool zero_centred, const torch::Tensor& cos, const torch::Tensor& sin,
                                torch::Tensor k_pool, torch::Tensor v_pool, const torch::Tensor& slots,
                                int64_t lanes) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), rd = cos.size(1);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == T && k.size(2) == D,
              "norm_rotary_write: q [T, H, D], k and v [T, KVH, D]");
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q, &k, &v, &cos, &sin, &k_pool, &v_pool})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "norm_rotary_write: bf16 tensors");
  TORCH_CHECK(q_weight.scalar_type() == k_weight.scalar_type() && q_weight.numel() == D && k_weight.numel() == D &&
              q_weight.is_contiguous() && k_weight.is_contiguous() &&
              (q_weight.scalar_type() == at::kBFloat16 || q_weight.scalar_type() == at::kFloat),
              "norm_rotary_write: weights [D]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.is_contiguous() && sin.is_contiguous() &&
              rd % 2 == 0 && rd <= D, "norm_rotary_write: cos, sin [T, rd]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() &&
              k_pool.dim() == 4 && k_pool.size(2) == KVH && k_pool.size(3) == D, "norm_rotary_write: pools");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T && slots.is_contiguous(),
              "norm_rotary_write: slots [T] long");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == D && v.stride(1) == D,
              "norm_rotary_write: contiguous head rows");
  const int64_t pool_tokens = k_pool.size(0) * k_pool.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < pool_tokens, "norm_rotary_write: slot out of range");
  auto out = torch::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const auto *qp = q.data_ptr<at::BFloat16>(), *kp = k.data_ptr<at::BFloat16>(), *vp = v.data_ptr<at::BFloat16>();
  const auto *cp = cos.data_ptr<at::BFloat16>(), *snp = sin.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  auto *kpp = k_pool.data_ptr<at::BFloat16>(), *vpp = v_pool.data_ptr<at::BFloat16>();
  const bool bf16_weight = q_weight.scalar_type() == at::kBFloat16;
  const float e = float(eps);
  auto tokens = [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(2 * D);
    std::vector<at::BFloat16> normed(D);
    for (int64_t t = lo; t < hi; ++t) {
      const at::BFloat16 *c = cp + t * rd, *s = snp + t * rd;
      at::BFloat16 *k_dst = kpp + sp[t] * KVH * D, *v_dst = vpp + sp[t] * KVH * D;
      for (int64_t h = 0; h < H + KVH; ++h) {
        const bool is_q = h < H;
        const at::BFloat16* x = is_q ? qp + t * q.stride(0) + h * q.stride(1) : kp + t * k.stride(0) + (h - H) * D;
        at::BFloat16* dst = is_q ? op + (t * H + h) * D : k_dst + (h - H) * D;
        if (bf16_weight)
          norm_rotate(x, (is_q ? q_weight : k_weight).data_ptr<at::BFloat16>(), zero_centred, D, e, lanes, c, s, rd,
                      buf.data(), normed.data(), dst);
        else
          norm_rotate(x, (is_q ? q_weight : k_weight).data_ptr<float>(), zero_centred, D, e, lanes, c, s, rd,
                      buf.data(), normed.data(), dst);
      }
      for (int64_t h = 0; h < KVH; ++h)
        std::memcpy(v_dst + h * D, vp + t * v.stride(0) + h * D, D * sizeof(at::BFloat16));
    }
  };
  if (T * (H + KVH) * D <= 16384) tokens(0, T);  // a decode step's tokens: no parallel region
  else at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>((H + KVH) * D, 1)), tokens);
  return out;
}
