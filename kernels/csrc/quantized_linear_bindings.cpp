// Python bindings of the AVX2 block-quantized linear: tensor checks, output allocation and the
// split of output rows over torch's intra-op threads. The kernel is quantized_linear_avx2.cpp.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

namespace deepinfer {  // defined in quantized_linear_avx2.cpp

void q4_1_linear_rows(const float* x, int64_t num_rows, int64_t ldx, const uint8_t* codes,
                      const uint16_t* scales, const uint16_t* mins, int64_t in_features,
                      float* y, int64_t n_begin, int64_t n_end, int64_t num_out);
void q8_0_linear_rows(const float* x, int64_t num_rows, int64_t ldx, const int8_t* codes,
                      const uint16_t* scales, int64_t in_features, float* y, int64_t n_begin,
                      int64_t n_end, int64_t num_out);

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
                          const torch::Tensor& scales, const torch::Tensor& mins) {
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
                                y.data_ptr<float>(), begin, end, num_out);
  });
  return y;
}

// x [M, K] float32, codes [N, K] int8, scales [N, K/32] float16 -> y [M, N].
torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales) {
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
                                begin, end, num_out);
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear, "y[M, N] = x[M, K] @ W.T, W in Q4_1 (float32 x and y)");
  m.def("q8_0_linear", &q8_0_linear, "y[M, N] = x[M, K] @ W.T, W in Q8_0 (float32 x and y)");
}
