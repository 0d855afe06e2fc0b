// kungfu.hpp: a header-only C++ wrapper of kungfu.h (C++17).
//
//   kungfu::session kf;                          // kf_init; kf_finalize at scope exit
//   std::vector<float> grad(n), sum(n);
//   kungfu::handle h = kf.allreduce<float>(grad, sum, KF_SUM, "grad/fc1");
//   h.wait();                                    // throws kungfu::error on failure
//
// Every failing call throws kungfu::error, which carries the kf_status and
// the library's detail. Handles release themselves; an op whose handle is
// gone still completes (its output buffer must outlive it, as in C).
#ifndef KUNGFU_HPP
#define KUNGFU_HPP

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kungfu.h"

namespace kungfu {

/// A failed call or op.
class error : public std::runtime_error {
  public:
    error(kf_status status, const std::string &what) : std::runtime_error(what), status_(status) {}
    kf_status status() const noexcept { return status_; }

  private:
    kf_status status_;
};

/// Throws kungfu::error unless `s` is KF_OK.
inline void check(kf_status s) {
    if (s != KF_OK) {
        throw error(s, std::string(kf_status_string(s)) + ": " + kf_last_error());
    }
}

/// The kf_dtype of a C++ element type.
template <class T> struct dtype_of;
template <> struct dtype_of<std::uint8_t> { static constexpr kf_dtype value = KF_UINT8; };
template <> struct dtype_of<std::int8_t> { static constexpr kf_dtype value = KF_INT8; };
template <> struct dtype_of<std::uint16_t> { static constexpr kf_dtype value = KF_UINT16; };
template <> struct dtype_of<std::int16_t> { static constexpr kf_dtype value = KF_INT16; };
template <> struct dtype_of<std::uint32_t> { static constexpr kf_dtype value = KF_UINT32; };
template <> struct dtype_of<std::int32_t> { static constexpr kf_dtype value = KF_INT32; };
template <> struct dtype_of<std::uint64_t> { static constexpr kf_dtype value = KF_UINT64; };
template <> struct dtype_of<std::int64_t> { static constexpr kf_dtype value = KF_INT64; };
template <> struct dtype_of<float> { static constexpr kf_dtype value = KF_FLOAT32; };
template <> struct dtype_of<double> { static constexpr kf_dtype value = KF_FLOAT64; };

/// A pointer and a length, like std::span (which needs C++20); built from
/// any contiguous container with data() and size().
template <class T> class span {
  public:
    span(T *data, std::size_t size) noexcept : data_(data), size_(size) {}
    template <class C, class = decltype(std::declval<C &>().data())>
    span(C &c) noexcept : data_(c.data()), size_(c.size()) {}
    T *data() const noexcept { return data_; }
    std::size_t size() const noexcept { return size_; }

  private:
    T *data_;
    std::size_t size_;
};

/// An op in flight; released when destroyed (the op still completes).
class handle {
  public:
    handle() noexcept = default;
    explicit handle(kf_handle h) noexcept : h_(h) {}
    handle(handle &&o) noexcept : h_(std::exchange(o.h_, 0)) {}
    handle &operator=(handle &&o) noexcept {
        if (this != &o) {
            reset();
            h_ = std::exchange(o.h_, 0);
        }
        return *this;
    }
    handle(const handle &) = delete;
    handle &operator=(const handle &) = delete;
    ~handle() { reset(); }

    /// Waits for the op (timeout_ms < 0: until it completes, which the op
    /// timeout bounds); throws kungfu::error if it failed or, with
    /// KF_PENDING, if timeout_ms passed first.
    void wait(std::int64_t timeout_ms = -1) const { check(kf_wait(h_, timeout_ms)); }

    /// Whether the op completed; throws kungfu::error if it failed.
    bool done() const {
        int d = 0;
        check(kf_test(h_, &d));
        return d != 0;
    }

    kf_handle get() const noexcept { return h_; }

  private:
    void reset() noexcept {
        if (h_ != 0) {
            kf_release(h_);
            h_ = 0;
        }
    }
    kf_handle h_ = 0;
};

/// The collectives of a group of ranks (`kf_group_t`): roots, counts per
/// rank and results in the group's ranks. `session` is the world's, `comm`
/// a group made from a rank list.
class ranks {
  public:
    explicit ranks(kf_group_t g) noexcept : g_(g) {}

    int rank() const {
        int r = -1;
        check(kf_group_rank(g_, &r));
        return r;
    }
    int size() const {
        int n = -1;
        check(kf_group_size(g_, &n));
        return n;
    }

    template <class T>
    handle allreduce(span<const T> in, span<T> out, kf_op op, const std::string &name) const {
        same_size(in.size(), out.size(), "allreduce");
        kf_handle h = 0;
        check(kf_group_allreduce(g_, in.data(), out.data(), in.size(), dtype_of<T>::value, op,
                                 name.c_str(), nullptr, nullptr, &h));
        return handle(h);
    }

    template <class T> handle broadcast(span<T> buf, int root, const std::string &name) const {
        kf_handle h = 0;
        check(kf_group_broadcast(g_, buf.data(), buf.data(), buf.size(), dtype_of<T>::value, root,
                                 name.c_str(), nullptr, nullptr, &h));
        return handle(h);
    }

    template <class T> handle allgather(span<const T> in, span<T> out, const std::string &name) const {
        same_size(in.size() * static_cast<std::size_t>(size()), out.size(), "allgather");
        kf_handle h = 0;
        check(kf_group_allgather(g_, in.data(), out.data(), in.size(), dtype_of<T>::value,
                                 name.c_str(), nullptr, nullptr, &h));
        return handle(h);
    }

    handle barrier() const {
        kf_handle h = 0;
        check(kf_group_barrier(g_, nullptr, nullptr, &h));
        return handle(h);
    }

    kf_group_t id() const noexcept { return g_; }

  protected:
    kf_group_t g_;

  private:
    static void same_size(std::size_t want, std::size_t got, const char *op) {
        if (want != got) {
            throw error(KF_ERR_INVALID_ARGUMENT, std::string(op) + ": output of " + std::to_string(got) +
                                                     " elements, expected " + std::to_string(want));
        }
    }
};

/// The library for the scope of this object: kf_init on construction,
/// kf_finalize on destruction; its collectives span every rank.
class session : public ranks {
  public:
    session() : ranks(KF_GROUP_WORLD) { check(kf_init()); }
    ~session() { kf_finalize(); }
    session(const session &) = delete;
    session &operator=(const session &) = delete;

    int rank() const noexcept { return kf_rank(); }
    int size() const noexcept { return kf_size(); }
    int local_rank() const noexcept { return kf_local_rank(); }
    int local_size() const noexcept { return kf_local_size(); }

    void set_strategy(kf_strategy s) const { check(kf_set_strategy(s)); }
};

/// A group of the ranks listed (this one among them: group rank i is
/// members[i]) for the scope of this object: kf_group_create, a collective
/// of the members alone, on construction; kf_group_destroy on destruction.
class comm : public ranks {
  public:
    explicit comm(const std::vector<int> &members) : ranks(KF_GROUP_WORLD) {
        check(kf_group_create(members.data(), static_cast<int>(members.size()), &g_));
    }
    ~comm() { kf_group_destroy(g_); }
    comm(const comm &) = delete;
    comm &operator=(const comm &) = delete;
};

/// Fuses the allreduces issued between its construction and end() (or its
/// destruction, which cannot report errors): kf_group_start/kf_group_end.
class group {
  public:
    group() { check(kf_group_start()); }
    ~group() {
        if (!ended_) kf_group_end();
    }
    group(const group &) = delete;
    group &operator=(const group &) = delete;

    /// Starts the fused ops.
    void end() {
        ended_ = true;
        check(kf_group_end());
    }

  private:
    bool ended_ = false;
};

}  // namespace kungfu

#endif  // KUNGFU_HPP
