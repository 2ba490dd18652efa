// LoRA deltas per token row on x86-64 CPUs with AVX2 + FMA, as an XLA FFI custom call
// (imp_jax/kernels_pallas/cpu/lora.py): y[t] = B[s] (A[s] x[t]) for row t's adapter slot s = ids[t]
// (1..N; 0 = none, a zero row), for one (fused) projection of P parts:
//   x  [T, K]        float32 rows;
//   ids [T]          int32 slot per row;
//   a  [N, P * R, K] each slot's A of every part, part-major ([out, in] like every matrix);
//   bt [N, R, O]     each slot's B of every part, transposed ([in, out]), parts side by side in O;
//                    a and bt both float32 (imp_lora_f32) or both float16 (imp_lora_f16);
//   parts            attribute: the P parts' output widths (their sum is O);
//   y  [T, O]        float32.
// Part p's outputs read only h[p R, (p + 1) R) of h = A[s] x[t].
//
// Why: the XLA formulation (model/lora.py) multiplies every row by every slot's ranks and masks all
// but its own (static shapes, one program whatever the mix of adapters): N times the work. Here
// each row multiplies its own slot's matrices only, and a row without an adapter costs a zero fill.
// B is stored transposed so the B side runs along contiguous outputs (8 at a time, the rank's h
// broadcast) with no horizontal sums. Each row is one work item on XLA's thread pool. A decode step
// streams the slabs of its rows' slots from memory, which is what it costs (float16 halves it).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Slab elements: float32, or float16 (half the bytes to stream; widened exactly by F16C).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float one(float v) { return v; }
inline float one(uint16_t v) { return _cvtsh_ss(v); }

template <class E>
inline float dot(const E* a, const float* x, int64_t K) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(load8(a + k), _mm256_loadu_ps(x + k), acc);
  float sum = imp_simd::hsum(acc);
  for (; k < K; ++k) sum += one(a[k]) * x[k];
  return sum;
}

template <class E>
struct Lora {
  const float* x;
  const int32_t* ids;
  const E* a;
  const E* bt;
  float* y;
  int64_t T, K, N, R, O;
  std::vector<int64_t> bounds;   // part p's outputs are [bounds[p], bounds[p + 1])
  std::atomic<int64_t> next{0}, done{0};

  void row(int64_t t, float* h) const {
    float* yt = y + t * O;
    const int32_t s = ids[t];
    if (s <= 0 || s > N) {
      std::fill(yt, yt + O, 0.0f);
      return;
    }
    const int64_t PR = R * static_cast<int64_t>(bounds.size() - 1);
    const float* xt = x + t * K;
    const E* as = a + (s - 1) * PR * K;
    int64_t j = 0;
    for (; j + 4 <= PR; j += 4) {   // four ranks at a time share each load of x
      const E *a0 = as + j * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
      __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        const __m256 xv = _mm256_loadu_ps(xt + k);
        c0 = _mm256_fmadd_ps(load8(a0 + k), xv, c0);
        c1 = _mm256_fmadd_ps(load8(a1 + k), xv, c1);
        c2 = _mm256_fmadd_ps(load8(a2 + k), xv, c2);
        c3 = _mm256_fmadd_ps(load8(a3 + k), xv, c3);
      }
      float s0 = imp_simd::hsum(c0), s1 = imp_simd::hsum(c1), s2 = imp_simd::hsum(c2), s3 = imp_simd::hsum(c3);
      for (; k < K; ++k) {
        s0 += one(a0[k]) * xt[k], s1 += one(a1[k]) * xt[k], s2 += one(a2[k]) * xt[k], s3 += one(a3[k]) * xt[k];
      }
      h[j] = s0, h[j + 1] = s1, h[j + 2] = s2, h[j + 3] = s3;
    }
    for (; j < PR; ++j) h[j] = dot(as + j * K, xt, K);
    const E* bs = bt + (s - 1) * R * O;
    for (size_t p = 0; p + 1 < bounds.size(); ++p) {
      const float* hp = h + p * R;
      int64_t o = bounds[p];
      const int64_t end = bounds[p + 1];
      for (; o + 32 <= end; o += 32) {   // 32 outputs: four accumulators per broadcast rank
        __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
        for (int64_t r = 0; r < R; ++r) {
          const __m256 hv = _mm256_set1_ps(hp[r]);
          const E* b = bs + r * O + o;
          c0 = _mm256_fmadd_ps(hv, load8(b), c0);
          c1 = _mm256_fmadd_ps(hv, load8(b + 8), c1);
          c2 = _mm256_fmadd_ps(hv, load8(b + 16), c2);
          c3 = _mm256_fmadd_ps(hv, load8(b + 24), c3);
        }
        _mm256_storeu_ps(yt + o, c0);
        _mm256_storeu_ps(yt + o + 8, c1);
        _mm256_storeu_ps(yt + o + 16, c2);
        _mm256_storeu_ps(yt + o + 24, c3);
      }
      for (; o + 8 <= end; o += 8) {
        __m256 c = _mm256_setzero_ps();
        for (int64_t r = 0; r < R; ++r) c = _mm256_fmadd_ps(_mm256_set1_ps(hp[r]), load8(bs + r * O + o), c);
        _mm256_storeu_ps(yt + o, c);
      }
      for (; o < end; ++o) {
        float sum = 0.0f;
        for (int64_t r = 0; r < R; ++r) sum += hp[r] * one(bs[r * O + o]);
        yt[o] = sum;
      }
    }
  }

  void work() {
    std::vector<float> h(R * (bounds.size() - 1));
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < T;) {
      row(t, h.data());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <class E, ffi::DataType T>
ffi::Error LoraRun(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<T> a,
                   ffi::Buffer<T> bt, ffi::Span<const int64_t> parts, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = bt.dimensions();
  const int64_t P = static_cast<int64_t>(parts.size());
  if (xd.size() != 2 || ids.element_count() != xd[0] || ad.size() != 3 || bd.size() != 3 || ad[0] != bd[0] ||
      ad[2] != xd[1] || P < 1 || ad[1] != P * bd[1])
    return ffi::Error::InvalidArgument("imp_lora: x [T, K], ids [T], a [N, P * R, K], bt [N, R, O] expected");
  auto g = std::make_shared<Lora<E>>();
  g->x = x.typed_data(), g->ids = ids.typed_data();
  g->a = static_cast<const E*>(a.untyped_data()), g->bt = static_cast<const E*>(bt.untyped_data());
  g->y = y->typed_data();
  g->T = xd[0], g->K = xd[1], g->N = ad[0], g->R = bd[1], g->O = bd[2];
  g->bounds.push_back(0);
  for (int64_t p = 0; p < P; ++p) g->bounds.push_back(g->bounds.back() + parts[p]);
  if (g->bounds.back() != g->O)
    return ffi::Error::InvalidArgument("imp_lora: the parts' widths do not add up to bt's O");
  if (g->T == 0) return ffi::Error::Success();
  int64_t active = 0;
  for (int64_t t = 0; t < g->T; ++t) active += g->ids[t] > 0;
  // Helpers pay off past ~256 KFLOP, as for the GEMM (gemm.cc); each holds its own reference to `g`.
  const int64_t flops = 2 * active * (ad[1] * g->K + g->R * g->O);
  const int64_t helpers = flops < (1 << 18) ? 0 : std::min<int64_t>(pool.num_threads(), active) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([g] { g->work(); });
  g->work();
  while (g->done.load(std::memory_order_acquire) < g->T) _mm_pause();
  return ffi::Error::Success();
}

constexpr auto LoraF32 = LoraRun<float, ffi::F32>;
constexpr auto LoraF16 = LoraRun<uint16_t, ffi::F16>;

}  // namespace

#define IMP_LORA_HANDLER(symbol, impl, etype)                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl,                                                      \
                                ffi::Ffi::Bind()                                                   \
                                    .Ctx<ffi::ThreadPool>()                                        \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                  \
                                    .Arg<ffi::Buffer<ffi::S32>>()                                  \
                                    .Arg<ffi::Buffer<etype>>()                                     \
                                    .Arg<ffi::Buffer<etype>>()                                     \
                                    .Attr<ffi::Span<const int64_t>>("parts")                       \
                                    .Ret<ffi::Buffer<ffi::F32>>())

IMP_LORA_HANDLER(ImpLoraF32, LoraF32, ffi::F32);
IMP_LORA_HANDLER(ImpLoraF16, LoraF16, ffi::F16);

extern "C" int imp_kernel_cpu_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
