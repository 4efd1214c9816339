// Python bindings of deepinfer's CPU extension (one module, one build): tensor checks, output
// allocation and the split of work over torch's intra-op threads. Kernels:
// quantized_linear_avx2.cpp (block-quantized linear), f32_linear_avx2.cpp (batch-invariant
// float32 linear), rms_norm_avx2.cpp (fused residual add + RMSNorm) and paged_attention_cpu.cpp
// (paged decode attention).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace deepinfer {  // defined in quantized_linear_avx2.cpp

void q4_1_linear_rows(const float* x, int64_t num_rows, int64_t ldx, const uint8_t* codes,
                      const uint16_t* scales, const uint16_t* mins, int64_t in_features,
                      float* y, int64_t n_begin, int64_t n_end, int64_t num_out,
                      bool allow_avx512, bool row_invariant);
void q8_0_linear_rows(const float* x, int64_t num_rows, int64_t ldx, const int8_t* codes,
                      const uint16_t* scales, int64_t in_features, float* y, int64_t n_begin,
                      int64_t n_end, int64_t num_out, bool allow_avx512, bool row_invariant);
bool avx512_available();

// defined in f32_linear_avx2.cpp
void f32_linear_rows(const float* x, int64_t num_rows, int64_t ldx, const float* w, int64_t K,
                     float* y, int64_t n_begin, int64_t n_end, int64_t ldy);

// defined in rms_norm_avx2.cpp
void rms_norm_rows(float* x, int64_t ldx, const float* residual, int64_t ldr,
                   const float* weight, float eps, float* out, int64_t ldo, int64_t hidden,
                   int64_t row_begin, int64_t row_end);

// defined in paged_attention_cpu.cpp
void paged_decode_attention_tasks(const float* query, int64_t q_seq, int64_t q_head,
                                  const float* key_cache, const float* value_cache,
                                  const int32_t* block_tables, int64_t bt_stride,
                                  const int32_t* table_rows, const int32_t* seq_lens,
                                  int64_t block_size, int64_t num_kv_heads, int64_t num_q_heads,
                                  int64_t head_dim, float scale, float* out, int64_t task_begin,
                                  int64_t task_end);

}  // namespace deepinfer

namespace {

constexpr int64_t kBlock = 32;

// Checks x: [M, K] float32 CPU with unit stride along K.
void check_x(const torch::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) == in_features && x.stride(1) == 1, "x must be [M, ", in_features,
              "] with unit stride along K, got ", x.sizes(), " strides ", x.strides());
}

void check_scales(const torch::Tensor& scales, int64_t num_out, int64_t num_blocks) {
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat16 &&
                  scales.dim() == 2 && scales.size(0) == num_out && scales.size(1) == num_blocks,
              "scales/mins must be contiguous float16 [N, K/32], got ", scales.sizes());
}

// Runs rows_fn(n_begin, n_end) over [0, num_out) on torch's threads.
template <class F>
void parallel_rows(int64_t num_out, int64_t num_rows, int64_t in_features, const F& rows_fn) {
  // One output row costs in_features * num_rows FMAs; keep each task above ~64k of them.
  const int64_t grain = std::max<int64_t>(16, 65536 / (in_features * num_rows));
  at::parallel_for(0, num_out, grain, rows_fn);
}

// x [M, K] float32, codes [N, K/2] uint8, scales and mins [N, K/32] float16 -> y [M, N].
torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales, const torch::Tensor& mins,
                          bool allow_avx512, bool row_invariant) {
  const int64_t num_out = codes.size(0), num_blocks = scales.size(1);
  const int64_t in_features = num_blocks * kBlock, num_rows = x.size(0);
  check_x(x, in_features);
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == torch::kUInt8 && codes.dim() == 2 &&
                  codes.size(1) == in_features / 2,
              "Q4_1 codes must be contiguous uint8 [N, K/2], got ", codes.sizes());
  check_scales(scales, num_out, num_blocks);
  check_scales(mins, num_out, num_blocks);
  auto y = torch::empty({num_rows, num_out}, x.options());
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* m = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  parallel_rows(num_out, num_rows, in_features, [&](int64_t begin, int64_t end) {
    deepinfer::q4_1_linear_rows(x.data_ptr<float>(), num_rows, x.stride(0),
                                codes.data_ptr<uint8_t>(), s, m, in_features,
                                y.data_ptr<float>(), begin, end, num_out, allow_avx512,
                                row_invariant);
  });
  return y;
}

// x [M, K] float32, codes [N, K] int8, scales [N, K/32] float16 -> y [M, N].
torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales, bool allow_avx512,
                          bool row_invariant) {
  const int64_t num_out = codes.size(0), num_blocks = scales.size(1);
  const int64_t in_features = num_blocks * kBlock, num_rows = x.size(0);
  check_x(x, in_features);
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == torch::kInt8 && codes.dim() == 2 &&
                  codes.size(1) == in_features,
              "Q8_0 codes must be contiguous int8 [N, K], got ", codes.sizes());
  check_scales(scales, num_out, num_blocks);
  auto y = torch::empty({num_rows, num_out}, x.options());
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  parallel_rows(num_out, num_rows, in_features, [&](int64_t begin, int64_t end) {
    deepinfer::q8_0_linear_rows(x.data_ptr<float>(), num_rows, x.stride(0),
                                codes.data_ptr<int8_t>(), s, in_features, y.data_ptr<float>(),
                                begin, end, num_out, allow_avx512, row_invariant);
  });
  return y;
}

// x [M, K] float32, weight [N, K] contiguous float32 -> y [M, N], each row in the fixed order
// of f32_linear_avx2.cpp (batch-invariant).
torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "weight must be a contiguous float32 CPU [N, K] tensor, got ", weight.sizes());
  const int64_t num_out = weight.size(0), in_features = weight.size(1), num_rows = x.size(0);
  check_x(x, in_features);
  auto y = torch::empty({num_rows, num_out}, x.options());
  parallel_rows(num_out, num_rows, in_features, [&](int64_t begin, int64_t end) {
    deepinfer::f32_linear_rows(x.data_ptr<float>(), num_rows, x.stride(0),
                               weight.data_ptr<float>(), in_features, y.data_ptr<float>(), begin,
                               end, num_out);
  });
  return y;
}

void check_rows(const torch::Tensor& t, const char* name, int64_t hidden) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.device().is_cpu() &&
                  t.size(1) == hidden && t.stride(1) == 1,
              name, " must be a 2-D float32 CPU tensor [T, ", hidden,
              "] with unit stride along H, got ", t.sizes(), " strides ", t.strides());
}

// x [T, H] float32, weight [H] float32 -> normed [T, H]. With a residual [T, H], x is
// overwritten by x + residual first (in place) and the norm is taken of that sum.
torch::Tensor rms_norm(torch::Tensor x, const torch::Tensor& weight, double eps,
                       const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, H], got ", x.sizes());
  const int64_t num_rows = x.size(0), hidden = x.size(1);
  check_rows(x, "x", hidden);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous() &&
                  weight.scalar_type() == torch::kFloat32,
              "weight must be contiguous float32 [", hidden, "], got ", weight.sizes());
  const float* res = nullptr;
  int64_t ldr = 0;
  if (residual.has_value()) {
    check_rows(*residual, "residual", hidden);
    TORCH_CHECK(residual->size(0) == num_rows, "residual must have ", num_rows, " rows");
    res = residual->data_ptr<float>();
    ldr = residual->stride(0);
  }
  auto out = torch::empty({num_rows, hidden}, x.options());
  float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto body = [&](int64_t begin, int64_t end) {
    deepinfer::rms_norm_rows(xp, ldx, res, ldr, w, static_cast<float>(eps), op, hidden, hidden,
                             begin, end);
  };
  // ~3 flops per element: only large prefill batches are worth the threads.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(hidden, 1));
  if (num_rows <= grain) {
    body(0, num_rows);
  } else {
    at::parallel_for(0, num_rows, grain, body);
  }
  return out;
}

// query [T, Hq, D] float32 (unit stride along D), kv_cache [2, num_blocks, block_size, Hkv, D]
// contiguous float32, block_tables [S, max_blocks] int32, seq_lens [S] int32 (each >= 1)
// -> out [T, Hq, D] contiguous. Without query_start_loc, T = S: one new token per sequence, at
// seq_len - 1. With query_start_loc [S + 1] int32 (verify rows of 1 + k tokens), sequence s
// owns query rows query_start_loc[s] .. query_start_loc[s + 1] - 1, its last new tokens: row t
// attends causally to the first seq_lens[s] - (query_start_loc[s + 1] - 1 - t) positions.
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     const c10::optional<torch::Tensor>& query_start_loc) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == torch::kFloat32 &&
                  query.device().is_cpu() && query.stride(2) == 1,
              "query must be float32 CPU [T, Hq, D] with unit stride along D, got ",
              query.sizes(), " strides ", query.strides());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == torch::kFloat32 && kv_cache.device().is_cpu(),
              "kv_cache must be contiguous float32 CPU [2, num_blocks, block_size, Hkv, D], got ",
              kv_cache.sizes());
  const int64_t num_rows = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_seqs = seq_lens.numel();
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_kv_heads > 0 && num_q_heads % num_kv_heads == 0,
              "query heads ", num_q_heads, " x ", head_dim, " do not fit kv heads ", num_kv_heads,
              " x ", kv_cache.size(4));
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() &&
                  seq_lens.scalar_type() == torch::kInt32 && seq_lens.device().is_cpu(),
              "seq_lens must be contiguous int32 CPU [S], got ", seq_lens.sizes());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt32 &&
                  block_tables.size(0) == num_seqs && block_tables.stride(1) == 1 &&
                  block_tables.device().is_cpu(),
              "block_tables must be int32 CPU [S, max_blocks] with unit inner stride, got ",
              block_tables.sizes());
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.stride(0);
  // per query row: its sequence's block-table row and the positions it attends to
  std::vector<int32_t> row_table, row_len;
  if (query_start_loc.has_value()) {
    const torch::Tensor& starts = *query_start_loc;
    TORCH_CHECK(starts.dim() == 1 && starts.size(0) == num_seqs + 1 && starts.is_contiguous() &&
                    starts.scalar_type() == torch::kInt32 && starts.device().is_cpu(),
                "query_start_loc must be contiguous int32 CPU [S + 1], got ", starts.sizes());
    const int32_t* loc = starts.data_ptr<int32_t>();
    TORCH_CHECK(loc[0] == 0 && loc[num_seqs] == num_rows, "query_start_loc must run from 0 to ",
                num_rows, " (the query rows), got ", loc[0], " .. ", loc[num_seqs]);
    row_table.resize(num_rows);
    row_len.resize(num_rows);
    for (int64_t s = 0; s < num_seqs; ++s) {
      TORCH_CHECK(loc[s] <= loc[s + 1] && loc[s + 1] - loc[s] <= lens[s],
                  "sequence ", s, " has ", loc[s + 1] - loc[s], " new tokens but seq_len ",
                  lens[s]);
      for (int32_t t = loc[s]; t < loc[s + 1]; ++t) {
        row_table[t] = static_cast<int32_t>(s);
        row_len[t] = lens[s] - (loc[s + 1] - 1 - t);
      }
    }
  } else {
    TORCH_CHECK(num_seqs == num_rows, "seq_lens has ", num_seqs, " sequences for ", num_rows,
                " query rows; pass query_start_loc for rows of several tokens");
  }
  int64_t total_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {  // bounds: every block read must exist
    const int64_t needed = (static_cast<int64_t>(lens[s]) + block_size - 1) / block_size;
    TORCH_CHECK(lens[s] >= 0 && needed <= block_tables.size(1), "seq_lens[", s, "] = ", lens[s],
                " exceeds the block table");
    for (int64_t b = 0; b < needed; ++b) {
      const int32_t id = tables[s * bt_stride + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " out of range");
    }
  }
  const int32_t* task_lens = row_len.empty() ? lens : row_len.data();
  const int32_t* table_rows = row_table.empty() ? nullptr : row_table.data();
  for (int64_t t = 0; t < num_rows; ++t) total_len += task_lens[t];
  auto out = torch::empty({num_rows, num_q_heads, head_dim}, query.options());
  const float* kc = kv_cache.data_ptr<float>();
  const float* vc = kc + num_blocks * block_size * num_kv_heads * head_dim;
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t q_seq = query.stride(0), q_head = query.stride(1);
  const auto body = [&](int64_t begin, int64_t end) {
    deepinfer::paged_decode_attention_tasks(q, q_seq, q_head, kc, vc, tables, bt_stride,
                                            table_rows, task_lens, block_size, num_kv_heads,
                                            num_q_heads, head_dim, static_cast<float>(scale), o,
                                            begin, end);
  };
  const int64_t num_tasks = num_rows * num_kv_heads;
  // ~4 flops per (position, q head, dim); below ~200k the thread wake-up costs more.
  if (total_len * num_q_heads * head_dim * 4 < 200000) {
    body(0, num_tasks);
  } else {
    at::parallel_for(0, num_tasks, 1, body);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear, "y[M, N] = x[M, K] @ W.T, W in Q4_1 (float32 x and y)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("mins"), py::kw_only(),
        py::arg("allow_avx512") = true, py::arg("row_invariant") = false);
  m.def("q8_0_linear", &q8_0_linear, "y[M, N] = x[M, K] @ W.T, W in Q8_0 (float32 x and y)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::kw_only(),
        py::arg("allow_avx512") = true, py::arg("row_invariant") = false);
  m.def("f32_linear", &f32_linear,
        "y[M, N] = x[M, K] @ W.T in float32, each row in an order that does not depend on M",
        py::arg("x"), py::arg("weight"));
  m.def("avx512_available", &deepinfer::avx512_available,
        "True if this CPU runs the AVX-512 few-row quantized-linear nest");
  m.def("rms_norm", &rms_norm, "normed[T, H] of x (x := x + residual first when given)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("paged_decode_attention", &paged_decode_attention,
        "out[T, Hq, D]: each query row over its sequence's paged float32 context (one row per "
        "sequence, or the rows query_start_loc gives each, causal)",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::kw_only(), py::arg("query_start_loc") = py::none());
}
