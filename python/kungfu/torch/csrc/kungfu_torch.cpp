// The torch side of KungFu-rs: a c10d::Backend named "kungfu" and the
// named, asynchronous ops of the Horovod-style API, both over kungfu.h
// and nothing else of the library.
//
// An op is a short list of steps, each one kf_* call. Its callback runs on
// a library thread and only queues the completed handle; one completion
// thread per process takes the op's error text (kf_wait, kf_last_error),
// releases the handle, issues the next step or runs the op's finishing
// copies, and then completes the Work and its Future. So callbacks of the
// Future (DDP's comm hooks) never run on a library thread, and a step that
// needs the result of the one before (the padding of an uneven alltoall)
// is issued from there.

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
std::string prefix() {
  std::ostringstream s;
  s << "kungfu: rank " << kf_rank() << ": ";
  return s.str();
}

// kungfu.h's name of a status, so a caller can tell a lost peer
// ("[KF_ERR_PEER_LOST]") from the message alone.
const char* status_name(kf_status s) {
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

std::string failure(const std::string& what, kf_status s,
                    const std::string& detail) {
  std::ostringstream m;
  m << prefix() << what << " failed: " << kf_status_string(s);
  if (!detail.empty()) m << ": " << detail;
  m << " [" << status_name(s) << "]";
  return m.str();
}

std::exception_ptr error_ptr(const std::string& msg) {
  return std::make_exception_ptr(
      c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg));
}

[[noreturn]] void raise(const std::string& what, kf_status s) {
  const char* e = kf_last_error();
  throw c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                              failure(what, s, e ? e : ""));
}

// kf_init, raising on failure (idempotent in the library).
void init() {
  kf_status s = kf_init();
  if (s != KF_OK) raise("kf_init", s);
}

kf_dtype dtype_of(const at::Tensor& t, const std::string& what) {
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

kf_op op_of(const c10d::ReduceOp& op, const at::Tensor& t,
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
void check_tensor(const at::Tensor& t, const std::string& what) {
  TORCH_CHECK(t.defined(), prefix(), what, ": an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), prefix(), what, ": a tensor on ",
              t.device(),
              " is not supported: the kungfu backend moves CPU tensors only "
              "(move it with .cpu(), or use the nccl backend for CUDA)");
  TORCH_CHECK(t.layout() == at::kStrided, prefix(), what,
              ": only dense tensors are supported, not ", t.layout());
}

class KfWork : public c10d::Work {
 public:
  KfWork(int rank, c10d::OpType type, const char* title,
         std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type, title),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }
  // c10d's wait(), except on the completion thread (see Completions::pump)
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;

  // The Work first (wait() returns), then the Future (its callbacks run).
  void complete(std::exception_ptr e) {
    finish(e);
    if (e) {
      future_->setError(e);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

  std::vector<at::Tensor> outputs_;

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

struct Op;
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

  void push(kf_handle h, kf_status s, Op* op) {
    {
      std::lock_guard<std::mutex> g(mu_);
      q_.push_back({h, s, op});
    }
    cv_.notify_one();
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
        auto ready = [this] { return !q_.empty(); };
        if (deadline == std::chrono::steady_clock::time_point::max()) {
          cv_.wait(g, ready);
        } else if (!cv_.wait_until(g, deadline, ready)) {
          return done();
        }
        it = q_.front();
        q_.pop_front();
      }
      process(it);
    }
    return true;
  }

 private:
  static thread_local bool on_thread_;

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
    op->work->complete(e);
    bury(op);
  }

 public:
  static void fail(Op* op, const std::string& msg) {
    op->work->complete(error_ptr(msg));
    bury(op);
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
  std::condition_variable cv_;
  std::deque<Item> q_;
  std::mutex dead_mu_;
  std::vector<Op*> dead_;
};

thread_local bool Completions::on_thread_ = false;

extern "C" void on_done(kf_handle h, kf_status s, void* user) {
  Completions::get().push(h, s, static_cast<Op*>(user));
}

bool KfWork::wait(std::chrono::milliseconds timeout) {
  if (Completions::on_thread() && !isCompleted()) {
    auto deadline = timeout == ::kNoTimeout
                        ? std::chrono::steady_clock::time_point::max()
                        : std::chrono::steady_clock::now() + timeout;
    Completions::get().pump([this] { return isCompleted(); }, deadline);
    // done (the base returns or raises the op's error at once), or
    // timed out (the base raises that)
    return c10d::Work::wait(isCompleted() ? ::kNoTimeout : std::chrono::milliseconds(1));
  }
  return c10d::Work::wait(timeout);
}

// Starts `op` (its first step on the caller's thread: an argument the
// library refuses raises here) and returns its Work.
c10::intrusive_ptr<c10d::Work> start(Op* op) {
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
at::Tensor input_of(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

// Where the library writes `t`'s elements: `t` itself, or a buffer copied
// into `t` when the op finishes.
at::Tensor output_of(Op* op, const at::Tensor& t) {
  if (t.is_contiguous()) return t;
  at::Tensor buf = t.contiguous();
  auto prev = op->finish;
  op->finish = [prev, t, buf]() mutable {
    if (prev) prev();
    t.copy_(buf);
  };
  return buf;
}

void* ptr(const at::Tensor& t) { return t.data_ptr(); }

Op* new_op(int rank, c10d::OpType type, const char* title, std::string what,
           std::vector<at::Tensor> outputs) {
  Op* op = new Op();
  op->work = c10::make_intrusive<KfWork>(rank, type, title, std::move(outputs));
  op->what = std::move(what);
  return op;
}

std::string quoted(const char* kind, const std::string& name) {
  return std::string(kind) + " \"" + name + "\"";
}

// ---- the ops, by name (shared by the backend and the Python API) ----

c10::intrusive_ptr<c10d::Work> allreduce(const at::Tensor& in,
                                         const at::Tensor& out, kf_op kop,
                                         const std::string& name) {
  auto what = quoted("allreduce", name);
  check_tensor(in, what);
  check_tensor(out, what);
  TORCH_CHECK(in.numel() == out.numel() && in.scalar_type() == out.scalar_type(),
              prefix(), what, ": output and input differ in size or type");
  kf_dtype dt = dtype_of(in, what);
  Op* op = new_op(kf_rank(), c10d::OpType::ALLREDUCE, "kungfu:all_reduce", what, {out});
  at::Tensor src = input_of(in);
  at::Tensor dst = output_of(op, out);
  op->keep = {src, dst};
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_allreduce(ptr(src), ptr(dst), src.numel(), dt, kop, name.c_str(),
                        on_done, o, h);
  });
  return start(op);
}

c10::intrusive_ptr<c10d::Work> broadcast(const at::Tensor& in,
                                         const at::Tensor& out, int root,
                                         const std::string& name) {
  auto what = quoted("broadcast", name);
  check_tensor(in, what);
  check_tensor(out, what);
  TORCH_CHECK(in.numel() == out.numel() && in.scalar_type() == out.scalar_type(),
              prefix(), what, ": output and input differ in size or type");
  kf_dtype dt = dtype_of(in, what);
  Op* op = new_op(kf_rank(), c10d::OpType::BROADCAST, "kungfu:broadcast", what, {out});
  at::Tensor src = input_of(in);
  at::Tensor dst = output_of(op, out);
  op->keep = {src, dst};
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_broadcast(ptr(src), ptr(dst), src.numel(), dt, root, name.c_str(),
                        on_done, o, h);
  });
  return start(op);
}

c10::intrusive_ptr<c10d::Work> reduce(const at::Tensor& t, kf_op kop, int root,
                                      const std::string& name) {
  auto what = quoted("reduce", name);
  check_tensor(t, what);
  kf_dtype dt = dtype_of(t, what);
  Op* op = new_op(kf_rank(), c10d::OpType::REDUCE, "kungfu:reduce", what, {t});
  at::Tensor src = input_of(t);
  at::Tensor dst = kf_rank() == root ? output_of(op, t) : at::Tensor();
  op->keep = {src};
  if (dst.defined()) op->keep.push_back(dst);
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_reduce(ptr(src), dst.defined() ? ptr(dst) : nullptr, src.numel(),
                     dt, kop, root, name.c_str(), on_done, o, h);
  });
  return start(op);
}

// Makes `op` finish by copying `flat` (the library's output), block by
// block, into `parts` (a list form of the op), which become its result.
void scatter_into(Op* op, const at::Tensor& flat, std::vector<at::Tensor> parts) {
  if (parts.empty()) return;
  op->work->outputs_ = parts;
  auto prev = op->finish;
  op->finish = [prev, flat, parts]() {
    if (prev) prev();
    int64_t each = flat.numel() / static_cast<int64_t>(parts.size());
    for (size_t i = 0; i < parts.size(); i++) {
      parts[i].copy_(flat.narrow(0, i * each, each).view(parts[i].sizes()));
    }
  };
}

// `out` holds size * numel(in) elements, rank by rank.
c10::intrusive_ptr<c10d::Work> allgather(const at::Tensor& in,
                                         const at::Tensor& out,
                                         const std::string& name,
                                         std::vector<at::Tensor> parts = {}) {
  auto what = quoted("allgather", name);
  check_tensor(in, what);
  check_tensor(out, what);
  TORCH_CHECK(out.numel() == in.numel() * kf_size() &&
                  in.scalar_type() == out.scalar_type(),
              prefix(), what, ": the output must hold ", kf_size(),
              " times the input's ", in.numel(), " elements of ", in.scalar_type(),
              ", not ", out.numel(), " of ", out.scalar_type());
  kf_dtype dt = dtype_of(in, what);
  Op* op = new_op(kf_rank(), c10d::OpType::_ALLGATHER_BASE, "kungfu:all_gather", what, {out});
  at::Tensor src = input_of(in);
  at::Tensor dst = output_of(op, out);
  op->keep = {src, dst};
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_allgather(ptr(src), ptr(dst), src.numel(), dt, name.c_str(),
                        on_done, o, h);
  });
  scatter_into(op, dst, parts);
  return start(op);
}

// `out` (root only) holds size * numel(in) elements, rank by rank.
c10::intrusive_ptr<c10d::Work> gather(const at::Tensor& in,
                                      const at::Tensor& out, int root,
                                      const std::string& name,
                                      std::vector<at::Tensor> parts = {}) {
  auto what = quoted("gather", name);
  check_tensor(in, what);
  kf_dtype dt = dtype_of(in, what);
  bool here = kf_rank() == root;
  if (here) {
    check_tensor(out, what);
    TORCH_CHECK(out.numel() == in.numel() * kf_size() &&
                    in.scalar_type() == out.scalar_type(),
                prefix(), what, ": the output must hold ", kf_size(),
                " times the input's elements, of its type");
  }
  Op* op = new_op(kf_rank(), c10d::OpType::GATHER, "kungfu:gather", what,
                  here ? std::vector<at::Tensor>{out} : std::vector<at::Tensor>{});
  at::Tensor src = input_of(in);
  at::Tensor dst = here ? output_of(op, out) : at::Tensor();
  op->keep = {src};
  if (here) op->keep.push_back(dst);
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_gather(ptr(src), here ? ptr(dst) : nullptr, src.numel(), dt, root,
                     name.c_str(), on_done, o, h);
  });
  if (here) scatter_into(op, dst, parts);
  return start(op);
}

// `in` holds size * numel(out) elements; rank r gets the reduction of
// block r.
c10::intrusive_ptr<c10d::Work> reduce_scatter(const at::Tensor& in,
                                              const at::Tensor& out, kf_op kop,
                                              const std::string& name) {
  auto what = quoted("reduce_scatter", name);
  check_tensor(in, what);
  check_tensor(out, what);
  TORCH_CHECK(in.numel() == out.numel() * kf_size() &&
                  in.scalar_type() == out.scalar_type(),
              prefix(), what, ": the input must hold ", kf_size(),
              " times the output's ", out.numel(), " elements of its type, not ",
              in.numel());
  kf_dtype dt = dtype_of(in, what);
  Op* op = new_op(kf_rank(), c10d::OpType::_REDUCE_SCATTER_BASE, "kungfu:reduce_scatter", what, {out});
  at::Tensor src = input_of(in);
  at::Tensor dst = output_of(op, out);
  op->keep = {src, dst};
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_reduce_scatter(ptr(src), ptr(dst), dst.numel(), dt, kop,
                             name.c_str(), on_done, o, h);
  });
  return start(op);
}

// Splits along the first dimension; empty: equal blocks.
std::vector<int64_t> splits_or_equal(const std::vector<int64_t>& splits,
                                     const at::Tensor& t, int n,
                                     const std::string& what) {
  if (!splits.empty()) {
    TORCH_CHECK(static_cast<int>(splits.size()) == n, prefix(), what, ": ",
                splits.size(), " splits for a cluster of ", n);
    int64_t sum = 0;
    for (int64_t s : splits) {
      TORCH_CHECK(s >= 0, prefix(), what, ": a negative split");
      sum += s;
    }
    TORCH_CHECK(t.dim() > 0 && sum == t.size(0), prefix(), what,
                ": the splits add up to ", sum, ", not the first dimension ",
                t.dim() > 0 ? t.size(0) : 0);
    return splits;
  }
  int64_t rows = t.dim() > 0 ? t.size(0) : 1;
  TORCH_CHECK(rows % n == 0, prefix(), what, ": the first dimension ", rows,
              " does not split evenly over ", n, " ranks");
  return std::vector<int64_t>(n, rows / n);
}

// Elements per row (along the first dimension).
int64_t row_len(const at::Tensor& t) {
  if (t.dim() == 0) return 1;
  int64_t r = 1;
  for (int64_t i = 1; i < t.dim(); i++) r *= t.size(i);
  return r;
}

// Block r of `in` (in_splits[r] rows) goes to rank r; block r of `out`
// (out_splits[r] rows) comes from rank r. Uneven splits go as equal
// blocks of the largest split anywhere (an allgather of every rank's splits
// finds it first, and checks that the ranks agree on them).
c10::intrusive_ptr<c10d::Work> alltoall(const at::Tensor& in,
                                        const at::Tensor& out,
                                        std::vector<int64_t> in_splits,
                                        std::vector<int64_t> out_splits,
                                        const std::string& name) {
  auto what = quoted("alltoall", name);
  check_tensor(in, what);
  check_tensor(out, what);
  TORCH_CHECK(in.scalar_type() == out.scalar_type(), prefix(), what,
              ": output and input differ in type");
  kf_dtype dt = dtype_of(in, what);
  int n = kf_size();
  bool even = in_splits.empty() && out_splits.empty();
  // before the op exists, which a raise here would leak
  TORCH_CHECK(!even || (in.numel() == out.numel() && in.numel() % n == 0), prefix(), what,
              ": input and output must hold the same number of elements, a "
              "multiple of the cluster size ", n);
  Op* op = new_op(kf_rank(), c10d::OpType::ALLTOALL_BASE, "kungfu:all_to_all", what, {out});
  at::Tensor src = input_of(in);
  at::Tensor dst = output_of(op, out);
  if (even) {
    op->keep = {src, dst};
    op->steps.push_back([=](Op* o, kf_handle* h) {
      return kf_alltoall(ptr(src), ptr(dst), src.numel() / n, dt, name.c_str(),
                         on_done, o, h);
    });
    return start(op);
  }
  std::vector<int64_t> ins, outs;
  int64_t inner;
  try {
    ins = splits_or_equal(in_splits, src, n, what);
    outs = splits_or_equal(out_splits, dst, n, what);
    inner = row_len(src);
    TORCH_CHECK(row_len(dst) == inner, prefix(), what,
                ": input and output rows differ in length");
  } catch (...) {
    delete op;
    throw;
  }
  // Every rank's splits ([in_0..in_{n-1}, out_0..out_{n-1}]) go to every
  // rank first: each checks the whole exchange (rank s sends in_s[d] rows
  // to rank d, which expects out_d[s]) the same way, so that splits the
  // ranks disagree on fail on every rank alike rather than lose or invent
  // rows; and each finds the largest split, the padded block.
  at::Tensor mine = at::empty({2 * n}, at::kLong);
  for (int r = 0; r < n; r++) {
    mine.data_ptr<int64_t>()[r] = ins[r];
    mine.data_ptr<int64_t>()[n + r] = outs[r];
  }
  at::Tensor every = at::empty({2 * n * n}, at::kLong);
  auto most = std::make_shared<int64_t>(0);
  // The padded buffers, made once the largest split is known.
  auto pad = std::make_shared<std::pair<at::Tensor, at::Tensor>>();
  op->keep = {src, dst, mine, every};
  std::string name_splits = name + "/splits";
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_allgather(ptr(mine), ptr(every), 2 * n, KF_INT64,
                        name_splits.c_str(), on_done, o, h);
  });
  op->steps.push_back([=](Op* o, kf_handle* h) {
    const int64_t* e = every.data_ptr<int64_t>();
    int64_t largest = 0;
    for (int s = 0; s < n; s++) {
      for (int d = 0; d < n; d++) {
        int64_t sends = e[s * 2 * n + d], expects = e[d * 2 * n + n + s];
        if (sends != expects) {
          std::ostringstream m;
          m << "the ranks' splits disagree: rank " << s << " sends " << sends
            << " rows to rank " << d << ", which expects " << expects
            << " from it (input_split_sizes of a rank must match the "
               "output_split_sizes of the others)";
          throw std::runtime_error(m.str());
        }
        largest = std::max(largest, sends);
      }
    }
    *most = largest;
    int64_t block = largest * inner;
    at::Tensor send = at::zeros({block * n}, src.options());
    at::Tensor recv = at::empty({block * n}, src.options());
    at::Tensor flat_in = src.reshape({-1});
    int64_t at_row = 0;
    for (int r = 0; r < n; r++) {
      send.narrow(0, r * block, ins[r] * inner)
          .copy_(flat_in.narrow(0, at_row * inner, ins[r] * inner));
      at_row += ins[r];
    }
    pad->first = send;
    pad->second = recv;
    return kf_alltoall(ptr(send), ptr(recv), block, dt, name.c_str(), on_done, o, h);
  });
  auto prev = op->finish;  // the copy into a non-contiguous `out`
  op->finish = [=]() {
    int64_t block = *most * inner;
    at::Tensor flat_out = dst.reshape({-1});
    int64_t at_row = 0;
    for (int r = 0; r < n; r++) {
      if (outs[r] > 0) {
        flat_out.narrow(0, at_row * inner, outs[r] * inner)
            .copy_(pad->second.narrow(0, r * block, outs[r] * inner));
      }
      at_row += outs[r];
    }
    if (prev) prev();
  };
  return start(op);
}

// Every rank's `in` along the first dimension, which may differ by rank
// (the others may not): the result is the Work's result()[0]. The shapes
// are gathered first, so a mismatch fails on every rank.
c10::intrusive_ptr<c10d::Work> allgather_v(const at::Tensor& in,
                                           const std::string& name) {
  constexpr int kMaxDims = 16;
  auto what = quoted("allgather", name);
  check_tensor(in, what);
  TORCH_CHECK(in.dim() <= kMaxDims - 1, prefix(), what, ": at most ",
              kMaxDims - 1, " dimensions");
  kf_dtype dt = dtype_of(in, what);
  int n = kf_size();
  Op* op = new_op(kf_rank(), c10d::OpType::ALLGATHER, "kungfu:allgather", what, {});
  at::Tensor src = input_of(in);
  at::Tensor shape = at::full({kMaxDims}, -1, at::kLong);
  shape[0] = src.dim();
  for (int64_t i = 0; i < src.dim(); i++) shape[i + 1] = src.size(i);
  at::Tensor shapes = at::empty({n * kMaxDims}, at::kLong);
  auto bufs = std::make_shared<std::pair<at::Tensor, at::Tensor>>();
  op->keep = {src, shape, shapes};
  std::string name_shape = name + "/shape";
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_allgather(ptr(shape), ptr(shapes), kMaxDims, KF_INT64,
                        name_shape.c_str(), on_done, o, h);
  });
  op->steps.push_back([=](Op* o, kf_handle* h) {
    auto s = shapes.accessor<int64_t, 1>();
    int64_t most = 0;
    for (int r = 0; r < n; r++) {
      bool same = s[r * kMaxDims] == s[0];
      for (int i = 2; same && i < kMaxDims; i++) same = s[r * kMaxDims + i] == s[i];
      if (!same) {
        std::ostringstream m;
        m << "the tensors' shapes differ beyond the first dimension: rank 0 has "
          << shapes.narrow(0, 0, kMaxDims) << " and rank " << r << " has "
          << shapes.narrow(0, r * kMaxDims, kMaxDims) << " ([ndim, dims...])";
        throw std::runtime_error(m.str());
      }
      most = std::max(most, s[0] == 0 ? 1 : s[r * kMaxDims + 1]);
    }
    int64_t block = most * row_len(src);
    at::Tensor send = at::zeros({block}, src.options());
    send.narrow(0, 0, src.numel()).copy_(src.reshape({-1}));
    at::Tensor recv = at::empty({block * n}, src.options());
    bufs->first = send;
    bufs->second = recv;
    return kf_allgather(ptr(send), ptr(recv), block, dt, name.c_str(), on_done, o, h);
  });
  KfWork* work = op->work.get();
  op->finish = [=]() {
    auto s = shapes.accessor<int64_t, 1>();
    if (s[0] == 0) {  // scalars: one element each
      work->outputs_ = {bufs->second.clone()};
      return;
    }
    int64_t block = bufs->second.numel() / n;
    int64_t inner = row_len(src);
    std::vector<at::Tensor> parts;
    int64_t rows = 0;
    for (int r = 0; r < n; r++) {
      int64_t rr = s[r * kMaxDims + 1];
      rows += rr;
      parts.push_back(bufs->second.narrow(0, r * block, rr * inner));
    }
    std::vector<int64_t> dims(src.sizes().begin(), src.sizes().end());
    dims[0] = rows;
    work->outputs_ = {at::cat(parts).view(dims)};
  };
  return start(op);
}

c10::intrusive_ptr<c10d::Work> barrier() {
  Op* op = new_op(kf_rank(), c10d::OpType::BARRIER, "kungfu:barrier", "barrier", {});
  op->steps.push_back(
      [](Op* o, kf_handle* h) { return kf_barrier(on_done, o, h); });
  return start(op);
}

// ---- the c10d backend ----

class KungfuBackend : public c10d::Backend {
 public:
  KungfuBackend(int rank, int size, int id)
      : c10d::Backend(rank, size), id_(id) {}

  const std::string getBackendName() const override { return "kungfu"; }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    auto& t = one(tensors, "broadcast");
    return kungfu_torch::broadcast(t, t, opts.rootRank, next("broadcast"));
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    auto& t = one(tensors, "allreduce");
    return kungfu_torch::allreduce(t, t, op_of(opts.reduceOp, t, "allreduce"),
                                   next("allreduce"));
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    auto& t = one(tensors, "reduce");
    return kungfu_torch::reduce(t, op_of(opts.reduceOp, t, "reduce"),
                                opts.rootRank, next("reduce"));
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& /*opts*/) override {
    auto& in = one(inputs, "all_gather");
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                prefix(), "all_gather: one output list of ", size_, " tensors");
    for (auto& o : outputs[0]) {
      TORCH_CHECK(o.numel() == in.numel(), prefix(),
                  "all_gather: every output tensor must match the input's size");
    }
    at::Tensor flat = at::empty({in.numel() * size_}, in.options());
    return kungfu_torch::allgather(in, flat, next("all_gather"), outputs[0]);
  }

  c10::intrusive_ptr<c10d::Work> all_gather_single(
      at::Tensor& out, at::Tensor& in,
      const c10d::AllgatherOptions& /*opts*/) override {
    return kungfu_torch::allgather(in, out, next("all_gather_into_tensor"));
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& out, at::Tensor& in,
      const c10d::AllgatherOptions& opts) override {
    return all_gather_single(out, in, opts);
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    auto& in = one(inputs, "gather");
    int root = static_cast<int>(opts.rootRank);
    if (rank_ != root) {
      return kungfu_torch::gather(in, at::Tensor(), root, next("gather"));
    }
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                prefix(), "gather: the root needs one output list of ", size_, " tensors");
    at::Tensor flat = at::empty({in.numel() * size_}, in.options());
    return kungfu_torch::gather(in, flat, root, next("gather"), outputs[0]);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    auto& out = one(outputs, "reduce_scatter");
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                prefix(), "reduce_scatter: one input list of ", size_, " tensors");
    std::vector<at::Tensor> flat;
    for (auto& t : inputs[0]) {
      check_tensor(t, "reduce_scatter");
      TORCH_CHECK(t.numel() == out.numel(), prefix(),
                  "reduce_scatter: every input tensor must match the output's size");
      flat.push_back(t.reshape({-1}));
    }
    return kungfu_torch::reduce_scatter(at::cat(flat), out,
                                        op_of(opts.reduceOp, out, "reduce_scatter"),
                                        next("reduce_scatter"));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_single(
      at::Tensor& out, at::Tensor& in,
      const c10d::ReduceScatterOptions& opts) override {
    return kungfu_torch::reduce_scatter(in, out,
                                        op_of(opts.reduceOp, in, "reduce_scatter_tensor"),
                                        next("reduce_scatter_tensor"));
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& out, at::Tensor& in,
      const c10d::ReduceScatterOptions& opts) override {
    return reduce_scatter_single(out, in, opts);
  }

  c10::intrusive_ptr<c10d::Work> all_to_all_single(
      at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
      std::vector<int64_t>& in_splits,
      const c10d::AllToAllOptions& /*opts*/) override {
    return kungfu_torch::alltoall(in, out, in_splits, out_splits,
                                  next("all_to_all_single"));
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
      std::vector<int64_t>& in_splits,
      const c10d::AllToAllOptions& opts) override {
    return all_to_all_single(out, in, out_splits, in_splits, opts);
  }

  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& /*opts*/) override {
    return kungfu_torch::barrier();
  }

 private:
  at::Tensor& one(std::vector<at::Tensor>& ts, const char* what) {
    TORCH_CHECK(ts.size() == 1, prefix(), what,
                ": one tensor per call (the kungfu backend has one device per "
                "process), not ", ts.size());
    return ts[0];
  }

  // Ops of a process group are issued in the same order on every rank
  // (c10d's contract), so a counter names them: "c10d/<group>/<seq>".
  std::string next(const char* kind) {
    std::ostringstream s;
    s << "c10d/" << id_ << "/" << seq_++ << "/" << kind;
    return s.str();
  }

  int id_;
  uint64_t seq_ = 0;
};

std::atomic<int> backends{0};

// Starts the library's runtime now, with a barrier: torch creates a
// group's backend on all of its ranks together. Otherwise it starts at the
// first op, and if one rank refuses that op on its own (a bad argument,
// raised before anything is sent), the others wait for it to connect until
// the connect timeout, and the runtime has failed for good on every rank.
// A runtime that cannot start fails here too, at init_process_group or
// new_group, rather than at the first op.
void start_runtime() {
  kf_handle h = 0;
  kf_status s = kf_barrier(nullptr, nullptr, &h);
  std::string detail;
  if (s == KF_OK) {
    s = kf_wait(h, -1);
    if (s != KF_OK) {
      const char* e = kf_last_error();
      detail = e ? e : "";
    }
    kf_release(h);
  } else {
    const char* e = kf_last_error();
    detail = e ? e : "";
  }
  if (s != KF_OK) {
    throw c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                failure("starting the runtime (a barrier of the new group)",
                                        s, detail));
  }
}

c10::intrusive_ptr<c10d::Backend> create_backend(
    const c10::intrusive_ptr<c10d::Store>& /*store*/, int64_t rank,
    int64_t size, const std::chrono::duration<float>& /*timeout*/) {
  init();
  TORCH_CHECK(rank == kf_rank() && size == kf_size(), prefix(),
              "the kungfu backend spans the whole cluster of the library "
              "(rank ", kf_rank(), " of ", kf_size(),
              "), but torch asked for rank ", rank, " of ", size,
              ": process groups over a subset of the ranks are not supported, "
              "and RANK/WORLD_SIZE must agree with the launcher's");
  start_runtime();
  return c10::make_intrusive<KungfuBackend>(static_cast<int>(rank),
                                            static_cast<int>(size), backends++);
}

kf_op op_from_int(int64_t op, const at::Tensor& t, const std::string& what) {
  c10d::ReduceOp r;
  switch (op) {
    case 0: r = c10d::ReduceOp::SUM; break;
    case 1: r = c10d::ReduceOp::MIN; break;
    case 2: r = c10d::ReduceOp::MAX; break;
    case 3: r = c10d::ReduceOp::PRODUCT; break;
    case 4: r = c10d::ReduceOp::AVG; break;
    default: TORCH_CHECK(false, prefix(), what, ": unknown reduction ", op);
  }
  return op_of(r, t, what);
}

}  // namespace kungfu_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace kt = kungfu_torch;
  using Tensor = const at::Tensor&;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.doc() = "KungFu-rs for torch: the \"kungfu\" c10d backend and named ops";
  m.def("create_backend", &kt::create_backend,
        "The creator for torch.distributed.Backend.register_backend", nogil);
  m.def("init", &kt::init, nogil);
  // op: 0 SUM, 1 MIN, 2 MAX, 3 PRODUCT, 4 AVG (kungfu.h's numbers)
  m.def("allreduce",
        [](Tensor in, Tensor out, int64_t op, const std::string& name) {
          return kt::allreduce(in, out, kt::op_from_int(op, in, kt::quoted("allreduce", name)), name);
        });
  m.def("broadcast", &kt::broadcast);
  m.def("allgather", [](Tensor in, Tensor out, const std::string& name) {
    return kt::allgather(in, out, name);
  });
  m.def("allgather_v", &kt::allgather_v);
  m.def("alltoall", &kt::alltoall);
  m.def("reduce_scatter",
        [](Tensor in, Tensor out, int64_t op, const std::string& name) {
          return kt::reduce_scatter(in, out, kt::op_from_int(op, in, kt::quoted("reduce_scatter", name)), name);
        });
  m.def("barrier", &kt::barrier);
  m.def("group_start", []() {
    kf_status s = kf_group_start();
    if (s != KF_OK) kt::raise("kf_group_start", s);
  });
  m.def("group_end", []() {
    kf_status s = kf_group_end();
    if (s != KF_OK) kt::raise("kf_group_end", s);
  });
}
