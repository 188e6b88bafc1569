// The kernel for x86-64 CPUs with AVX2 and FMA (x86-64-v3); chosen at run time where the CPU has them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#pragma GCC target("avx2,fma,f16c")
#define CPUK_LANES 8
#define CPUK_NAMESPACE avx2
#define CPUK_AVX2 1  // AVX2 and F16C intrinsics (the target pragma does not define __AVX2__)
#define CPUK_UNIT run_unit
#include "kernel_impl.h"

namespace cpukernels {
void run_unit_avx2(const Problem& p, const Unit& u) { avx2::run_unit(p, u); }
}  // namespace cpukernels
