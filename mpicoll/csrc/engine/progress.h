// Progress threads: where overlapped collectives run while XLA keeps computing.
//
// An overlapped collective's FFI handler does not call MPI itself: it queues
// the call here and returns an ffi::Future, so XLA's executor (dataflow mode)
// runs whatever does not depend on the result meanwhile, and no blocking MPI
// call holds one of XLA's intra-op threads.  One thread per local device runs
// its queue strictly in enqueue order.  Handlers are invoked in program order
// (the ordered MPI effect threads a token through every mpicoll call), so
// every rank's progress thread issues the same MPI calls in the same order.
// A synchronous call on the same device first waits for the queue to drain
// (Drain), so it can never overtake a queued call.
//
// The queue knows nothing about MPI: a job is a closure that completes its
// own promise.  The CUDA handlers can use the same threads with stream events
// (not written yet, it needs a GPU to test): the handler records an event on
// XLA's stream after the input's producer and queues a job; the job waits on
// that event here (cuEventSynchronize, on this thread, not XLA's), runs the
// staged or CUDA-aware collective on a stream of its own, and releases XLA's
// stream, which was told to wait for it (cuStreamWaitValue32 on a flag the job
// writes, or a future where the GPU runtime takes one), so the kernels that do
// not read the result run meanwhile.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace mpicoll_progress {

class ProgressThread {
 public:
  // Runs `job` after every job queued before it, on this queue's thread, then
  // `then` once the job no longer counts as pending: a job completes the future
  // XLA waits on in `then`, so that the call XLA starts next (the one waiting
  // for it) finds the queue empty, not still holding the job that released it.
  void Enqueue(std::function<void()> job, std::function<void()> then = {}) {
    pending_.fetch_add(1, std::memory_order_acq_rel);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!started_) {
        started_ = true;
        // Detached like the watchdog: it lives as long as the process, and at
        // exit Python has already waited for every program (effects_barrier).
        std::thread([this] { Loop(); }).detach();
      }
      jobs_.push_back({std::move(job), std::move(then)});
    }
    ready_.notify_one();
  }

  // Returns once every job queued so far has run; one atomic load when the
  // queue is empty, which is the synchronous path's whole cost.
  void Drain() {
    if (pending_.load(std::memory_order_acquire) == 0 || OnThisThread()) return;
    std::unique_lock<std::mutex> lock(mutex_);
    drained_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
  }

  int64_t Pending() const { return pending_.load(std::memory_order_acquire); }

  // Whether the caller is a progress thread (its jobs must not wait for themselves).
  static bool OnThisThread() { return on_progress_thread_; }

 private:
  void Loop() {
    on_progress_thread_ = true;
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job.run();
      {
        // Lock so that a Drain between its check and its wait cannot miss the wake-up.
        std::lock_guard<std::mutex> lock(mutex_);
        if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) drained_.notify_all();
      }
      if (job.then) job.then();
    }
  }

  static inline thread_local bool on_progress_thread_ = false;
  std::mutex mutex_;
  std::condition_variable ready_, drained_;
  struct Job {
    std::function<void()> run, then;
  };
  std::deque<Job> jobs_;
  std::atomic<int64_t> pending_{0};
  bool started_ = false;
};

}  // namespace mpicoll_progress
