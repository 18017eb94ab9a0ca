// Host copies of the staged transfers (included by _torch.cpp; plain C++, no PyTorch): a copy with
// streaming stores, and the same spread over helper threads that join as they wake up, which the
// copy stream's host function uses to unstage a pageable copy out (the staging copies stay on
// at::parallel_for: see parallel_streaming_copy in _torch.cpp).
//
// Why helpers of our own rather than at::parallel_for: an OpenMP region ends at a barrier that
// waits for every thread of the team, so a copy takes as long as the slowest thread takes to wake.
// A 2 MiB staging copy takes 0.03 ms with PyTorch's threads awake and 0.07-0.6 ms after other work
// has let them sleep, against 0.14-0.17 ms in one thread. Here the
// calling thread starts at once and claims pieces from a counter; helpers claim what is left as
// they wake, and the call returns once every claimed piece is copied: a helper that wakes late
// finds nothing left and goes back to sleep. The caller waits for claimed pieces by spinning a
// little, then yielding its core (a helper preempted mid-piece may need it), and the helpers leave
// cores to the threads that submit and wait: at most kMaxThreads copy.
#ifndef STREAMDAG_HOST_COPY_H
#define STREAMDAG_HOST_COPY_H

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMDAG_STREAMING_STORES 1
#endif

namespace streamdag_host_copy {

// n bytes from src to dst with non-temporal (streaming) stores where the CPU has them: the bytes
// go to memory, not into the caches. A DMA then reads them at full speed, where from a buffer that
// the CPU has just written through its caches it reads at a third to a half of it (16-22 against
// 35-47 GB/s): the copy engine must take the dirty lines from the caches.
inline void streaming_copy(char* dst, const char* src, size_t n) {
#ifdef STREAMDAG_STREAMING_STORES
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;  // to dst's first 16-byte line
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();  // the streamed lines are in memory before any later store (the DMA's launch)
#else
  std::memcpy(dst, src, n);
#endif
}

// one copy, cut into pieces that the caller and the helpers claim in turn
struct Job {
  char* dst;
  const char* src;
  size_t n, piece, pieces;
  std::atomic<size_t> next{0};  // the next piece to claim
  std::atomic<size_t> done{0};  // pieces copied

  // claim and copy pieces until none is left
  void work() {
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < pieces;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      size_t begin = i * piece, len = begin + piece < n ? piece : n - begin;
      streaming_copy(dst + begin, src + begin, len);  // (ends with a store fence)
      done.fetch_add(1, std::memory_order_release);
    }
  }

  // once every piece is claimed: until the helpers have copied theirs
  void wait_for_pieces() const {
    for (int spins = 0; done.load(std::memory_order_acquire) < pieces; spins++) {
      if (spins < 2048) {
#if defined(__x86_64__) || defined(_M_X64)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();  // a helper preempted mid-piece may need this core
      }
    }
  }
};

// The helper threads, made at the first copy that spreads; never destroyed (the process may end
// with them asleep; a forked child has none, and its copies run in the calling thread alone).
class Helpers {
 public:
  explicit Helpers(int count) : pid_(getpid()) {
    for (int k = 0; k < count; k++) std::thread([this] { serve(); }).detach();
  }

  // run ``job`` in the calling thread and in whichever helpers wake in time; returns once every
  // piece is copied. Another copy under way (the copy stream's host function beside a staging
  // copy, say), or a forked child (whose locks a helper may have held at the fork): this one runs
  // in the calling thread alone.
  void run(const std::shared_ptr<Job>& job) {
    if (getpid() != pid_) {
      job->work();
      return;
    }
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (busy.owns_lock()) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        current_ = job;
        generation_++;
      }
      wake_.notify_all();
    }
    job->work();
    job->wait_for_pieces();
    if (busy.owns_lock()) {
      std::lock_guard<std::mutex> lock(mutex_);
      current_.reset();
    }
  }

 private:
  void serve() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        job = current_;  // (none: that copy ended before this helper woke)
      }
      if (job) job->work();
    }
  }

  const pid_t pid_;   // the process that made the helpers
  std::mutex busy_;   // held by the copy that uses the helpers
  std::mutex mutex_;  // guards current_ and generation_
  std::condition_variable wake_;
  std::shared_ptr<Job> current_;
  uint64_t generation_ = 0;
};

// at most this many threads copy (the caller and its helpers), leaving cores to the threads that
// submit and wait (a choice: other counts were not measured)
constexpr int kMaxThreads = 12;

// the helpers, made once: ``threads - 1`` of them (the caller is the last), at most kMaxThreads - 1
inline Helpers* helpers(int threads) {
  static Helpers* made =  // (never freed: see Helpers)
      new Helpers((threads < kMaxThreads ? threads : kMaxThreads) - 1);
  return made;
}

// streaming_copy over up to ``threads`` threads (those of the first call that spreads), in pieces
// of ``piece`` bytes; a copy of one piece or less, or with one thread, runs in the calling thread
inline void parallel_streaming_copy(char* dst, const char* src, size_t n, int threads,
                                    size_t piece = 128 << 10) {
  if (n <= piece || threads <= 1) {
    streaming_copy(dst, src, n);
    return;
  }
  auto job = std::make_shared<Job>();
  job->dst = dst;
  job->src = src;
  job->n = n;
  job->piece = piece;
  job->pieces = (n + piece - 1) / piece;
  helpers(threads)->run(job);
}

}  // namespace streamdag_host_copy

#endif
