// The portable build of the kernel: whatever the compiler's baseline instruction set is (SSE2 on x86-64, NEON
// on aarch64); GCC lowers the 8-float vectors to it.
#define CPUK_LANES 8
#define CPUK_NAMESPACE base
#define CPUK_UNIT run_unit
#include "kernel_impl.h"

namespace cpukernels {
void run_unit_base(const Problem& p, const Unit& u) { base::run_unit(p, u); }
}  // namespace cpukernels
