// Read bandwidth of this machine: the floor under a decode step that streams its weights from memory.
//   gcc -O3 -march=native -fopenmp tools/bench_membw.c -o /tmp/membw && OMP_NUM_THREADS=2 /tmp/membw 105 20
// Reads a buffer of MB megabytes REPS times with AVX-512 loads split over the OpenMP threads; prints the best.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  size_t n = (size_t)atoi(argv[1]) << 20;
  int reps = atoi(argv[2]);
  char* p = aligned_alloc(64, n);
  memset(p, 1, n);
  double best = 1e9;
  int sink = 0;
  for (int r = 0; r < reps; r++) {
    double t = now();
#pragma omp parallel reduction(+ : sink)
    {
      int id = omp_get_thread_num(), nt = omp_get_num_threads();
      size_t chunk = n / nt;
      const char* q = p + id * chunk;
      __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
      for (size_t i = 0; i + 256 <= chunk; i += 256) {
        a = _mm512_add_epi32(a, _mm512_load_si512(q + i));
        b = _mm512_add_epi32(b, _mm512_load_si512(q + i + 64));
        c = _mm512_add_epi32(c, _mm512_load_si512(q + i + 128));
        d = _mm512_add_epi32(d, _mm512_load_si512(q + i + 192));
      }
      sink += _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a, b), _mm512_add_epi32(c, d)));
    }
    t = now() - t;
    if (t < best) best = t;
  }
  printf("%zu MB, %d threads: best %.3f ms, %.1f GB/s (%d)\n", n >> 20, omp_get_max_threads(), best * 1e3, n / best / 1e9,
         sink);
  return 0;
}
