// The host copies of _host_copy.h, checked byte for byte: sizes around the piece boundaries, odd
// offsets, thread counts from 1 to 16, several callers at once (one owns the helpers, the others
// copy alone), and a forked child (no helpers there). Built and run by tests/test_host_copy.py.
#include "_host_copy.h"
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sys/wait.h>
#include <vector>
using streamdag_host_copy::parallel_streaming_copy;
static int check(size_t n, size_t src_off, size_t dst_off, int threads, size_t piece, unsigned seed) {
  std::vector<char> src(n + src_off + 64), dst(n + dst_off + 64, 0);
  std::mt19937 rng(seed);
  for (auto& c : src) c = static_cast<char>(rng());
  parallel_streaming_copy(dst.data() + dst_off, src.data() + src_off, n, threads, piece);
  // the last pieces first, at once: those a helper claims last, which must be copied when the call
  // returns (not copied yet, had the caller not waited for the pieces that helpers claimed)
  for (size_t end = n; end > 0;) {
    size_t begin = end > piece ? end - piece : 0;
    if (std::memcmp(dst.data() + dst_off + begin, src.data() + src_off + begin, end - begin) != 0) return 1;
    end = begin;
  }
  for (size_t i = 0; i < dst_off; i++) if (dst[i] != 0) return 2;  // nothing written before
  for (size_t i = dst_off + n; i < dst.size(); i++) if (dst[i] != 0) return 3;  // nor after
  return 0;
}
int main() {
  std::mt19937 rng(7);
  // sizes around the piece boundaries, odd offsets, several thread counts and pieces
  for (int t = 0; t < 200; t++) {
    size_t piece = (t % 3 == 0) ? 4096 : (t % 3 == 1) ? 65536 : (128 << 10);
    size_t n = rng() % (3 << 20);
    if (t % 5 == 0) n = piece * (1 + rng() % 20) + (rng() % 3) - 1;
    int threads = 1 << (rng() % 5);
    if (int r = check(n, rng() % 64, rng() % 64, threads, piece, rng())) { printf("bad %d n=%zu\n", r, n); return 1; }
  }
  // large pieces that helpers take part in
  for (int t = 0; t < 100; t++)
    if (int r = check((4 << 20) + (rng() % (4 << 20)), 0, 0, 4, 512 << 10, rng())) { printf("bad %d (large pieces)\n", r); return 1; }
  // several callers at once: one owns the helpers, the others copy alone
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int c = 0; c < 4; c++)
    callers.emplace_back([&, c] {
      std::mt19937 r(100 + c);
      for (int t = 0; t < 150; t++)
        if (check(r() % (2 << 20), r() % 32, r() % 32, 16, 65536, r())) bad++;
    });
  for (auto& th : callers) th.join();
  if (bad) { printf("bad concurrent %d\n", bad.load()); return 1; }
  // a forked child copies in its own thread (no helpers there)
  pid_t pid = fork();
  if (pid == 0) _exit(check(5 << 20, 3, 5, 16, 65536, 42) ? 9 : 0);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) { printf("bad child %d\n", status); return 1; }
  printf("ok\n");
  return 0;
}
