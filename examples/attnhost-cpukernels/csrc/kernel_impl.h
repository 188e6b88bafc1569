// The attention kernel itself, compiled once per instruction set: each kernel_*.cpp defines CPUK_LANES (floats
// per vector) and CPUK_UNIT (the function's name) and includes this file, so one source serves every CPU a wheel
// may meet while the hot loops are vectorised for the widest one present (bindings.cpp picks at run time).
//
// What one unit does: single-pass online softmax over a block of keys at a time, for all query rows (query
// heads x new tokens) that share a KV head at once, so every K/V row fetched from memory is used by all of them.
// Keys are read in place through the batch's slots (the plan's checked copy of its req_to_token entries); the
// rows of the next block are prefetched while this one runs.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernel.h"

#if defined(CPUK_AVX2)
#include <immintrin.h>

namespace cpukernels {
namespace CPUK_NAMESPACE {
// e4m3fn bytes (zero-extended to 16 bits) as halves of 2^-8 their value: the sign moved up a bit by adding it to
// itself before the shift (x + (x & 0x80) carries bit 7 into bit 8), S.1111.111 made a half NaN by setting its
// exponent bits.
static inline __attribute__((always_inline)) __m128i e4m3_half(__m128i x) {
  const __m128i half = _mm_slli_epi16(_mm_add_epi16(x, _mm_and_si128(x, _mm_set1_epi16(0x80))), 7);
  const __m128i nan = _mm_cmpeq_epi16(_mm_or_si128(x, _mm_set1_epi16(0x80)), _mm_set1_epi16(0xff));
  return _mm_or_si128(half, _mm_and_si128(nan, _mm_set1_epi16(0x7c00)));
}
}  // namespace CPUK_NAMESPACE
}  // namespace cpukernels
#endif

namespace cpukernels {
namespace CPUK_NAMESPACE {

constexpr int W = CPUK_LANES;
constexpr int KB = 32;  // keys per block
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

static inline __attribute__((always_inline)) vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
static inline __attribute__((always_inline)) void store(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }
// Every lane x: one broadcast (x - 0 is x for every x, so it folds away; x + 0 is not: -0.0 + 0 is +0.0).
static inline __attribute__((always_inline)) vf splat(float x) { return x - vf{}; }
// The sum of a vector's lanes by halving (log2(W) shuffles and adds, not W - 1 lane extractions).
static inline __attribute__((always_inline)) float hsum(vf x) {
#if CPUK_LANES == 16
  typedef float v8 __attribute__((vector_size(32)));
  v8 h = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  typedef float v8 __attribute__((vector_size(32)));
  v8 h = x;
#endif
  typedef float v4 __attribute__((vector_size(16)));
  v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  q += __builtin_shufflevector(q, q, 2, 3, 0, 1);
  return q[0] + q[1];
}

// e^x for x <= 0 (or -inf, giving 0) to float precision: 2^n * e^y with |y| <= ln2/2, Taylor to degree 7.
static inline __attribute__((always_inline)) vf exp_v(vf x) {
  const vf lo = splat(-87.0f);
  vi dead = x < lo;
  x = x < lo ? lo : x;
  vf t = x * splat(1.4426950408889634f) + splat(0.5f);
  vi ti = __builtin_convertvector(t, vi);
  vf n = __builtin_convertvector(ti, vf);
  vi above = n > t;
  n = above ? n - splat(1.0f) : n;
  vf y = x - n * splat(0.6931471805599453f);
  vf r = splat(1.0f / 5040) * y + splat(1.0f / 720);
  r = r * y + splat(1.0f / 120);
  r = r * y + splat(1.0f / 24);
  r = r * y + splat(1.0f / 6);
  r = r * y + splat(0.5f);
  r = r * y + splat(1.0f);
  r = r * y + splat(1.0f);
  vi bits;
  std::memcpy(&bits, &r, sizeof(bits));
  bits += __builtin_convertvector(n, vi) << 23;
  std::memcpy(&r, &bits, sizeof(r));
  return dead ? splat(0.0f) : r;
}

static inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline float fp16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while (!(mant & 0x400));
    bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

static inline uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (after rounding) to inf
  if (x < 0x38800000u) {  // subnormal or zero in half precision
    if (x < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(e);  // 14 + (113 - e) - 1
    uint32_t half = m >> shift, rem = m & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((x >> 13) - (112u << 10));
  uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

// An FP8 byte's value: e4m3fn (bias 7, no infinities, S.1111.111 is NaN) or e5m2 (bias 15, IEEE-like).
static inline float fp8_to_float(uint8_t x, bool e4m3) {
  const uint32_t sign = static_cast<uint32_t>(x & 0x80) << 24, em = x & 0x7f;
  const int mbits = e4m3 ? 3 : 2;
  const uint32_t e = em >> mbits, m = em & ((1u << mbits) - 1);
  float f;
  if (e4m3 && em == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  if (!e4m3 && e == 0x1f) {
    uint32_t bits = sign | 0x7f800000u | (m << 21);
    std::memcpy(&f, &bits, 4);
    return f;
  }
  if (e == 0) {
    f = std::ldexp(static_cast<float>(m), e4m3 ? -9 : -16);
  } else {
    uint32_t bits = (em << (23 - mbits)) + ((e4m3 ? 120u : 112u) << 23);
    std::memcpy(&f, &bits, 4);
  }
  return sign ? -f : f;
}

static inline float to_float(const void* base, int64_t i, DType t) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFp8E4M3: return fp8_to_float(static_cast<const uint8_t*>(base)[i], true);
    default: return fp8_to_float(static_cast<const uint8_t*>(base)[i], false);
  }
}

static inline int element_size(DType t) {
  return t == DType::kFloat32 ? 4 : (t == DType::kFp8E4M3 || t == DType::kFp8E5M2) ? 1 : 2;
}

static inline __attribute__((always_inline)) vf as_float(vi x) {
  vf f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}

// A small float format's bits (sign at bit sbit, `mbits` of mantissa, exponent bias `bias`) widened to float32,
// W at a time: normals by moving the bits into place and re-biasing, subnormals as mantissa x 2^(1 - bias - mbits)
// (no float denormal is formed, so a flush-to-zero mode cannot change the result), the all-ones exponent as
// inf/NaN (or, for e4m3fn, only S.1111.111 as NaN).
template <int SBIT, int MBITS, int BIAS, bool FN>
static inline __attribute__((always_inline)) vf widen(vi x) {
  const vi em = x & ((1 << SBIT) - 1);
  const vi e = em >> MBITS;
  const vf normal = as_float((em << (23 - MBITS)) + ((127 - BIAS) << 23));
  const vf sub = __builtin_convertvector(em, vf) * splat(std::ldexp(1.0f, 1 - BIAS - MBITS));
  vf f = e == 0 ? sub : normal;
  const int top = (1 << (SBIT - MBITS)) - 1;  // the all-ones exponent
  if (FN) {
    f = em == (1 << SBIT) - 1 ? splat(std::numeric_limits<float>::quiet_NaN()) : f;
  } else {
    const vf special = as_float(((em & ((1 << MBITS) - 1)) << (23 - MBITS)) | 0x7f800000);
    f = e == top ? special : f;
  }
  vi bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const vi negative = (x & (1 << SBIT)) != 0;  // -1 where the sign bit is set
  return as_float(bits | (negative & std::numeric_limits<int32_t>::min()));
}

// One cache row of `dim` entries of dtype t as float32, times `scale` for FP8 (docs/kv-cache.md: the stored value
// in float32, then the scale), W entries at a time where the row allows.
static inline void widen_row(const void* src, DType t, float scale, float* dst, int dim) {
  int d = 0;
  if (t == DType::kFloat32) {
    std::memcpy(dst, src, sizeof(float) * dim);
    return;
  }
#if defined(CPUK_AVX2)
  // With AVX2 and F16C: widening loads, and FP8 through half precision, which holds every FP8 value (e5m2 is
  // the top byte of a half; e4m3fn's bits shifted into a half's are its value times 2^-8, folded into the
  // scale exactly, as a power of two), converted by the hardware, subnormals included.
  {
    const uint8_t* b = static_cast<const uint8_t*>(src);
    const uint16_t* h = static_cast<const uint16_t*>(src);
    const __m256 sv = _mm256_set1_ps(t == DType::kFp8E4M3 ? 256.f * scale : scale);
    for (; d + 8 <= dim; d += 8) {
      __m256 f;
      if (t == DType::kBFloat16) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + d));
        f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
      } else if (t == DType::kFloat16) {
        f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + d)));
      } else {
        const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + d)));
        __m128i half;
        if (t == DType::kFp8E5M2) {
          half = _mm_slli_epi16(x, 8);
        } else {
          half = e4m3_half(x);
        }
        f = _mm256_mul_ps(_mm256_cvtph_ps(half), sv);
      }
      _mm256_storeu_ps(dst + d, f);
    }
  }
#endif
  if (t == DType::kFp8E4M3 || t == DType::kFp8E5M2) {
    typedef uint8_t vb __attribute__((vector_size(W)));
    const uint8_t* b = static_cast<const uint8_t*>(src);
    const vf sv = splat(scale);
    for (; d + W <= dim; d += W) {
      vb raw;
      std::memcpy(&raw, b + d, sizeof(raw));
      const vi x = __builtin_convertvector(raw, vi);
      store(dst + d, (t == DType::kFp8E4M3 ? widen<7, 3, 7, true>(x) : widen<7, 2, 15, false>(x)) * sv);
    }
    for (; d < dim; ++d) dst[d] = fp8_to_float(b[d], t == DType::kFp8E4M3) * scale;
    return;
  }
  typedef uint16_t vh __attribute__((vector_size(W * 2)));
  const uint16_t* h = static_cast<const uint16_t*>(src);
  for (; d + W <= dim; d += W) {
    vh raw;
    std::memcpy(&raw, h + d, sizeof(raw));
    const vi x = __builtin_convertvector(raw, vi);
    store(dst + d, t == DType::kBFloat16 ? as_float(x << 16) : widen<15, 10, 15, false>(x));
  }
  for (; d < dim; ++d) dst[d] = t == DType::kBFloat16 ? bf16_to_float(h[d]) : fp16_to_float(h[d]);
}


static inline void from_float(void* base, int64_t i, float x, DType t) {
  switch (t) {
    case DType::kFloat32: static_cast<float*>(base)[i] = x; break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16(x); break;
    default: static_cast<uint16_t*>(base)[i] = float_to_fp16(x); break;
  }
}

// Scores of rows [r0, r0 + 4) (or fewer) against one key row: the key is loaded once for all of them.
static inline __attribute__((always_inline)) void dot_rows(const float* q, int64_t ld, int rows, const float* k,
                                                           int dim, float* s, int64_t s_ld) {
  int r = 0;
  const int dv = dim - dim % W;
  for (; r + 4 <= rows; r += 4) {
    const float *q0 = q + r * ld, *q1 = q0 + ld, *q2 = q1 + ld, *q3 = q2 + ld;
    vf a0{}, a1{}, a2{}, a3{};
    for (int d = 0; d < dv; d += W) {
      vf kv = load(k + d);
      a0 += load(q0 + d) * kv;
      a1 += load(q1 + d) * kv;
      a2 += load(q2 + d) * kv;
      a3 += load(q3 + d) * kv;
    }
    float t0 = hsum(a0), t1 = hsum(a1), t2 = hsum(a2), t3 = hsum(a3);
    for (int d = dv; d < dim; ++d) {
      t0 += q0[d] * k[d];
      t1 += q1[d] * k[d];
      t2 += q2[d] * k[d];
      t3 += q3[d] * k[d];
    }
    s[r * s_ld] = t0;
    s[(r + 1) * s_ld] = t1;
    s[(r + 2) * s_ld] = t2;
    s[(r + 3) * s_ld] = t3;
  }
  for (; r < rows; ++r) {
    const float* q0 = q + r * ld;
    vf a0{};
    for (int d = 0; d < dv; d += W) a0 += load(q0 + d) * load(k + d);
    float t0 = hsum(a0);
    for (int d = dv; d < dim; ++d) t0 += q0[d] * k[d];
    s[r * s_ld] = t0;
  }
}

// The lane sums of eight vectors at once, by a transposing reduction (about 22 shuffles and adds instead of
// eight separate halvings of about eight each): out[i] = sum of x_i's lanes.
static inline __attribute__((always_inline)) void hsum8(vf x0, vf x1, vf x2, vf x3, vf x4, vf x5, vf x6, vf x7,
                                                        float* out) {
#if CPUK_LANES == 16
  auto l1 = [](vf x, vf y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  };
  auto l2 = [](vf x, vf y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  };
  auto l3 = [](vf x, vf y) {
    return __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  };
  vf c = l3(l2(l1(x0, x1), l1(x2, x3)), l2(l1(x4, x5), l1(x6, x7)));
  typedef float v8 __attribute__((vector_size(32)));
  v8 r = __builtin_shufflevector(c, c, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(c, c, 1, 3, 5, 7, 9, 11, 13, 15);
#else
  auto l1 = [](vf x, vf y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
  };
  auto l2 = [](vf x, vf y) {
    return __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15);
  };
  vf a = l2(l1(x0, x1), l1(x2, x3)), b = l2(l1(x4, x5), l1(x6, x7));
  vf r = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
  std::memcpy(out, &r, 8 * sizeof(float));
}

// Scores of four rows against two key rows at once: six loads per eight FMAs instead of five per four.
static inline __attribute__((always_inline)) void dot_rows2(const float* q, int64_t ld, int rows, const float* k0,
                                                            const float* k1, int dim, float* s, int64_t s_ld) {
  const int dv = dim - dim % W;
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    const float *q0 = q + r * ld, *q1 = q0 + ld, *q2 = q1 + ld, *q3 = q2 + ld;
    vf a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};
    for (int d = 0; d < dv; d += W) {
      vf x = load(k0 + d), y = load(k1 + d);
      vf u0 = load(q0 + d), u1 = load(q1 + d), u2 = load(q2 + d), u3 = load(q3 + d);
      a0 += u0 * x;
      a1 += u1 * x;
      a2 += u2 * x;
      a3 += u3 * x;
      b0 += u0 * y;
      b1 += u1 * y;
      b2 += u2 * y;
      b3 += u3 * y;
    }
    float t[8];
    hsum8(a0, a1, a2, a3, b0, b1, b2, b3, t);
    for (int d = dv; d < dim; ++d) {
      t[0] += q0[d] * k0[d];
      t[1] += q1[d] * k0[d];
      t[2] += q2[d] * k0[d];
      t[3] += q3[d] * k0[d];
      t[4] += q0[d] * k1[d];
      t[5] += q1[d] * k1[d];
      t[6] += q2[d] * k1[d];
      t[7] += q3[d] * k1[d];
    }
    for (int i = 0; i < 4; ++i) {
      s[(r + i) * s_ld] = t[i];
      s[(r + i) * s_ld + 1] = t[4 + i];
    }
  }
  if (r < rows) {
    dot_rows(q + r * ld, ld, rows - r, k0, dim, s + r * s_ld, s_ld);
    dot_rows(q + r * ld, ld, rows - r, k1, dim, s + r * s_ld + 1, s_ld);
  }
}

// The next block's K/V rows, prefetched (into L2) a few rows at a time all through this block's work: QK and PV
// of every head. Issued only during the first head's QK pass, they kept the memory busy for a fraction of the
// block and left it idle for the rest: on fragmented slots that read 38% of a one-thread stream where this reads
// 50% (the kernel alone on bench_cpukernels.py's pools, decode 16 x 4,096, AMD EPYC).
struct Ahead {
  const char* kb;
  const char* vb;
  int64_t ks, vs, bytes_k, bytes_v;
  const int64_t* slots;
  int64_t rows = 0, at = 0;  // rows: 2 per slot (its K row, its V row)
  inline __attribute__((always_inline)) void issue(int64_t count) {
    for (const int64_t end = std::min(rows, at + count); at < end; ++at) {
      const int64_t j = at >> 1;
      const char* p = (at & 1) ? vb + slots[j] * vs : kb + slots[j] * ks;
      const int64_t bytes = (at & 1) ? bytes_v : bytes_k;
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
    }
  }
};

// acc[r] += sum_j p[r][j] * v[j] for rows [0, rows): each V vector loaded once for four rows.
static inline __attribute__((always_inline)) void accumulate(float* acc, int64_t ld, int rows, const float* p,
                                                             const float* const* v, int n, int dim, Ahead& ahead,
                                                             int64_t quota) {
  const int dv = dim - dim % W;
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    const float *p0 = p + r * KB, *p1 = p0 + KB, *p2 = p1 + KB, *p3 = p2 + KB;
    float *o0 = acc + r * ld, *o1 = o0 + ld, *o2 = o1 + ld, *o3 = o2 + ld;
    int d = 0;
    for (; d + 2 * W <= dv; d += 2 * W) {  // two vectors of each V row per pass: six loads per eight FMAs
      ahead.issue(quota);
      vf a0 = load(o0 + d), a1 = load(o1 + d), a2 = load(o2 + d), a3 = load(o3 + d);
      vf b0 = load(o0 + d + W), b1 = load(o1 + d + W), b2 = load(o2 + d + W), b3 = load(o3 + d + W);
      for (int j = 0; j < n; ++j) {
        vf x = load(v[j] + d), y = load(v[j] + d + W);
        a0 += p0[j] * x;
        a1 += p1[j] * x;
        a2 += p2[j] * x;
        a3 += p3[j] * x;
        b0 += p0[j] * y;
        b1 += p1[j] * y;
        b2 += p2[j] * y;
        b3 += p3[j] * y;
      }
      store(o0 + d, a0);
      store(o1 + d, a1);
      store(o2 + d, a2);
      store(o3 + d, a3);
      store(o0 + d + W, b0);
      store(o1 + d + W, b1);
      store(o2 + d + W, b2);
      store(o3 + d + W, b3);
    }
    for (; d < dv; d += W) {
      vf a0 = load(o0 + d), a1 = load(o1 + d), a2 = load(o2 + d), a3 = load(o3 + d);
      for (int j = 0; j < n; ++j) {
        vf x = load(v[j] + d);
        a0 += p0[j] * x;
        a1 += p1[j] * x;
        a2 += p2[j] * x;
        a3 += p3[j] * x;
      }
      store(o0 + d, a0);
      store(o1 + d, a1);
      store(o2 + d, a2);
      store(o3 + d, a3);
    }
    for (int d = dv; d < dim; ++d)
      for (int j = 0; j < n; ++j) {
        o0[d] += p0[j] * v[j][d];
        o1[d] += p1[j] * v[j][d];
        o2[d] += p2[j] * v[j][d];
        o3[d] += p3[j] * v[j][d];
      }
  }
  for (; r < rows; ++r) {
    const float* p0 = p + r * KB;
    float* o0 = acc + r * ld;
    for (int d = 0; d < dv; d += W) {
      vf a0 = load(o0 + d);
      for (int j = 0; j < n; ++j) a0 += p0[j] * load(v[j] + d);
      store(o0 + d, a0);
    }
    for (int d = dv; d < dim; ++d)
      for (int j = 0; j < n; ++j) o0[d] += p0[j] * v[j][d];
  }
}

// The extend path: many query rows per KV head, so the block's work is two small matrix products, computed as
// register tiles the way a GEMM does (each K/V vector loaded once for R rows, each broadcast query or score used
// for two vectors, no horizontal sums). R = 6 rows x 2 vectors keeps twelve accumulators, enough to hide the FMA
// latency, in the sixteen AVX2 registers with the two loaded vectors and a broadcast.
constexpr int TR = 6;
constexpr int kGemmRows = 16;  // query rows per KV head from which a block is worth transposing its keys

// Scores of R rows against the block: s[r][j] = sum_d q[r][d] * kt[d][j] (kt: the block's keys transposed, KB
// per row of kt, zero past the block's keys).
template <int R>
static inline __attribute__((always_inline)) void qk_tile(const float* q, int64_t ld, const float* kt, int dim,
                                                          float* s) {
  for (int c = 0; c < KB; c += 2 * W) {
    vf a[R][2] = {};
    for (int d = 0; d < dim; ++d) {
      const vf x = load(kt + d * KB + c), y = load(kt + d * KB + c + W);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const vf b = splat(q[r * ld + d]);
        a[r][0] += b * x;
        a[r][1] += b * y;
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      store(s + r * KB + c, a[r][0]);
      store(s + r * KB + c + W, a[r][1]);
    }
  }
}

// acc[r] += sum_j p[r][j] * v[j] for R rows, two vectors of the rows at a time; the rest of each row one vector
// and then one entry at a time.
template <int R>
static inline __attribute__((always_inline)) void pv_tile(float* acc, int64_t ld, const float* p,
                                                          const float* const* v, int n, int dim) {
  const int dv = dim - dim % W;
  int d = 0;
  for (; d + 2 * W <= dv; d += 2 * W) {
    vf a[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r][0] = load(acc + r * ld + d), a[r][1] = load(acc + r * ld + d + W);
    for (int j = 0; j < n; ++j) {
      const vf x = load(v[j] + d), y = load(v[j] + d + W);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const vf b = splat(p[r * KB + j]);
        a[r][0] += b * x;
        a[r][1] += b * y;
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store(acc + r * ld + d, a[r][0]), store(acc + r * ld + d + W, a[r][1]);
  }
  for (; d < dv; d += W) {
    vf a[R];
    for (int r = 0; r < R; ++r) a[r] = load(acc + r * ld + d);
    for (int j = 0; j < n; ++j) {
      const vf x = load(v[j] + d);
      for (int r = 0; r < R; ++r) a[r] += splat(p[r * KB + j]) * x;
    }
    for (int r = 0; r < R; ++r) store(acc + r * ld + d, a[r]);
  }
  for (d = dv; d < dim; ++d)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < n; ++j) acc[r * ld + d] += p[r * KB + j] * v[j][d];
}

// Both products over `rows` rows: whole tiles of TR rows, then one tile of the rest.
static void qk_rows(const float* q, int64_t ld, int rows, const float* kt, int dim, float* s) {
  int r = 0;
  for (; r + TR <= rows; r += TR) qk_tile<TR>(q + r * ld, ld, kt, dim, s + r * KB);
  switch (rows - r) {
    case 5: qk_tile<5>(q + r * ld, ld, kt, dim, s + r * KB); break;
    case 4: qk_tile<4>(q + r * ld, ld, kt, dim, s + r * KB); break;
    case 3: qk_tile<3>(q + r * ld, ld, kt, dim, s + r * KB); break;
    case 2: qk_tile<2>(q + r * ld, ld, kt, dim, s + r * KB); break;
    case 1: qk_tile<1>(q + r * ld, ld, kt, dim, s + r * KB); break;
    default: break;
  }
}

static void pv_rows(float* acc, int64_t ld, int rows, const float* p, const float* const* v, int n, int dim) {
  int r = 0;
  for (; r + TR <= rows; r += TR) pv_tile<TR>(acc + r * ld, ld, p + r * KB, v, n, dim);
  switch (rows - r) {
    case 5: pv_tile<5>(acc + r * ld, ld, p + r * KB, v, n, dim); break;
    case 4: pv_tile<4>(acc + r * ld, ld, p + r * KB, v, n, dim); break;
    case 3: pv_tile<3>(acc + r * ld, ld, p + r * KB, v, n, dim); break;
    case 2: pv_tile<2>(acc + r * ld, ld, p + r * KB, v, n, dim); break;
    case 1: pv_tile<1>(acc + r * ld, ld, p + r * KB, v, n, dim); break;
    default: break;
  }
}

// The block's keys of one head transposed into kt ([dim][KB], zero past the n keys), widened from the cache's
// dtype and scaled on the way: eight keys at a time through a row buffer, so each kt line is written whole.
static inline void pack_keys(const Problem& p, const int64_t* slots, int64_t n, int h, float* kt, float* row,
                             int dim) {
  const int es = element_size(p.kv_dtype);
  const char* base = static_cast<const char*>(p.k);
  for (int64_t j0 = 0; j0 < KB; j0 += 8) {
    const int64_t m = std::max<int64_t>(0, std::min<int64_t>(8, n - j0));
    for (int64_t j = 0; j < m; ++j)
      widen_row(base + (slots[j0 + j] * p.k_slot + h * p.k_head) * es, p.kv_dtype, p.k_scale, row + j * dim, dim);
    for (int d = 0; d < dim; ++d) {
      float* o = kt + d * KB + j0;
      for (int64_t j = 0; j < 8; ++j) o[j] = j < m ? row[j * dim + d] : 0.f;
    }
  }
}

#if defined(CPUK_AVX2)
// The decode path on a cache that is not float32, with AVX2: each K/V vector widened (and scaled) where the
// dot products and the accumulation load it, instead of through a float copy of the block written and read back.
template <DType T>
static inline __attribute__((always_inline)) vf wload(const char* row, int d, __m256 sv) {
  __m256 f;
  if constexpr (T == DType::kBFloat16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d));
    f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  } else if constexpr (T == DType::kFloat16) {
    f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d)));
  } else {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d)));
    __m128i half;
    if constexpr (T == DType::kFp8E5M2) {
      half = _mm_slli_epi16(x, 8);
    } else {
      half = e4m3_half(x);
    }
    f = _mm256_mul_ps(_mm256_cvtph_ps(half), sv);
  }
  vf r;
  std::memcpy(&r, &f, sizeof(r));
  return r;
}

// The multiplier wload takes: e4m3fn read as a half is its value times 2^-8 (see widen_row).
static inline __m256 wscale(DType t, float scale) {
  return _mm256_set1_ps(t == DType::kFp8E4M3 ? 256.f * scale : scale);
}

// s[r][j] for the block's keys, two keys and four rows at a time, as dot_rows2.
template <DType T>
static void fused_qk(const float* q, int64_t ld, int rows, const char* const* k, int n, int dim, float scale,
                     float* s, Ahead& ahead, int64_t quota) {
  const __m256 sv = wscale(T, scale);
  const int dv = dim - dim % 8;
  for (int j = 0; j < n; j += 2) {
    ahead.issue(2 * quota);
    const char* k0 = k[j];
    const char* k1 = j + 1 < n ? k[j + 1] : k[j];  // an odd last key: computed twice, stored once
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float *q0 = q + r * ld, *q1 = q0 + ld, *q2 = q1 + ld, *q3 = q2 + ld;
      vf a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};
      for (int d = 0; d < dv; d += 8) {
        const vf x = wload<T>(k0, d, sv), y = wload<T>(k1, d, sv);
        const vf u0 = load(q0 + d), u1 = load(q1 + d), u2 = load(q2 + d), u3 = load(q3 + d);
        a0 += u0 * x, a1 += u1 * x, a2 += u2 * x, a3 += u3 * x;
        b0 += u0 * y, b1 += u1 * y, b2 += u2 * y, b3 += u3 * y;
      }
      float t[8];
      hsum8(a0, a1, a2, a3, b0, b1, b2, b3, t);
      for (int d = dv; d < dim; ++d) {
        const float x = to_float(k0, d, T) * (T == DType::kFp8E4M3 || T == DType::kFp8E5M2 ? scale : 1.f);
        const float y = to_float(k1, d, T) * (T == DType::kFp8E4M3 || T == DType::kFp8E5M2 ? scale : 1.f);
        for (int i = 0; i < 4; ++i) t[i] += q[(r + i) * ld + d] * x, t[4 + i] += q[(r + i) * ld + d] * y;
      }
      for (int i = 0; i < 4; ++i) {
        s[(r + i) * KB + j] = t[i];
        if (j + 1 < n) s[(r + i) * KB + j + 1] = t[4 + i];
      }
    }
    for (; r < rows; ++r) {
      const float* q0 = q + r * ld;
      vf a0{}, b0{};
      for (int d = 0; d < dv; d += 8) a0 += load(q0 + d) * wload<T>(k0, d, sv), b0 += load(q0 + d) * wload<T>(k1, d, sv);
      float t0 = hsum(a0), t1 = hsum(b0);
      for (int d = dv; d < dim; ++d) {
        const float f = T == DType::kFp8E4M3 || T == DType::kFp8E5M2 ? scale : 1.f;
        t0 += q0[d] * to_float(k0, d, T) * f, t1 += q0[d] * to_float(k1, d, T) * f;
      }
      s[r * KB + j] = t0;
      if (j + 1 < n) s[r * KB + j + 1] = t1;
    }
  }
}

// acc[r] += sum_j p[r][j] * v[j], four rows at a time, each V vector widened once for them.
template <DType T>
static void fused_pv(float* acc, int64_t ld, int rows, const float* p, const char* const* v, int n, int dim,
                     float scale) {
  const __m256 sv = wscale(T, scale);
  const int dv = dim - dim % 8;
  const float f = T == DType::kFp8E4M3 || T == DType::kFp8E5M2 ? scale : 1.f;
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    const float *p0 = p + r * KB, *p1 = p0 + KB, *p2 = p1 + KB, *p3 = p2 + KB;
    float *o0 = acc + r * ld, *o1 = o0 + ld, *o2 = o1 + ld, *o3 = o2 + ld;
    int d = 0;
    for (; d + 16 <= dv; d += 16) {  // two vectors per pass: eight independent sums hide the FMA latency
      vf a0 = load(o0 + d), a1 = load(o1 + d), a2 = load(o2 + d), a3 = load(o3 + d);
      vf b0 = load(o0 + d + 8), b1 = load(o1 + d + 8), b2 = load(o2 + d + 8), b3 = load(o3 + d + 8);
      for (int j = 0; j < n; ++j) {
        const vf x = wload<T>(v[j], d, sv), y = wload<T>(v[j], d + 8, sv);
        a0 += p0[j] * x, a1 += p1[j] * x, a2 += p2[j] * x, a3 += p3[j] * x;
        b0 += p0[j] * y, b1 += p1[j] * y, b2 += p2[j] * y, b3 += p3[j] * y;
      }
      store(o0 + d, a0), store(o1 + d, a1), store(o2 + d, a2), store(o3 + d, a3);
      store(o0 + d + 8, b0), store(o1 + d + 8, b1), store(o2 + d + 8, b2), store(o3 + d + 8, b3);
    }
    for (; d < dv; d += 8) {
      vf a0 = load(o0 + d), a1 = load(o1 + d), a2 = load(o2 + d), a3 = load(o3 + d);
      for (int j = 0; j < n; ++j) {
        const vf x = wload<T>(v[j], d, sv);
        a0 += p0[j] * x, a1 += p1[j] * x, a2 += p2[j] * x, a3 += p3[j] * x;
      }
      store(o0 + d, a0), store(o1 + d, a1), store(o2 + d, a2), store(o3 + d, a3);
    }
    for (int d = dv; d < dim; ++d)
      for (int j = 0; j < n; ++j) {
        const float x = to_float(v[j], d, T) * f;
        o0[d] += p0[j] * x, o1[d] += p1[j] * x, o2[d] += p2[j] * x, o3[d] += p3[j] * x;
      }
  }
  for (; r < rows; ++r) {
    const float* p0 = p + r * KB;
    float* o0 = acc + r * ld;
    for (int d = 0; d < dv; d += 8) {
      vf a0 = load(o0 + d);
      for (int j = 0; j < n; ++j) a0 += p0[j] * wload<T>(v[j], d, sv);
      store(o0 + d, a0);
    }
    for (int d = dv; d < dim; ++d)
      for (int j = 0; j < n; ++j) o0[d] += p0[j] * to_float(v[j], d, T) * f;
  }
}
#endif

struct Scratch {
  std::vector<float> q, acc, m, l, s, kf, vf, kt, row;
};

void CPUK_UNIT(const Problem& p, const Unit& u) {
  thread_local Scratch sc;
  const int group = p.heads / p.kv_heads, dim = p.dim;
  const int64_t ld = (dim + W - 1) / W * W;  // padded row: q rows are zero-padded past dim
  const int nh = u.h1 - u.h0;
  const int64_t nq = u.q1 - u.q0;
  const int rows_per_head = static_cast<int>(nq) * group, rows = rows_per_head * nh;
  const int64_t* meta = p.meta + u.request * kMetaFields;
  const int64_t first_slot = meta[0], prefix = meta[1], extend = meta[2], q_first = meta[3], mask_off = meta[4];
  const bool tree = p.tree_mask != nullptr;
  const bool direct = p.kv_dtype == DType::kFloat32;
  const int es = element_size(p.kv_dtype);
  const bool gemm = rows_per_head >= kGemmRows;  // an extend's block: two matrix products (qk_rows, pv_rows)
#if defined(CPUK_AVX2)
  const bool fused = !gemm && !direct;  // widened where loaded (fused_qk, fused_pv)
#else
  const bool fused = false;
#endif

  sc.q.assign(static_cast<size_t>(rows) * ld, 0.f);
  sc.acc.assign(static_cast<size_t>(rows) * ld, 0.f);
  sc.m.assign(rows, -std::numeric_limits<float>::infinity());
  sc.l.assign(rows, 0.f);
  sc.s.resize(static_cast<size_t>(rows) * KB);
  if (!direct) {
    sc.kf.resize(static_cast<size_t>(KB) * ld);
    sc.vf.resize(static_cast<size_t>(KB) * ld);
  }
  if (gemm) {
    sc.kt.resize(static_cast<size_t>(KB) * dim);
    sc.row.resize(static_cast<size_t>(8) * dim);
  }
  // Row r = (head hl, token t, query head g of the group): queries converted and pre-scaled once.
  for (int hl = 0; hl < nh; ++hl)
    for (int64_t t = 0; t < nq; ++t)
      for (int g = 0; g < group; ++g) {
        const int r = (hl * static_cast<int>(nq) + static_cast<int>(t)) * group + g;
        const int64_t base = (q_first + u.q0 + t) * p.q_tok + ((u.h0 + hl) * group + g) * p.q_head;
        float* dst = sc.q.data() + r * ld;
        for (int d = 0; d < dim; ++d) dst[d] = to_float(p.q, base + d, p.q_dtype) * p.scale;
      }

  const char* kbase = static_cast<const char*>(p.k);
  const char* vbase = static_cast<const char*>(p.v);
  // the unit's heads of one slot, as one range (a few lines too many where heads are strided apart)
  const int64_t row_bytes_k = ((int64_t)(nh - 1) * p.k_head + dim) * es;
  const int64_t row_bytes_v = ((int64_t)(nh - 1) * p.v_head + dim) * es;
  int64_t slots[KB], next[KB];
  const float* kp[KB];
  const float* vp[KB];
  const char* kr[KB];  // the fused path's raw rows
  const char* vr[KB];
  // The slots of keys [from, from + KB): a copy of token slots, or with pages the runs of consecutive slots in
  // each page the block spans (page after page as the table lists them).
  const int64_t page = p.page_size;
  auto fetch_slots = [&](int64_t from, int64_t* out) {
    const int64_t n = std::min<int64_t>(KB, u.k1 - from);
    if (page == 1) {
      std::memcpy(out, p.slots + first_slot + from, sizeof(int64_t) * n);
      return n;
    }
    const int64_t* pages = p.slots + first_slot;
    for (int64_t j = 0, pos = from; j < n;) {
      const int64_t off = pos % page, run = std::min(n - j, page - off), start = pages[pos / page] * page + off;
      for (int64_t i = 0; i < run; ++i) out[j + i] = start + i;
      j += run, pos += run;
    }
    return n;
  };
  int64_t n_next = u.k0 < u.k1 ? fetch_slots(u.k0, next) : 0;
  Ahead ahead;
  ahead.kb = kbase + u.h0 * p.k_head * es;
  ahead.vb = vbase + u.h0 * p.v_head * es;
  ahead.ks = p.k_slot * es;
  ahead.vs = p.v_slot * es;
  ahead.bytes_k = row_bytes_k;
  ahead.bytes_v = row_bytes_v;
  for (int64_t kb = u.k0; kb < u.k1; kb += KB) {
    const int64_t n = n_next;
    std::memcpy(slots, next, sizeof(int64_t) * n);
    n_next = kb + KB < u.k1 ? fetch_slots(kb + KB, next) : 0;
    // Is every key of this block visible to every row? Then no mask is looked at.
    const bool all_visible = tree ? kb + n <= prefix : kb + n - 1 <= prefix + u.q0;
    ahead.slots = next;
    ahead.rows = 2 * n_next;
    ahead.at = 0;
    // The next block's rows, spread evenly over this block's steps: a QK step (one or two keys) and a PV step (two
    // vectors of every key for four rows, about n / 8 QK steps of work).
    const int64_t qk_steps = nh * (rows_per_head >= 4 ? (n + 1) / 2 : n);
    const int64_t pv_steps = nh * (rows_per_head / 4) * ((dim - dim % W) / (2 * W));
    const int64_t pv_weight = std::max<int64_t>(1, n / 8);
    const int64_t quota = (ahead.rows + qk_steps + pv_steps * pv_weight - 1) / (qk_steps + pv_steps * pv_weight);
    const int64_t pv_quota = quota * pv_weight;
    for (int hl = 0; hl < nh; ++hl) {
      const int h = u.h0 + hl;
      const int r0 = hl * rows_per_head;
      float* s = sc.s.data() + static_cast<int64_t>(r0) * KB;
      const float* q = sc.q.data() + r0 * ld;
      if (gemm) {  // keys transposed (and widened), values in place or widened; the prefetches in two bursts
        ahead.issue((ahead.rows + 2 * nh - 1) / (2 * nh));
        pack_keys(p, slots, n, h, sc.kt.data(), sc.row.data(), dim);
        for (int64_t j = 0; j < n; ++j) {
          if (direct) {
            vp[j] = static_cast<const float*>(p.v) + slots[j] * p.v_slot + h * p.v_head;
          } else {
            float* vd = sc.vf.data() + j * ld;
            widen_row(vbase + (slots[j] * p.v_slot + h * p.v_head) * es, p.kv_dtype, p.v_scale, vd, dim);
            vp[j] = vd;
          }
        }
        qk_rows(q, ld, rows_per_head, sc.kt.data(), dim, s);
        ahead.issue((ahead.rows + 2 * nh - 1) / (2 * nh));
      } else if (fused) {
        for (int64_t j = 0; j < n; ++j) {
          kr[j] = kbase + (slots[j] * p.k_slot + h * p.k_head) * es;
          vr[j] = vbase + (slots[j] * p.v_slot + h * p.v_head) * es;
        }
#if defined(CPUK_AVX2)
        const int64_t per_key = (ahead.rows + nh * n - 1) / (nh * n);
        const int nn = static_cast<int>(n);
        switch (p.kv_dtype) {
          case DType::kBFloat16: fused_qk<DType::kBFloat16>(q, ld, rows_per_head, kr, nn, dim, 1.f, s, ahead, per_key); break;
          case DType::kFloat16: fused_qk<DType::kFloat16>(q, ld, rows_per_head, kr, nn, dim, 1.f, s, ahead, per_key); break;
          case DType::kFp8E4M3: fused_qk<DType::kFp8E4M3>(q, ld, rows_per_head, kr, nn, dim, p.k_scale, s, ahead, per_key); break;
          default: fused_qk<DType::kFp8E5M2>(q, ld, rows_per_head, kr, nn, dim, p.k_scale, s, ahead, per_key); break;
        }
#endif
      } else if (direct) {
        for (int64_t j = 0; j < n; ++j) {
          kp[j] = static_cast<const float*>(p.k) + slots[j] * p.k_slot + h * p.k_head;
          vp[j] = static_cast<const float*>(p.v) + slots[j] * p.v_slot + h * p.v_head;
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          float* kd = sc.kf.data() + j * ld;
          float* vd = sc.vf.data() + j * ld;
          const int64_t ko = slots[j] * p.k_slot + h * p.k_head, vo = slots[j] * p.v_slot + h * p.v_head;
          widen_row(kbase + ko * es, p.kv_dtype, p.k_scale, kd, dim);
          widen_row(vbase + vo * es, p.kv_dtype, p.v_scale, vd, dim);
          kp[j] = kd;
          vp[j] = vd;
        }
      }
      for (int64_t j = 0; !gemm && !fused && j < n; ++j) {
        ahead.issue(quota);
        if (j + 1 < n && rows_per_head >= 4) {
          dot_rows2(q, ld, rows_per_head, kp[j], kp[j + 1], dim, s + j, KB);
          ++j;
        } else {
          dot_rows(q, ld, rows_per_head, kp[j], dim, s + j, KB);
        }
      }
      for (int r = 0; r < rows_per_head; ++r) {
        float* sr = s + r * KB;
        for (int64_t j = n; j < KB; ++j) sr[j] = -std::numeric_limits<float>::infinity();
        if (!all_visible) {
          const int64_t e = u.q0 + r / group;  // the row's new token, within the request
          for (int64_t j = 0; j < n; ++j) {
            const int64_t kpos = kb + j;
            const bool ok = tree ? (kpos < prefix || p.tree_mask[mask_off + e * extend + (kpos - prefix)])
                                 : kpos <= prefix + e;
            if (!ok) sr[j] = -std::numeric_limits<float>::infinity();
          }
        }
        vf vmax = load(sr);  // lanes past n hold -inf
        for (int j = W; j < KB; j += W) {
          vf x = load(sr + j);
          vmax = x > vmax ? x : vmax;
        }
        float mx = vmax[0];
        for (int i = 1; i < W; ++i) mx = std::max(mx, vmax[i]);
        const int ri = r0 + r;
        if (mx == -std::numeric_limits<float>::infinity()) {
          // no finite visible score: a row that sees no key stays "no key" (zeros), one whose visible scores are
          // NaN (a NaN key) becomes NaN, as the reference's softmax does (the contract's rule)
          for (int64_t j = 0; j < n; ++j)
            if (std::isnan(sr[j])) sc.l[ri] = std::numeric_limits<float>::quiet_NaN();
          for (int j = 0; j < KB; ++j) sr[j] = 0.f;
          continue;
        }
        const float m_new = std::max(sc.m[ri], mx);
        const float alpha = std::exp(sc.m[ri] - m_new);
        sc.m[ri] = m_new;
        vf sum{};
        const vf mv = splat(m_new);
        for (int j = 0; j < KB; j += W) {
          vf e = exp_v(load(sr + j) - mv);
          store(sr + j, e);
          sum += e;
        }
        sc.l[ri] = sc.l[ri] * alpha + hsum(sum);
        if (alpha != 1.f) {
          float* a = sc.acc.data() + ri * ld;
          const vf av = splat(alpha);
          for (int64_t d = 0; d < ld; d += W) store(a + d, load(a + d) * av);
        }
      }
      if (gemm) {
        pv_rows(sc.acc.data() + r0 * ld, ld, rows_per_head, s, vp, static_cast<int>(n), dim);
      } else if (fused) {
#if defined(CPUK_AVX2)
        float* a = sc.acc.data() + r0 * ld;
        const int nn = static_cast<int>(n);
        switch (p.kv_dtype) {
          case DType::kBFloat16: fused_pv<DType::kBFloat16>(a, ld, rows_per_head, s, vr, nn, dim, 1.f); break;
          case DType::kFloat16: fused_pv<DType::kFloat16>(a, ld, rows_per_head, s, vr, nn, dim, 1.f); break;
          case DType::kFp8E4M3: fused_pv<DType::kFp8E4M3>(a, ld, rows_per_head, s, vr, nn, dim, p.v_scale); break;
          default: fused_pv<DType::kFp8E5M2>(a, ld, rows_per_head, s, vr, nn, dim, p.v_scale); break;
        }
#endif
      } else
        accumulate(sc.acc.data() + r0 * ld, ld, rows_per_head, s, vp, static_cast<int>(n), dim, ahead, pv_quota);
    }
    ahead.issue(ahead.rows);  // whatever the steps left (the tails of odd row counts issue none)
  }

  if (u.partial >= 0) {  // a piece of a split context: keep the unnormalised state for the merge
    float* out = p.partials + u.partial * static_cast<int64_t>(rows) * (dim + 2);
    for (int r = 0; r < rows; ++r) {
      float* o = out + static_cast<int64_t>(r) * (dim + 2);
      std::memcpy(o, sc.acc.data() + r * ld, sizeof(float) * dim);
      o[dim] = sc.m[r];
      o[dim + 1] = sc.l[r];
    }
    return;
  }
  for (int hl = 0; hl < nh; ++hl)
    for (int64_t t = 0; t < nq; ++t)
      for (int g = 0; g < group; ++g) {
        const int r = (hl * static_cast<int>(nq) + static_cast<int>(t)) * group + g;
        const int64_t base = ((q_first + u.q0 + t) * p.heads + (u.h0 + hl) * group + g) * dim;
        if (sc.l[r] == 0.f) {  // a query that sees no key gets zeros, not 0 x whatever its masked values hold
          for (int d = 0; d < dim; ++d) from_float(p.out, base + d, 0.f, p.q_dtype);
          continue;
        }
        const float inv = 1.f / sc.l[r];
        const float* a = sc.acc.data() + r * ld;
        if (p.q_dtype == DType::kFloat32) {
          float* o = static_cast<float*>(p.out) + base;
          for (int d = 0; d < dim; ++d) o[d] = a[d] * inv;
        } else {
          for (int d = 0; d < dim; ++d) from_float(p.out, base + d, a[d] * inv, p.q_dtype);
        }
      }
}

}  // namespace CPUK_NAMESPACE
}  // namespace cpukernels
