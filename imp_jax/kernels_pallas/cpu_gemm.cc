// y[m, n] = sum_k x[m, k] * w[n, k]: the float32 projection GEMM on x86-64 CPUs with AVX2 + FMA,
// for weights in HF's [out, in] layout, as XLA FFI custom calls (imp_jax/kernels_pallas/cpu_gemm.py):
// imp_gemm_f32 for float32 weights, imp_gemm_f32_bf16w for bfloat16 ones (a bf16 checkpoint's
// matrices, kept at half the bytes; widening bf16 to float32 is exact, so the products are too).
//
// Why: XLA's CPU GEMMs pack the weight matrix on every call. At the 1-64 rows of a decode step the
// packing costs as much memory traffic as the product itself. Here nothing is packed: each output
// is a dot product along k, which is contiguous in both x and w, so a weight row streams from
// memory once per block of rows and its tile stays in L1 while the row blocks go by.
//
// Each output element is summed in the same order (8-lane partial sums over k, then a fixed
// horizontal sum) whatever M, N, the tiling or the weights' dtype, so a row's result does not
// depend on its neighbours, and bf16 weights give the bits float32 copies of them would.
//
// bf16 weights: a block of at most kMR rows reads them straight into registers (a load, a widen
// and a shift per 8 weights; the memory-bound case, at half the bytes); a larger block first widens
// each NR-row weight tile into a float32 scratch that stays in L1 while its row tiles go by.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMR = 4;           // rows of x per tile
constexpr int64_t kNR = 3;           // rows of w per tile: 12 accumulators + 3 weights + 1 x in 16 ymm
constexpr int64_t kRowBlock = 64;    // rows of x per work item: their slice of x stays in L2
constexpr int64_t kColBlock = 48;    // rows of w per work item

// Weight element types: how 8 consecutive weights become 8 floats, and one weight becomes a float.
struct F32 {
  using T = float;
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static float one(float v) { return v; }
};
struct BF16 {
  using T = uint16_t;   // the bfloat16's bits: the top half of its float32
  static __m256 load8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static float one(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
  }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The MR x NR block of y at (x, w); every row is K long; y rows are ldy apart. A non-null `pf`
// (the next NR rows of w) is prefetched along the way: the first row block of a weight tile
// reads it from memory, the later ones from L1.
template <class W, int MR, int NR>
void tile(const float* x, const typename W::T* w, float* y, int64_t K, int64_t ldy,
          const typename W::T* pf) {
  constexpr int64_t kLine = 64 / sizeof(typename W::T);   // weights per cache line
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {   // hold the shorter side in registers and stream the other
    if (pf && (k & (kLine - 1)) == 0)   // one prefetch per 64-byte line
      for (int c = 0; c < kNR; ++c) _mm_prefetch(reinterpret_cast<const char*>(pf + c * K + k), _MM_HINT_T0);
    if constexpr (NR <= MR) {
      __m256 wv[NR];
      for (int c = 0; c < NR; ++c) wv[c] = W::load8(w + c * K + k);
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * K + k);
        for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    } else {
      __m256 xv[MR];
      for (int r = 0; r < MR; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < NR; ++c) {
        const __m256 wv = W::load8(w + c * K + k);
        for (int r = 0; r < MR; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
      }
    }
  }
  if (k < K) {  // the last K % 8 columns, masked: the lanes past K add 0 * 0
    alignas(32) static const int32_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(K - k)),
                                            _mm256_load_si256(reinterpret_cast<const __m256i*>(ramp)));
    __m256 wv[NR];
    for (int c = 0; c < NR; ++c) {
      alignas(32) float tail[8] = {};
      for (int64_t j = k; j < K; ++j) tail[j - k] = W::one(w[c * K + j]);
      wv[c] = _mm256_load_ps(tail);
    }
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_maskload_ps(x + r * K + k, mask);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) y[r * ldy + c] = hsum(acc[r][c]);
}

template <class W>
using TileFn = void (*)(const float*, const typename W::T*, float*, int64_t, int64_t, const typename W::T*);

// Tiles<W>::fn[mr - 1][nr - 1] handles an mr x nr block (the full 4 x 3 one, and the edges).
template <class W>
struct Tiles {
  static constexpr TileFn<W> fn[kMR][kNR] = {
      {tile<W, 1, 1>, tile<W, 1, 2>, tile<W, 1, 3>},
      {tile<W, 2, 1>, tile<W, 2, 2>, tile<W, 2, 3>},
      {tile<W, 3, 1>, tile<W, 3, 2>, tile<W, 3, 3>},
      {tile<W, 4, 1>, tile<W, 4, 2>, tile<W, 4, 3>},
  };
};

template <class W>
struct Gemm {
  using T = typename W::T;
  const float* x;
  const T* w;
  float* y;
  int64_t M, N, K;
  int64_t col_blocks, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Item i: rows [m0, m1) of x against rows [n0, n1) of w; each w tile serves every row block.
  // `scratch` (kNR * K floats) holds a widened bf16 weight tile when the block has several row tiles.
  void item(int64_t i, float* scratch) const {
    const int64_t m0 = (i / col_blocks) * kRowBlock, m1 = std::min(M, m0 + kRowBlock);
    const int64_t n0 = (i % col_blocks) * kColBlock, n1 = std::min(N, n0 + kColBlock);
    for (int64_t n = n0; n < n1; n += kNR) {
      const int64_t nr = std::min(kNR, n1 - n);
      const T* pf = n + 2 * kNR <= N ? w + (n + kNR) * K : nullptr;
      if constexpr (!std::is_same_v<W, F32>) {
        if (m1 - m0 > kMR) {
          widen(w + n * K, nr, scratch, pf);
          for (int64_t m = m0; m < m1; m += kMR) {
            const int64_t mr = std::min(kMR, m1 - m);
            Tiles<F32>::fn[mr - 1][nr - 1](x + m * K, scratch, y + m * N + n, K, N, nullptr);
          }
          continue;
        }
      }
      for (int64_t m = m0; m < m1; m += kMR) {
        const int64_t mr = std::min(kMR, m1 - m);
        Tiles<W>::fn[mr - 1][nr - 1](x + m * K, w + n * K, y + m * N + n, K, N, m == m0 ? pf : nullptr);
      }
    }
  }

  // rows [0, nr) of w as float32 into out, prefetching pf (the next tile) on the way.
  void widen(const T* w, int64_t nr, float* out, const T* pf) const {
    constexpr int64_t kLine = 64 / sizeof(T);
    for (int64_t c = 0; c < nr; ++c) {
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        if (pf && (k & (kLine - 1)) == 0) _mm_prefetch(reinterpret_cast<const char*>(pf + c * K + k), _MM_HINT_T0);
        _mm256_storeu_ps(out + c * K + k, W::load8(w + c * K + k));
      }
      for (; k < K; ++k) out[c * K + k] = W::one(w[c * K + k]);
    }
  }

  void work() {
    std::unique_ptr<float[]> scratch;
    if constexpr (!std::is_same_v<W, F32>) scratch.reset(new float[kNR * K]);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      item(i, scratch.get());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <class W, class WBuffer>
ffi::Error GemmImpl(const char* name, ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, WBuffer& w,
                    ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 2 || xd.back() != wd[1])
    return ffi::Error::InvalidArgument(std::string(name) + ": x [..., K] and w [N, K] expected");
  const int64_t K = wd[1], N = wd[0], M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (M == 0 || N == 0) return ffi::Error::Success();
  auto g = std::make_shared<Gemm<W>>();
  g->x = x.typed_data();
  g->w = reinterpret_cast<const typename W::T*>(w.untyped_data());
  g->y = y->typed_data();
  g->M = M, g->N = N, g->K = K;
  g->col_blocks = (N + kColBlock - 1) / kColBlock;
  g->items = g->col_blocks * ((M + kRowBlock - 1) / kRowBlock);
  // Helpers only pay off past ~1 MFLOP. A helper that starts after the work is gone finds no
  // item and returns; it holds its own reference to `g`, so it never touches freed memory.
  const int64_t helpers = 2 * M * N * K < (1 << 20) ? 0 : std::min(pool.num_threads(), g->items) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([g] { g->work(); });
  g->work();
  while (g->done.load(std::memory_order_acquire) < g->items) _mm_pause();
  return ffi::Error::Success();
}

ffi::Error GemmF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  return GemmImpl<F32>("imp_gemm_f32", pool, x, w, y);
}

ffi::Error GemmBf16W(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  return GemmImpl<BF16>("imp_gemm_f32_bf16w", pool, x, w, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ImpGemmF32, GemmF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ImpGemmBf16W, GemmBf16W,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int imp_kernel_cpu_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
