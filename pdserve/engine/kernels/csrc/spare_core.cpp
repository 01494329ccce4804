// Prefill matmuls shared with a helper thread on a spare core, which never makes the rank wait.
//
// A rank computes on its own core; the host's other core runs the client, the router and the
// fronts, and is idle part of the time (all of it between requests at concurrency 1). Two OpenMP
// threads would use it, but every parallel region then waits at a barrier for a thread that the
// busy core has descheduled: a request took 6x longer next to one busy process
// (docs/PERFORMANCE.md, pdserve/runtime/placement.py). Here the product y = x @ w.T of a prefill chunk is
// split into blocks of rows instead. The rank's thread takes blocks from the front, one helper
// thread (pinned to the spare core, at the lowest priority, so the I/O processes keep the core)
// from the back. When the rank's thread runs out of free blocks while the helper is still working
// on one, it computes that block itself and the helper's copy is dropped: the rank never waits for
// the helper, so a starved helper costs nothing but the split.
//
// Every block is computed by the same call (MKL's matmul on the block's rows, into a fresh tensor
// or a view of y, which give the same bits; in bf16 the blocked VDPBF16PS kernel of
// bf16_linear.cpp, whose rows do not depend on the rows beside them) whichever thread runs it, so
// y does not depend on who computed what.
//
// Ops:
//   pdserve::spare_core_start(int[] cores, int nice) -> bool   the helper thread (once)
//   pdserve::spare_core_linear(x, w, bias?, int blocks) -> x @ w.T + bias   (x [M, K], w [N, K])
//   pdserve::spare_core_add_linear_(h, x, w, int blocks)  h [M, N] += x @ w.T
//   pdserve::spare_core_bf16_linear(x, packed, int n, bias?, int blocks) -> x @ w.T + bias
//     x [M, K] bf16, `packed` w [n, K] blocked by pack_bf16_linear (bf16_linear.cpp)
//   pdserve::spare_core_counts() -> int[]   blocks by [the rank's thread, the helper, taken back]
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <omp.h>
#include <time.h>
#if defined(__linux__)
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ops.h"

namespace {

enum : int { FREE = 0, RANK = 1, HELPING = 2, HELPED = 3, TAKEN_BACK = 4 };
constexpr int64_t kBf16RankRun = 4;  // blocks of pdserve/engine/kernels/spare_core.py BF16_BLOCK_ROWS: 256 rows

// One split product. The helper holds a reference, so x and w stay alive while it may read them.
struct Work {
  at::Tensor x, w, bias;
  at::Tensor packed;   // bf16: the blocked weight, in place of w
  int64_t n_out = 0;   // its output features
  // Blocks the rank's thread takes per call. The blocked bf16 kernel's output rows do not depend
  // on the rows beside them, so there the grid can be fine (the helper, which gets what the I/O
  // core leaves, loses at most a small block when the rank takes one back) while the rank still
  // multiplies runs of several blocks at once. MKL's bits depend on the rows of a call: 1 there.
  int64_t rank_run = 1;
  std::vector<int64_t> starts;  // block b covers rows [starts[b], starts[b + 1])
  std::unique_ptr<std::atomic<int>[]> state;
  std::vector<at::Tensor> helped;  // written by the helper before it sets HELPED
  std::unique_ptr<std::atomic<int64_t>[]> claimed_ns;  // when the helper took each block

  Work(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& bias_, int64_t n)
      : x(x_), w(w_), bias(bias_), state(new std::atomic<int>[n]), helped(n),
        claimed_ns(new std::atomic<int64_t>[n]) {
    for (int64_t b = 0; b <= n; ++b) starts.push_back(x.size(0) * b / n);
    for (int64_t b = 0; b < n; ++b) {
      state[b].store(FREE);
      claimed_ns[b].store(0);
    }
  }
  int64_t blocks() const { return static_cast<int64_t>(starts.size()) - 1; }
  int64_t rows(int64_t b) const { return starts[b + 1] - starts[b]; }
  int64_t cols() const { return packed.defined() ? n_out : w.size(0); }
  // The product of block b's rows into `y` [rows, N]: the one call both threads make, so a block
  // comes out the same whoever computes it (MKL gives the same bits into a fresh tensor or a view)
  void block_into(int64_t b, at::Tensor& y) const { run_into(b, b + 1, y); }
  // blocks [b, e) in one call
  void run_into(int64_t b, int64_t e, at::Tensor& y) const {
    const at::Tensor xb = x.narrow(0, starts[b], starts[e] - starts[b]);
    if (packed.defined())
      y.copy_(pdserve_ops::bf16_linear(xb, packed, n_out));
    else
      at::mm_out(y, xb, w.t());
    if (bias.defined()) y.add_(bias);
  }
  at::Tensor block(int64_t b) const {
    at::Tensor y = at::empty({rows(b), cols()}, x.options());
    block_into(b, y);
    return y;
  }
};

std::atomic<int64_t> by_rank{0}, by_helper{0}, taken_back{0};
// Whether the helper's last block took it noticeably longer than the CPU time it got: something
// else runs on the spare core, and the rank does not wait for the helper until that passes.
std::atomic<bool> spare_busy{false};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t thread_cpu_ns() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// Pins the calling thread to `cores` and sets its nice value; false where either fails (or off
// Linux, where it stays as it is).
bool place_this_thread(const std::vector<int64_t>& cores, int64_t nice) {
#if defined(__linux__)
  const pid_t tid = static_cast<pid_t>(syscall(SYS_gettid));
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int64_t c : cores) CPU_SET(static_cast<int>(c), &set);
  return !cores.empty() && sched_setaffinity(tid, sizeof set, &set) == 0 &&
         setpriority(PRIO_PROCESS, tid, static_cast<int>(nice)) == 0;
#else
  return false;
#endif
}

class Helper {
 public:
  static Helper& get() {
    static Helper* h = new Helper();  // never destroyed: the thread lives as long as the process
    return *h;
  }

  // Starts the thread once; true once it runs where and how it was asked (waits up to 10 s).
  bool start(const std::vector<int64_t>& cores, int64_t nice) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!started_) {
      started_ = true;
      std::thread([this, cores, nice] { run(cores, nice); }).detach();
      std::atexit([] { get().quiesce(); });  // before libtorch's statics are destroyed
    }
    cv_.wait_for(lk, std::chrono::seconds(10), [this] { return placed_; });
    return placed_ && placed_ok_;
  }

  // try_lock: the helper, at nice 19, may be descheduled while it holds the lock, and the rank
  // must not wait for it; a product not offered is computed by the rank alone.
  void offer(std::shared_ptr<Work> w) {
    if (!mu_.try_lock()) return;
    work_ = std::move(w);
    mu_.unlock();
    cv_.notify_one();
  }

  void withdraw() {  // only spares the helper a product with nothing left to take
    if (!mu_.try_lock()) return;
    work_.reset();
    mu_.unlock();
  }

  // At exit: the helper takes no more blocks, and the one it may be computing is waited for (at
  // most 2 s), so no op of it runs while the process tears libtorch down.
  void quiesce() {
    stopping_.store(true);
    const int64_t deadline = now_ns() + 2000000000;
    while (computing_.load() && now_ns() < deadline) std::this_thread::yield();
  }

 private:
  void run(std::vector<int64_t> cores, int64_t nice) {
    const bool ok = place_this_thread(cores, nice);
    // this thread's own parallel regions: one thread, no barrier. ATen sets a thread's count on
    // its first parallel op, from the process's; do that first, then override it.
    at::init_num_threads();
    omp_set_num_threads(1);
    c10::InferenceMode guard;
    {
      std::lock_guard<std::mutex> g(mu_);
      placed_ = true;
      placed_ok_ = ok;
    }
    cv_.notify_all();
    for (;;) {
      std::shared_ptr<Work> w;
      {
        std::unique_lock<std::mutex> lk(mu_);
        // bounded waits: the loop re-checks; nothing here ever needs to stop it
        while (!work_) cv_.wait_for(lk, std::chrono::seconds(1));
        w = std::move(work_);
      }
      for (int64_t b = w->blocks() - 1; b >= 0 && !stopping_.load(); --b) {
        int expected = FREE;
        const int64_t t0 = now_ns(), cpu0 = thread_cpu_ns();
        w->claimed_ns[b].store(t0);
        computing_.store(true);
        if (!stopping_.load() && w->state[b].compare_exchange_strong(expected, HELPING)) {
          try {
            at::Tensor y = w->block(b);
            spare_busy.store(thread_cpu_ns() - cpu0 < (now_ns() - t0) * 4 / 5);
            w->helped[b] = y;
            expected = HELPING;
            if (w->state[b].compare_exchange_strong(expected, HELPED)) by_helper.fetch_add(1);
          } catch (...) {
            // left HELPING: the rank takes the block back and meets the error itself
          }
        }
        computing_.store(false);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Work> work_;
  bool started_ = false, placed_ = false, placed_ok_ = false;
  std::atomic<bool> stopping_{false}, computing_{false};
};

bool spare_core_start(std::vector<int64_t> cores, int64_t nice) {
  return Helper::get().start(cores, nice);
}

// A [rows, n] buffer of this thread's, kept from call to call: a fresh one of megabytes would
// page-fault every time.
at::Tensor scratch(int64_t rows, int64_t n, const at::TensorOptions& options) {
  static thread_local at::Tensor buf;
  if (buf.numel() < rows * n || buf.dtype() != options.dtype()) buf = at::empty({rows * n}, options);
  return buf.narrow(0, 0, rows * n).view({rows, n});
}

// y = x @ w.T (+ bias) into a new tensor, or, with `out`, out += x @ w.T; with `packed` (bf16) the
// blocked weight of n_out features stands for w
at::Tensor split_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                        const at::Tensor* out, int64_t blocks, const at::Tensor& packed = {},
                        int64_t n_out = 0) {
  if (packed.defined()) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
                    x.device().is_cpu(),
                "spare_core_bf16_linear: x must be a contiguous bf16 [M, K] CPU tensor");
    TORCH_CHECK(n_out > 0, "spare_core_bf16_linear: n must be > 0");
    // the kernel's own check, made before the helper is offered the product
    TORCH_CHECK(pdserve_ops::blocked_for(packed, x.size(1), n_out),
                "spare_core_bf16_linear: x has ", x.size(1), " columns and n is ", n_out,
                ": the weight was blocked for another shape");
  } else {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 2 && x.size(1) == w.size(1),
                "spare_core_linear: x must be a contiguous [M, K] tensor and w [N, K]");
    TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.device() == x.device(),
                "spare_core_linear: w must have x's dtype and device");
  }
  const int64_t M = x.size(0), N = packed.defined() ? n_out : w.size(0);
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == N &&
                                  bias.scalar_type() == x.scalar_type()),
              "spare_core_linear: bias must be [N] of x's dtype");
  TORCH_CHECK(!out || (out->sizes() == at::IntArrayRef({M, N}) && out->is_contiguous() &&
                          out->scalar_type() == x.scalar_type()),
              "spare_core_add_linear_: h must be a contiguous [M, N] tensor of x's dtype");
  blocks = std::max<int64_t>(1, std::min(blocks, M));
  auto work = std::make_shared<Work>(x, w, bias, blocks);
  work->packed = packed;
  work->n_out = n_out;
  if (packed.defined()) work->rank_run = kBf16RankRun;
  if (blocks > 1) Helper::get().offer(work);

  at::Tensor y = out ? *out : at::empty({M, N}, x.options());  // only this thread writes y
  auto rows_of = [&](int64_t b, int64_t e) {
    return y.narrow(0, work->starts[b], work->starts[e] - work->starts[b]);
  };
  auto place = [&](int64_t b, const at::Tensor& yb) {
    out ? rows_of(b, b + 1).add_(yb) : rows_of(b, b + 1).copy_(yb);
  };
  // h += x @ w.T adds a finished product (addmm_ would accumulate into h, in other bits than the
  // helper's product added)
  auto compute = [&](int64_t b, int64_t e) {
    at::Tensor p = out ? scratch(work->starts[e] - work->starts[b], N, x.options()) : rows_of(b, e);
    work->run_into(b, e, p);
    if (out) rows_of(b, e).add_(p);
  };
  int64_t block_ns = 0;  // this thread's time per block in its last call
  try {
    for (int64_t b = 0; b < blocks;) {
      int expected = FREE;
      if (!work->state[b].compare_exchange_strong(expected, RANK)) {
        ++b;
        continue;
      }
      int64_t e = b + 1;  // and the free blocks after it, up to a run
      while (e < blocks && e - b < work->rank_run) {
        expected = FREE;
        if (!work->state[e].compare_exchange_strong(expected, RANK)) break;
        ++e;
      }
      const int64_t t0 = now_ns();
      compute(b, e);
      block_ns = (now_ns() - t0) / (e - b);
      by_rank.fetch_add(e - b);
      b = e;
    }
  } catch (...) {  // the error is the caller's; the helper is left nothing more of this product
    Helper::get().withdraw();
    for (int64_t b = 0; b < blocks; ++b) {
      int expected = FREE;
      work->state[b].compare_exchange_strong(expected, RANK);
    }
    throw;
  }
  Helper::get().withdraw();
  for (int64_t b = blocks - 1; b >= 0; --b) {
    // A helper that keeps pace finishes its block about one block time after taking it: wait
    // until a quarter past that, no longer, and not at all while its core is busy. The wait only
    // decides who computes the block, never what it holds.
    const int64_t deadline = work->claimed_ns[b].load() + block_ns + block_ns / 4;
    while (!spare_busy.load() && work->state[b].load() == HELPING && now_ns() < deadline)
      std::this_thread::yield();
    int expected = HELPING;
    if (work->state[b].compare_exchange_strong(expected, TAKEN_BACK)) {
      compute(b, b + 1);  // the helper is still on it: do not wait
      taken_back.fetch_add(1);
    } else if (expected == HELPED) {
      place(b, work->helped[b]);
    }
  }
  return y;
}

at::Tensor spare_core_linear(const at::Tensor& x, const at::Tensor& w,
                             const c10::optional<at::Tensor>& bias, int64_t blocks) {
  return split_linear(x, w, bias ? *bias : at::Tensor(), nullptr, blocks);
}

void spare_core_add_linear_(at::Tensor h, const at::Tensor& x, const at::Tensor& w,
                            int64_t blocks) {
  split_linear(x, w, at::Tensor(), &h, blocks);
}

at::Tensor spare_core_bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                  const c10::optional<at::Tensor>& bias, int64_t blocks) {
  return split_linear(x, at::Tensor(), bias ? *bias : at::Tensor(), nullptr, blocks, packed, n);
}

std::vector<int64_t> spare_core_counts() {
  return {by_rank.load(), by_helper.load(), taken_back.load()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("spare_core_start(int[] cores, int nice) -> bool", &spare_core_start);
  m.def("spare_core_counts() -> int[]", &spare_core_counts);
  m.def("spare_core_linear(Tensor x, Tensor w, Tensor? bias, int blocks) -> Tensor");
  m.def("spare_core_add_linear_(Tensor(a!) h, Tensor x, Tensor w, int blocks) -> ()");
  m.def(
      "spare_core_bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias, int blocks) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("spare_core_linear", &spare_core_linear);
  m.impl("spare_core_add_linear_", &spare_core_add_linear_);
  m.impl("spare_core_bf16_linear", &spare_core_bf16_linear);
}
