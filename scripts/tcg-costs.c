// What an instruction costs in the SoftRoCE VM (QEMU's TCG), by kind: nanoseconds per
// operation with the loop's own cost taken off. Instruction counts (callgrind) weigh every
// instruction alike; under TCG a load, an atomic, a call or a libc memcpy cost far more
// than an add, and a vDSO clock read is an emulated HPET read. It also checks whether
// touching more pages (code or data) after a system call costs more, as it would if the
// emulated TLB were flushed on kernel entry. Last, it estimates the size of the vCPU's
// soft TLB, which QEMU resizes at each flush from how full it was (64 to 2^22 entries,
// direct-mapped, with 8 victim entries): 16 pages a stride apart take 16 slots while 16
// strides fit the TLB (loads hit), 8 slots plus the victim entries at 8 strides (victim
// hits, ~20 ns), and miss from 4 strides on.
//
//   gcc -O2 -mavx2 -static -o ci/out/tcg-costs scripts/tcg-costs.c
//   ci/vm-run -- ci/out/tcg-costs
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>

#define N 1000000
#define PAGES 16

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

static volatile uint64_t mem[64] __attribute__((aligned(64)));
static uint8_t a[4096] __attribute__((aligned(64))), b[4096] __attribute__((aligned(64)));
static volatile uint8_t data[PAGES * 4096] __attribute__((aligned(4096)));
static volatile size_t len;
static double base;

__attribute__((noinline)) static uint64_t near_fn(uint64_t x) {
  __asm__ volatile("" : "+r"(x));
  return x + 1;
}
typedef uint64_t (*fn_t)(uint64_t);
static volatile fn_t indirect = near_fn;

// PAGES functions, each on a page of its own, and PAGES packed together.
#define FAR(i) __attribute__((noinline, aligned(4096))) static uint64_t far##i(uint64_t x) { __asm__ volatile("" : "+r"(x)); return x * 3 + i; }
#define NEAR(i) __attribute__((noinline)) static uint64_t near##i(uint64_t x) { __asm__ volatile("" : "+r"(x)); return x * 3 + i; }
#define SIXTEEN(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
SIXTEEN(FAR)
SIXTEEN(NEAR)
#define CALLS(P, x) (P##0(x) + P##1(x) + P##2(x) + P##3(x) + P##4(x) + P##5(x) + P##6(x) + P##7(x) + \
                     P##8(x) + P##9(x) + P##10(x) + P##11(x) + P##12(x) + P##13(x) + P##14(x) + P##15(x))

#define BENCH(name, ...)                                            \
  do {                                                              \
    double t0 = now();                                              \
    for (long i = 0; i < N; i++) {                                  \
      __VA_ARGS__;                                                  \
      __asm__ volatile("" ::"r"(a), "r"(b) : "memory");             \
    }                                                               \
    printf("%-44s %9.1f ns\n", name, (now() - t0) / N - base);      \
  } while (0)

int main(void) {
  uint64_t x = 1;
  char name[64];
  double t0 = now();
  for (long i = 0; i < N; i++) __asm__ volatile("" ::"r"(a), "r"(b) : "memory");
  base = (now() - t0) / N;
  printf("%-44s %9.1f ns (taken off below)\n", "empty loop", base);
  BENCH("10 adds", __asm__ volatile("add $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\t"
                                    "add $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0" : "+r"(x)));
  BENCH("10 loads", for (int k = 0; k < 10; k++) x += mem[k & 7]);
  BENCH("10 stores", for (int k = 0; k < 10; k++) mem[k & 7] = x);
  BENCH("lock cmpxchg", { uint64_t e = mem[0]; __atomic_compare_exchange_n(&mem[0], &e, e + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); });
  BENCH("lock xadd", __atomic_fetch_add(&mem[1], 1, __ATOMIC_SEQ_CST));
  BENCH("xchg", __atomic_exchange_n(&mem[2], x, __ATOMIC_SEQ_CST));
  BENCH("mfence", __asm__ volatile("mfence" ::: "memory"));
  BENCH("call and return", x = near_fn(x));
  BENCH("indirect call and return", x = indirect(x));
  BENCH("rdtsc", x += __rdtsc());
  BENCH("pause", __asm__ volatile("pause"));
  BENCH("sse 16-byte load and store", { __m128i v = _mm_loadu_si128((void *)(a + 16)); _mm_storeu_si128((void *)(b + 32), v); });
  BENCH("avx 32-byte load and store", { __m256i v = _mm256_loadu_si256((void *)(a + 64)); _mm256_storeu_si256((void *)(b + 64), v); });
  size_t sizes[] = {2, 16, 64, 256, 1024, 4096};
  for (int k = 0; k < 6; k++) {
    len = sizes[k];
    snprintf(name, sizeof name, "libc memcpy %zu B", sizes[k]);
    BENCH(name, memcpy(b, a, len));
  }
  for (int k = 0; k < 6; k++) {
    len = sizes[k];
    snprintf(name, sizeof name, "rep movsb %zu B", sizes[k]);
    BENCH(name, { void *d = b; const void *s = a; size_t n = len; __asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n)::"memory"); });
  }
  struct timespec ts;
  BENCH("clock_gettime (vDSO)", clock_gettime(CLOCK_MONOTONIC, &ts));
  BENCH("system call (getppid)", syscall(SYS_getppid));
  BENCH("system call + 16 calls on one page", { syscall(SYS_getppid); x += CALLS(near, x); });
  BENCH("system call + 16 calls on 16 pages", { syscall(SYS_getppid); x += CALLS(far, x); });
  BENCH("system call + 16 loads on one page", { syscall(SYS_getppid); for (int k = 0; k < PAGES; k++) x += data[k * 64]; });
  BENCH("system call + 16 loads on 16 pages", { syscall(SYS_getppid); for (int k = 0; k < PAGES; k++) x += data[k * 4096 + 64]; });
  // Strides of 1 to 8192 pages: 16 x 8192 pages (512 MiB) mapped, never touched past the
  // 16 pages each stride loads, so only those are ever backed.
  size_t max_stride = 8192;
  volatile uint8_t *m = mmap(NULL, 16 * max_stride * 4096, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  printf("soft TLB on CPU %d, ns per load of 16 pages a stride apart (entries = 8 x the stride\n"
         "of the victim hits, ~20 ns, and 4 x the first stride that misses):\n",
         sched_getcpu());
  for (size_t s = 1; s <= max_stride; s *= 2) {
    for (int k = 0; k < 16; k++) x += m[k * s * 4096];
    double t = now();
    for (int r = 0; r < 2000; r++)
      for (int k = 0; k < 16; k++) x += m[k * s * 4096];
    printf("  stride %4zu pages %6.1f ns\n", s, (now() - t) / (2000 * 16));
  }
  printf("(%llu)\n", (unsigned long long)x);
  return 0;
}
