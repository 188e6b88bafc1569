// The kernel for x86-64 CPUs with AVX-512 (F, VL, BW, DQ: x86-64-v4); chosen at run time where the CPU has it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#define CPUK_LANES 16
#define CPUK_NAMESPACE avx512
#define CPUK_UNIT run_unit
#include "kernel_impl.h"

namespace cpukernels {
void run_unit_avx512(const Problem& p, const Unit& u) { avx512::run_unit(p, u); }
}  // namespace cpukernels
