// kungfu_torch.h: what ops.cpp and backend.cpp share (see ops.cpp).
#pragma once

#include <torch/extension.h>
#include <pybind11/chrono.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kungfu.h"

namespace kungfu_torch {

// "kungfu: rank R: " before every message, so a log of many workers shows
// which one raised.
inline std::string prefix() {
  std::ostringstream s;
  s << "kungfu: rank " << kf_rank() << ": ";
  return s.str();
}

// kungfu.h's name of a status, so a caller can tell a lost peer
// ("[KF_ERR_PEER_LOST]") from the message alone.
inline const char* status_name(kf_status s) {
  switch (s) {
    case KF_ERR_INVALID_ARGUMENT: return "KF_ERR_INVALID_ARGUMENT";
    case KF_ERR_NOT_INITIALIZED: return "KF_ERR_NOT_INITIALIZED";
    case KF_ERR_MISMATCH: return "KF_ERR_MISMATCH";
    case KF_ERR_PEER_LOST: return "KF_ERR_PEER_LOST";
    case KF_ERR_TIMEOUT: return "KF_ERR_TIMEOUT";
    case KF_ERR_ABORTED: return "KF_ERR_ABORTED";
    case KF_ERR_DUPLICATE_NAME: return "KF_ERR_DUPLICATE_NAME";
    case KF_ERR_MEMBERSHIP_CHANGED: return "KF_ERR_MEMBERSHIP_CHANGED";
    case KF_ERR_INTERNAL: return "KF_ERR_INTERNAL";
    case KF_ERR_FINALIZED: return "KF_ERR_FINALIZED";
    case KF_ERR_BOOTSTRAP: return "KF_ERR_BOOTSTRAP";
    case KF_ERR_TRANSPORT: return "KF_ERR_TRANSPORT";
    default: return "KF_ERR_UNKNOWN";
  }
}

inline std::string failure(const std::string& what, kf_status s,
                    const std::string& detail) {
  std::ostringstream m;
  m << prefix() << what << " failed: " << kf_status_string(s);
  if (!detail.empty()) m << ": " << detail;
  m << " [" << status_name(s) << "]";
  return m.str();
}

inline std::exception_ptr error_ptr(const std::string& msg) {
  return std::make_exception_ptr(
      c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg));
}

[[noreturn]] inline void raise(const std::string& what, kf_status s) {
  const char* e = kf_last_error();
  throw c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                              failure(what, s, e ? e : ""));
}

// kf_init, raising on failure (idempotent in the library).
inline void init() {
  kf_status s = kf_init();
  if (s != KF_OK) raise("kf_init", s);
}

// The ranks an op runs on: every rank (KF_GROUP_WORLD), or a group that
// kf_group_create made; roots, peers and blocks are counted in them.
struct Ranks {
  kf_group_t group = KF_GROUP_WORLD;
  int rank = 0;  // this process's, in the group
  int size = 1;
};

// The ranks of group `g` (KF_GROUP_WORLD: every rank), raising if the
// library does not know it.
inline Ranks ranks_of(kf_group_t g) {
  Ranks r;
  r.group = g;
  kf_status s = kf_group_rank(g, &r.rank);
  if (s == KF_OK) s = kf_group_size(g, &r.size);
  if (s != KF_OK) raise("the ranks of a group", s);
  return r;
}

inline kf_dtype dtype_of(const at::Tensor& t, const std::string& what) {
  switch (t.scalar_type()) {
    case at::kFloat: return KF_FLOAT32;
    case at::kDouble: return KF_FLOAT64;
    case at::kHalf: return KF_FLOAT16;
    case at::kBFloat16: return KF_BFLOAT16;
    case at::kInt: return KF_INT32;
    case at::kLong: return KF_INT64;
    case at::kByte: return KF_UINT8;
    case at::kChar: return KF_INT8;
    case at::kShort: return KF_INT16;
    case at::kBool: return KF_UINT8;
    default:
      TORCH_CHECK(false, prefix(), what, ": tensors of type ", t.scalar_type(),
                  " are not supported (float32, float64, float16, bfloat16, "
                  "uint8, int8, int16, int32, int64, bool are)");
  }
}

inline kf_op op_of(const c10d::ReduceOp& op, const at::Tensor& t,
            const std::string& what) {
  bool reduces_bools = t.scalar_type() == at::kBool;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      TORCH_CHECK(!reduces_bools, prefix(), what, ": SUM of bool tensors is not supported (use MAX for \"any\", MIN for \"all\")");
      return KF_SUM;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(at::isFloatingType(t.scalar_type()), prefix(), what,
                  ": AVG needs a floating-point tensor, not ", t.scalar_type());
      return KF_AVG;
    case c10d::ReduceOp::PRODUCT:
      TORCH_CHECK(!reduces_bools, prefix(), what, ": PRODUCT of bool tensors is not supported (use MIN)");
      return KF_PROD;
    case c10d::ReduceOp::MIN: return KF_MIN;
    case c10d::ReduceOp::MAX: return KF_MAX;
    default:
      TORCH_CHECK(false, prefix(), what,
                  ": only SUM, AVG, PRODUCT, MIN and MAX are supported");
  }
}

// A tensor the library may read: on the CPU, dense.
inline void check_tensor(const at::Tensor& t, const std::string& what) {
  TORCH_CHECK(t.defined(), prefix(), what, ": an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), prefix(), what, ": a tensor on ",
              t.device(),
              " is not supported: the kungfu backend moves CPU tensors only "
              "(move it with .cpu(), or use the nccl backend for CUDA)");
  TORCH_CHECK(t.layout() == at::kStrided, prefix(), what,
              ": only dense tensors are supported, not ", t.layout());
}

struct Op;

class KfWork : public c10d::Work {
 public:
  KfWork(int rank, c10d::OpType type, const char* title,
         std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type, title),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  std::vector<at::Tensor> result() override { return outputs_; }
  // The sender of a receive from any rank (kf_recv writes it before the
  // op completes).
  int sourceRank() const override { return source_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }
  // Completes the op on the waiting thread (Completions::await_work), or
  // on the completion thread, all of them (Completions::pump).
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;

  // The Work first (wait() returns), then the Future (its callbacks run),
  // on the thread that completes the op.
  void complete(std::exception_ptr e);

  std::vector<at::Tensor> outputs_;
  int source_ = -1;

  // Guarded by the Completions' mutex. The op until it is completed
  // (then NULL: it may be deleted); the threads in wait(); the step's
  // completion kept for them (ready_), rather than queued.
  Op* op_ = nullptr;
  int waiters_ = 0;
  bool ready_ = false;
  kf_handle ready_h_ = 0;
  kf_status ready_s_ = KF_OK;

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// One kf_* call of an op, with `on_done` and the op as its callback.
using Step = std::function<kf_status(Op*, kf_handle*)>;

struct Op {
  c10::intrusive_ptr<KfWork> work;
  std::string what;                // e.g. allreduce "c10d/0/12"
  std::vector<Step> steps;
  size_t next = 0;
  std::function<void()> finish;    // copies into the caller's tensors
  std::vector<at::Tensor> keep;    // buffers the library writes or reads
};

extern "C" void on_done(kf_handle h, kf_status s, void* user);

// The completion thread and its queue.
class Completions {
 public:
  static Completions& get() {
    // Never destroyed: callbacks may run while the process exits.
    static Completions* c = new Completions();
    return *c;
  }

  // A step's completion (on a library thread): to the thread waiting for
  // its op if there is one (one hand-off), else to the completion thread.
  void push(kf_handle h, kf_status s, Op* op);

  // Waits in w.wait() (not on the completion thread) until w completes or
  // `deadline`; false if the deadline came first. A step's completion
  // that arrives meanwhile, or is still queued, is run here: the finishing
  // copies, the next step, the Work and its Future (whose callbacks so run
  // on this thread, as they would on any thread that completes the
  // Future). Other ops' completions are left to the completion thread.
  bool await_work(KfWork* w, std::chrono::steady_clock::time_point deadline);

  // After w's Work completed (any thread): wakes its waiters. They check
  // under mu_, so none misses it.
  void completed(KfWork* w) {
    std::lock_guard<std::mutex> g(mu_);
    if (w->waiters_ > 0) waiters_cv_.notify_all();
    if (pumping_) cv_.notify_all();
  }

 private:
  struct Item {
    kf_handle h;
    kf_status s;
    Op* op;
  };

  Completions() {
    std::thread([this] { run(); }).detach();
  }

  void run() {
    on_thread_ = true;
    for (;;) {
      Item it;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [this] { return !q_.empty(); });
        it = q_.front();
        q_.pop_front();
      }
      process(it);
    }
  }

 public:
  // Whether the caller is the completion thread: a Future's callback
  // (torch runs them where the Future completes, here).
  static bool on_thread() { return on_thread_; }

  // Runs completions here until `done()` or `deadline`; false if the
  // deadline came first. For a Work's wait() on the completion thread (a
  // callback that runs a blocking collective, which gloo allows): blocking
  // there would wait for this very thread, forever. Every Work completes on
  // this thread, so `done()` changes only by what this loop runs.
  bool pump(const std::function<bool()>& done,
            std::chrono::steady_clock::time_point deadline) {
    while (!done()) {
      Item it;
      {
        std::unique_lock<std::mutex> g(mu_);
        // the op may be completed by a thread in its wait() instead
        auto ready = [&] { return !q_.empty() || done(); };
        pumping_ = true;
        bool woke = true;
        if (deadline == std::chrono::steady_clock::time_point::max()) {
          cv_.wait(g, ready);
        } else {
          woke = cv_.wait_until(g, deadline, ready);
        }
        pumping_ = false;
        if (!woke || q_.empty()) return done();
        it = q_.front();
        q_.pop_front();
      }
      process(it);
    }
    return true;
  }

 private:
  static inline thread_local bool on_thread_ = false;

  void process(const Item& it) {
    std::string detail;
    if (it.s != KF_OK) {
      // The handle holds the op's error text; the callback ran just
      // before the handle shows it, so this returns at once.
      kf_wait(it.h, -1);
      const char* e = kf_last_error();
      detail = e ? e : "";
    }
    kf_release(it.h);
    if (it.s != KF_OK) {
      fail(it.op, failure(it.op->what, it.s, detail));
    } else if (it.op->next < it.op->steps.size()) {
      issue(it.op);
    } else {
      succeed(it.op);
    }
  }

  static void succeed(Op* op) {
    std::exception_ptr e;
    try {
      if (op->finish) op->finish();
    } catch (const std::exception& x) {
      e = error_ptr(prefix() + op->what + " failed: " + x.what());
    }
    end(op, e);
  }

  // The op's last step is done: no completion can come for it any more,
  // so its Work forgets it (it may be deleted), then completes.
  static void end(Op* op, std::exception_ptr e) {
    auto work = op->work;
    {
      std::lock_guard<std::mutex> g(get().mu_);
      work->op_ = nullptr;
    }
    bury(op);
    work->complete(e);
  }

 public:
  static void fail(Op* op, const std::string& msg) {
    end(op, error_ptr(msg));
  }

  // A completed op's references (its Work, the caller's tensors) are
  // dropped on a thread of the caller's, at its next op (`drain`), never
  // here: the last reference to a tensor that Python has seen takes the
  // GIL to drop its PyObject, and a thread that takes the GIL while the
  // interpreter exits is ended by it, through the noexcept destructor it
  // was in (std::terminate).
  static void bury(Op* op) {
    std::lock_guard<std::mutex> g(get().dead_mu_);
    get().dead_.push_back(op);
  }

  static void drain() {
    std::vector<Op*> dead;
    {
      std::lock_guard<std::mutex> g(get().dead_mu_);
      dead.swap(get().dead_);
    }
    for (Op* op : dead) delete op;
  }

  // Issues the op's next step; a failure completes the op with it. An
  // exception of a step (a bad size found only now) does too.
  static void issue(Op* op) {
    Step& step = op->steps[op->next++];
    kf_handle h = 0;
    kf_status s;
    std::string msg;
    try {
      s = step(op, &h);
      if (s != KF_OK) {
        const char* e = kf_last_error();
        msg = failure(op->what, s, e ? e : "");
      }
    } catch (const std::exception& x) {
      msg = prefix() + op->what + " failed: " + x.what();
    }
    if (!msg.empty()) fail(op, msg);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;          // the completion thread's
  std::condition_variable waiters_cv_;  // threads in KfWork::wait
  bool pumping_ = false;                // the completion thread is in pump()
  std::deque<Item> q_;
  std::mutex dead_mu_;
  std::vector<Op*> dead_;
};



inline void KfWork::complete(std::exception_ptr e) {
  finish(e);
  Completions::get().completed(this);
  if (e) {
    future_->setError(e);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

inline void Completions::push(kf_handle h, kf_status s, Op* op) {
  KfWork* w = op->work.get();  // alive: the op is not completed yet
  {
    std::lock_guard<std::mutex> g(mu_);
    if (w->waiters_ > 0) {
      w->ready_ = true;
      w->ready_h_ = h;
      w->ready_s_ = s;
      waiters_cv_.notify_all();
      return;
    }
    q_.push_back({h, s, op});
  }
  cv_.notify_one();
}

inline bool Completions::await_work(KfWork* w,
                                    std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    if (w->isCompleted()) return true;
    Op* op = w->op_;  // not NULL: the Work is not completed yet
    Item it{0, KF_OK, nullptr};
    if (w->ready_) {
      w->ready_ = false;
      it = {w->ready_h_, w->ready_s_, op};
    } else {
      for (auto i = q_.begin(); i != q_.end(); ++i) {
        if (i->op == op) {
          it = *i;
          q_.erase(i);
          break;
        }
      }
    }
    if (it.op != nullptr) {  // this step's completion is ours to run
      g.unlock();
      process(it);
      g.lock();
      continue;
    }
    // Its step runs, or the completion thread is running its completion:
    // wait for the one or the other to say so.
    w->waiters_++;
    auto woken = [w] { return w->ready_ || w->isCompleted(); };
    bool in_time = true;
    if (deadline == std::chrono::steady_clock::time_point::max()) {
      waiters_cv_.wait(g, woken);
    } else {
      in_time = waiters_cv_.wait_until(g, deadline, woken);
    }
    w->waiters_--;
    if (!in_time) {
      if (w->ready_ && w->waiters_ == 0) {  // kept for us: queue it after all
        w->ready_ = false;
        q_.push_back({w->ready_h_, w->ready_s_, w->op_});
        cv_.notify_one();
      }
      return w->isCompleted();
    }
  }
}

inline bool KfWork::wait(std::chrono::milliseconds timeout) {
  if (!isCompleted()) {
    auto deadline = timeout == ::kNoTimeout
                        ? std::chrono::steady_clock::time_point::max()
                        : std::chrono::steady_clock::now() + timeout;
    if (Completions::on_thread()) {
      Completions::get().pump([this] { return isCompleted(); }, deadline);
    } else {
      Completions::get().await_work(this, deadline);
    }
    // done (the base returns or raises the op's error at once), or
    // timed out (the base raises that)
    return c10d::Work::wait(isCompleted() ? ::kNoTimeout : std::chrono::milliseconds(1));
  }
  return c10d::Work::wait(timeout);
}

// Starts `op` (its first step on the caller's thread: an argument the
// library refuses raises here) and returns its Work.
inline c10::intrusive_ptr<c10d::Work> start(Op* op) {
  auto work = op->work;
  Completions::drain();  // also makes the thread before any callback
  Step& first = op->steps[op->next++];
  kf_handle h = 0;
  kf_status s = first(op, &h);
  if (s != KF_OK) {
    std::string what = op->what;
    delete op;
    raise(what, s);
  }
  return work;
}

// A contiguous tensor the library reads: `t` itself, or a copy.
inline at::Tensor input_of(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

// Where the library writes `t`'s elements: `t` itself, or a buffer copied
// into `t` when the op finishes.
inline at::Tensor output_of(Op* op, const at::Tensor& t) {
  if (t.is_contiguous()) return t;
  at::Tensor buf = t.contiguous();
  auto prev = op->finish;
  op->finish = [prev, t, buf]() mutable {
    if (prev) prev();
    t.copy_(buf);
  };
  return buf;
}

inline void* ptr(const at::Tensor& t) { return t.data_ptr(); }

inline Op* new_op(int rank, c10d::OpType type, const char* title, std::string what,
           std::vector<at::Tensor> outputs) {
  Op* op = new Op();
  op->work = c10::make_intrusive<KfWork>(rank, type, title, std::move(outputs));
  op->work->op_ = op;  // no other thread knows the Work yet
  op->what = std::move(what);
  return op;
}

inline std::string quoted(const char* kind, const std::string& name) {
  return std::string(kind) + " \"" + name + "\"";
}


// ---- the ops (ops.cpp), by name: shared by the backend and the Python API ----
// Each runs on the ranks `on`. A `check` (kf_set_check) is a value every
// rank must give alike (0: none), else the op fails on every rank.

c10::intrusive_ptr<c10d::Work> allreduce(const Ranks& on, const at::Tensor& in, const at::Tensor& out, kf_op kop,
                                         const std::string& name, uint64_t check = 0);
c10::intrusive_ptr<c10d::Work> broadcast(const Ranks& on, const at::Tensor& in, const at::Tensor& out, int root,
                                         const std::string& name, uint64_t check = 0);
c10::intrusive_ptr<c10d::Work> reduce(const Ranks& on, const at::Tensor& t, kf_op kop, int root,
                                      const std::string& name);
// `out` holds size * numel(in) elements, rank by rank; `parts` (a list
// form) get them block by block.
c10::intrusive_ptr<c10d::Work> allgather(const Ranks& on, const at::Tensor& in, const at::Tensor& out,
                                         const std::string& name,
                                         std::vector<at::Tensor> parts = {});
c10::intrusive_ptr<c10d::Work> gather(const Ranks& on, const at::Tensor& in, const at::Tensor& out, int root,
                                      const std::string& name,
                                      std::vector<at::Tensor> parts = {});
// c10d's coalesced ops: one Work for the pairs (ins[i], outs[i]): of one
// type, one library op NAME over the tensors packed together; else an op
// of `kind` per pair, named NAME/i, issued one after another.
enum class Coalesced { Allreduce, Allgather, ReduceScatter };
c10::intrusive_ptr<c10d::Work> coalesced(const Ranks& on, Coalesced kind, const std::vector<at::Tensor>& ins,
                                         const std::vector<at::Tensor>& outs, kf_op kop,
                                         const std::string& name);
// Sends `t`'s bytes to rank `dst` under `tag` (kf_send: a rendezvous with
// the matching recv).
c10::intrusive_ptr<c10d::Work> send(const Ranks& on, const at::Tensor& t, int dst, uint64_t tag,
                                    const std::string& what);
// Receives into `t` from rank `src`, or from any rank if `src` is -1; the
// Work's sourceRank() names the sender.
c10::intrusive_ptr<c10d::Work> recv(const Ranks& on, const at::Tensor& t, int src, uint64_t tag,
                                    const std::string& what);
// `in` (root only) holds size * numel(out) elements; rank r gets block r.
c10::intrusive_ptr<c10d::Work> scatter(const Ranks& on, const at::Tensor& in, const at::Tensor& out, int root,
                                       const std::string& name);
c10::intrusive_ptr<c10d::Work> reduce_scatter(const Ranks& on, const at::Tensor& in, const at::Tensor& out,
                                              kf_op kop, const std::string& name, uint64_t check = 0);
// `parts` (the list form): the Work's result, filled from `out` (1-D) in
// order, each with its own number of elements.
c10::intrusive_ptr<c10d::Work> alltoall(const Ranks& on, const at::Tensor& in, const at::Tensor& out,
                                        std::vector<int64_t> in_splits,
                                        std::vector<int64_t> out_splits,
                                        const std::string& name,
                                        std::vector<at::Tensor> parts = {});
c10::intrusive_ptr<c10d::Work> allgather_v(const Ranks& on, const at::Tensor& in, const std::string& name);
c10::intrusive_ptr<c10d::Work> barrier(const Ranks& on);

}  // namespace kungfu_torch
