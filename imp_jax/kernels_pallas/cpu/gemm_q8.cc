// The projection GEMM's q8 handlers (imp_gemm_q8_*: int8 activations, llama.cpp's arithmetic;
// gemm_q8.h, gemm_q8_k.h, gemm_q8_iq.h) and their entry points for tests and benchmarks (ctypes): a library of its
// own (build.py), built only when `--gemm cpu_q8` or a test asks for it.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "gemm_q8.h"
#include "gemm_q8_x16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQBlock = 32;   // weights per GGML block

// The q8 handlers: the same operands as Blocks<W>, llama.cpp's arithmetic (gemm_q8.h).
// kIsa: the best integer-dot kernels this CPU runs (imp_q8::Isa: 0 AVX2, 1 VNNI on ymm, 2 AVX-512 for
// the one-row path and the tiles), or fewer where the environment variable IMP_JAX_Q8_ISA (0, 1 or 2)
// asks for less, to compare them.
imp_q8::Isa q8_isa() {
  const char* env = std::getenv("IMP_JAX_Q8_ISA");
  const imp_q8::Isa best = imp_q8::best_isa();
  return env && *env >= '0' && *env < '0' + best ? static_cast<imp_q8::Isa>(*env - '0') : best;
}
const imp_q8::Isa kIsa = q8_isa();

// Weights, Bytes: per block as kept (ggml_blocks.py; IQ4_NL keeps two of the blocks W reads, 64 weights).
template <class W, int64_t Weights = kQBlock, int64_t Bytes = W::kBytes>
ffi::Error BlocksQ8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 3 || wd[2] != Bytes || xd.back() != wd[1] * Weights)
    return ffi::Error::InvalidArgument(std::string(W::kName) + ": x [..., K] and w [N, K / " + std::to_string(Weights) +
                                       ", " + std::to_string(Bytes) + "] uint8 expected");
  const int64_t K = xd.back();
  imp_q8::dispatch<W>(&pool, kIsa, x.typed_data(), K ? x.element_count() / K : 0, K,
                      static_cast<const uint8_t*>(w.untyped_data()), wd[0], y->typed_data());
  return ffi::Error::Success();
}

constexpr auto GemmQ8Q8_0 = BlocksQ8<imp_q8::Q8_0>;
constexpr auto GemmQ8Q4_0 = BlocksQ8<imp_q8::Q4_0>;
constexpr auto GemmQ8Q4_1 = BlocksQ8<imp_q8::Q4_1>;
constexpr auto GemmQ8Q5_0 = BlocksQ8<imp_q8::Q5_0>;
constexpr auto GemmQ8Q5_1 = BlocksQ8<imp_q8::Q5_1>;
constexpr auto GemmQ8Q3_K = BlocksQ8<imp_q8::Q3_K, imp_q8::kSuper>;
constexpr auto GemmQ8Q4_K = BlocksQ8<imp_q8::Q4_K, imp_q8::kSuper>;
constexpr auto GemmQ8Q5_K = BlocksQ8<imp_q8::Q5_K, imp_q8::kSuper>;
constexpr auto GemmQ8Q6_K = BlocksQ8<imp_q8::Q6_K, imp_q8::kSuper>;
constexpr auto GemmQ8Q2_K = BlocksQ8<imp_q8::Q2_K, imp_q8::kSuper>;
constexpr auto GemmQ8IQ4_XS = BlocksQ8<imp_q8::IQ4_XS, imp_q8::kSuper>;
constexpr auto GemmQ8IQ4_NL = BlocksQ8<imp_q8::IQ4_NL, 2 * kQBlock, imp_q8::IQ4_NL::kKeptBytes>;
constexpr auto GemmQ8MXFP4 = BlocksQ8<imp_q8::MXFP4>;

// The interleaved formats (gemm_q8_x16.h): x [..., K], w [N / 16, K / 32, group bytes]; y [..., N]. The loader
// writes them only where this CPU has the AVX-512 path.
template <class W>
ffi::Error GroupsQ8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const int64_t weights = W::kBlocks * kQBlock;   // per block of a group
  if (xd.size() < 1 || wd.size() != 3 || wd[2] != W::kGroupBytes || xd.back() != wd[1] * weights)
    return ffi::Error::InvalidArgument("imp_gemm_q8 x16: x [..., K] and w [N / 16, K / " + std::to_string(weights) + ", " +
                                       std::to_string(W::kGroupBytes) + "] uint8 expected");
  if (kIsa != imp_q8::kAvx512) return ffi::Error::InvalidArgument("imp_gemm_q8 x16: this CPU lacks the AVX-512 path");
  const int64_t K = xd.back();
  imp_q8::run_x16<W>(&pool, x.typed_data(), K ? x.element_count() / K : 0, K, static_cast<const uint8_t*>(w.untyped_data()),
                     wd[0] * imp_q8::kX16Rows, y->typed_data());
  return ffi::Error::Success();
}

constexpr auto GemmQ8Q8_0x16 = GroupsQ8<imp_q8::Q8_0x16>;
constexpr auto GemmQ8Q5_0x16 = GroupsQ8<imp_q8::Q5_0x16>;
constexpr auto GemmQ8Q4_0x16 = GroupsQ8<imp_q8::Q4_0x16>;
constexpr auto GemmQ8Q4_1x16 = GroupsQ8<imp_q8::Q4_1x16>;
constexpr auto GemmQ8Q4_Kx16 = GroupsQ8<imp_q8::Q4_Kx16>;
constexpr auto GemmQ8Q6_Kx16 = GroupsQ8<imp_q8::Q6_Kx16>;
constexpr auto GemmQ8IQ4_XSx16 = GroupsQ8<imp_q8::IQ4_XSx16>;
constexpr auto GemmQ8IQ4_NLx16 = GroupsQ8<imp_q8::IQ4_NLx16>;

}  // namespace

// One binding per weight type: float32 x, the weights, float32 y, and XLA's thread pool.
#define IMP_GEMM_HANDLER(symbol, impl, wtype)                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl,                                                      \
                                ffi::Ffi::Bind()                                                   \
                                    .Ctx<ffi::ThreadPool>()                                        \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                  \
                                    .Arg<ffi::Buffer<wtype>>()                                     \
                                    .Ret<ffi::Buffer<ffi::F32>>())

IMP_GEMM_HANDLER(ImpGemmQ8Q8_0W, GemmQ8Q8_0, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q4_0W, GemmQ8Q4_0, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q4_1W, GemmQ8Q4_1, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q5_0W, GemmQ8Q5_0, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q5_1W, GemmQ8Q5_1, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q3_KW, GemmQ8Q3_K, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q4_KW, GemmQ8Q4_K, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q5_KW, GemmQ8Q5_K, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q6_KW, GemmQ8Q6_K, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q2_KW, GemmQ8Q2_K, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8IQ4_XSW, GemmQ8IQ4_XS, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8IQ4_NLW, GemmQ8IQ4_NL, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8MXFP4W, GemmQ8MXFP4, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q8_0x16W, GemmQ8Q8_0x16, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q5_0x16W, GemmQ8Q5_0x16, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q4_0x16W, GemmQ8Q4_0x16, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q4_1x16W, GemmQ8Q4_1x16, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q4_Kx16W, GemmQ8Q4_Kx16, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8Q6_Kx16W, GemmQ8Q6_Kx16, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8IQ4_XSx16W, GemmQ8IQ4_XSx16, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ8IQ4_NLx16W, GemmQ8IQ4_NLx16, ffi::U8);

extern "C" int imp_kernel_cpu_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// For tests and benchmarks (ctypes): the q8 path outside XLA, on the calling thread alone.
// Whether the q8 handlers use VNNI here; the best path they use (imp_q8::Isa: 0 AVX2, 1 VNNI, 2 AVX-512).
extern "C" int imp_gemm_q8_vnni() { return kIsa != imp_q8::kAvx2; }
extern "C" int imp_gemm_q8_isa() { return kIsa; }

// x [M, K] quantised as the q8 path does: q [M, K] int8; d and sd [M, K / 32] float32 (d_x, d_x * sum q).
extern "C" void imp_gemm_q8_quantise(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sd) {
  const int64_t nb = K / kQBlock;
  for (int64_t m = 0; m < M; ++m) imp_q8::quantise_row(x + m * K, nb, 0, q + m * K, d + m * nb, sd + m * nb, nullptr);
}

// y [M, N] = the q8 product of x [M, K] and blocks of `block_bytes` as kept (34, 18, 20, 22, 24; K-quants 84, 110,
// 144, 176, 210; IQ4_XS 136, IQ4_NL 36 (pairs), MXFP4 17) on the path `isa`:
// 0 vpmaddubsw (AVX2), 1 vpdpbusd on 256 bits (VNNI), 2 AVX-512 (the one-row path and the tiles on zmm);
// -1 for an unknown format or a path this CPU lacks.
extern "C" int imp_gemm_q8_run(int block_bytes, int isa, const float* x, int64_t M, int64_t K,
                               const uint8_t* w, int64_t N, float* y) {
  if (isa < 0 || isa > kIsa) return -1;
  const auto path = static_cast<imp_q8::Isa>(isa);
  switch (block_bytes) {
    case imp_q8::Q8_0::kBytes: imp_q8::dispatch<imp_q8::Q8_0>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::Q4_0::kBytes: imp_q8::dispatch<imp_q8::Q4_0>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::Q4_1::kBytes: imp_q8::dispatch<imp_q8::Q4_1>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::Q5_0::kBytes: imp_q8::dispatch<imp_q8::Q5_0>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::Q5_1::kBytes: imp_q8::dispatch<imp_q8::Q5_1>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::Q3_K::kBytes: imp_q8::dispatch<imp_q8::Q3_K>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::Q4_K::kBytes: imp_q8::dispatch<imp_q8::Q4_K>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::Q5_K::kBytes: imp_q8::dispatch<imp_q8::Q5_K>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::Q6_K::kBytes: imp_q8::dispatch<imp_q8::Q6_K>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::Q2_K::kBytes: imp_q8::dispatch<imp_q8::Q2_K>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::IQ4_XS::kBytes: imp_q8::dispatch<imp_q8::IQ4_XS>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::IQ4_NL::kKeptBytes: imp_q8::dispatch<imp_q8::IQ4_NL>(nullptr, path, x, M, K, w, N, y); return 0;
    case imp_q8::MXFP4::kBytes: imp_q8::dispatch<imp_q8::MXFP4>(nullptr, path, x, M, K, w, N, y); return 0;
    default: return -1;
  }
}

// The x16 product on the calling thread alone, where K is whole blocks of the format's groups; else -1.
template <class W>
int run_x16_alone(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y) {
  if (K % (W::kBlocks * kQBlock)) return -1;
  imp_q8::run_x16<W>(nullptr, x, M, K, w, N, y);
  return 0;
}

// y [M, N] = the interleaved formats' q8 product (gemm_q8_x16.h) of x [M, K] and groups of `group_bytes` (544
// Q8_0x16, 352 Q5_0x16, 288 Q4_0x16, 320 Q4_1x16: [N / 16, K / 32, group_bytes]; 576 IQ4_NLx16: K / 64; 2368
// Q4_Kx16, 3360 Q6_Kx16, 2208 IQ4_XSx16: K / 256), on the calling thread alone; -1 for an unknown format, a K
// that is not whole blocks, or a CPU without the AVX-512 path.
extern "C" int imp_gemm_q8_x16_run(int group_bytes, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                                   float* y) {
  if (kIsa != imp_q8::kAvx512 || N % imp_q8::kX16Rows) return -1;
  switch (group_bytes) {
    case imp_q8::Q8_0x16::kGroupBytes: return run_x16_alone<imp_q8::Q8_0x16>(x, M, K, w, N, y);
    case imp_q8::Q5_0x16::kGroupBytes: return run_x16_alone<imp_q8::Q5_0x16>(x, M, K, w, N, y);
    case imp_q8::Q4_0x16::kGroupBytes: return run_x16_alone<imp_q8::Q4_0x16>(x, M, K, w, N, y);
    case imp_q8::Q4_1x16::kGroupBytes: return run_x16_alone<imp_q8::Q4_1x16>(x, M, K, w, N, y);
    case imp_q8::Q4_Kx16::kGroupBytes: return run_x16_alone<imp_q8::Q4_Kx16>(x, M, K, w, N, y);
    case imp_q8::Q6_Kx16::kGroupBytes: return run_x16_alone<imp_q8::Q6_Kx16>(x, M, K, w, N, y);
    case imp_q8::IQ4_XSx16::kGroupBytes: return run_x16_alone<imp_q8::IQ4_XSx16>(x, M, K, w, N, y);
    case imp_q8::IQ4_NLx16::kGroupBytes: return run_x16_alone<imp_q8::IQ4_NLx16>(x, M, K, w, N, y);
    default: return -1;
  }
}
