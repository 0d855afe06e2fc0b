// The torch side of KungFu-rs: a c10d::Backend named "kungfu" and the
// named, asynchronous ops of the Horovod-style API, both over kungfu.h
// and nothing else of the library.
//
// An op is a short list of steps, each one kf_* call. Its callback runs on
// a library thread and only hands the completed handle on: to a thread in
// the op's Work::wait() if there is one, else to the one completion thread
// of the process (Completions). That thread takes the op's error text
// (kf_wait, kf_last_error), releases the handle, issues the next step or
// runs the op's finishing copies, and then completes the Work and its
// Future. So callbacks of the Future (DDP's comm hooks) never run on a
// library thread, a waited op costs one hand-off, and a step that needs
// the result of the one before (the padding of an uneven alltoall) is
// issued from there.

#include "kungfu_torch.h"

namespace kungfu_torch {

extern "C" void on_done(kf_handle h, kf_status s, void* user) {
  Completions::get().push(h, s, static_cast<Op*>(user));
}

c10::intrusive_ptr<c10d::Work> allreduce(const Ranks& on, const at::Tensor& in,
                                         const at::Tensor& out, kf_op kop,
                                         const std::string& name, uint64_t check) {
  auto what = quoted("allreduce", name);
  check_tensor(in, what);
  check_tensor(out, what);
  TORCH_CHECK(in.numel() == out.numel() && in.scalar_type() == out.scalar_type(),
              prefix(), what, ": output and input differ in size or type");
  kf_dtype dt = dtype_of(in, what);
  Op* op = new_op(on.rank, c10d::OpType::ALLREDUCE, "kungfu:all_reduce", what, {out});
  at::Tensor src = input_of(in);
  at::Tensor dst = output_of(op, out);
  op->keep = {src, dst};
  op->steps.push_back([=](Op* o, kf_handle* h) {
    kf_set_check(check);
    return kf_group_allreduce(on.group, ptr(src), ptr(dst), src.numel(), dt, kop, name.c_str(),
                        on_done, o, h);
  });
  return start(op);
}

c10::intrusive_ptr<c10d::Work> broadcast(const Ranks& on, const at::Tensor& in,
                                         const at::Tensor& out, int root,
                                         const std::string& name, uint64_t check) {
  auto what = quoted("broadcast", name);
  check_tensor(in, what);
  check_tensor(out, what);
  TORCH_CHECK(in.numel() == out.numel() && in.scalar_type() == out.scalar_type(),
              prefix(), what, ": output and input differ in size or type");
  kf_dtype dt = dtype_of(in, what);
  Op* op = new_op(on.rank, c10d::OpType::BROADCAST, "kungfu:broadcast", what, {out});
  at::Tensor src = input_of(in);
  at::Tensor dst = output_of(op, out);
  op->keep = {src, dst};
  op->steps.push_back([=](Op* o, kf_handle* h) {
    kf_set_check(check);
    return kf_group_broadcast(on.group, ptr(src), ptr(dst), src.numel(), dt, root, name.c_str(),
                        on_done, o, h);
  });
  return start(op);
}

c10::intrusive_ptr<c10d::Work> reduce(const Ranks& on, const at::Tensor& t, kf_op kop, int root,
                                      const std::string& name) {
  auto what = quoted("reduce", name);
  check_tensor(t, what);
  kf_dtype dt = dtype_of(t, what);
  Op* op = new_op(on.rank, c10d::OpType::REDUCE, "kungfu:reduce", what, {t});
  at::Tensor src = input_of(t);
  at::Tensor dst = on.rank == root ? output_of(op, t) : at::Tensor();
  op->keep = {src};
  if (dst.defined()) op->keep.push_back(dst);
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_group_reduce(on.group, ptr(src), dst.defined() ? ptr(dst) : nullptr, src.numel(),
                     dt, kop, root, name.c_str(), on_done, o, h);
  });
  return start(op);
}

// Makes `op` finish, after what it does already, by copying `flat` (the
// library's output, 1-D) piece by piece into `parts` (a list form of the
// op: as many elements each as it holds), which become its result.
void scatter_into(Op* op, const at::Tensor& flat, std::vector<at::Tensor> parts) {
  if (parts.empty()) return;
  op->work->outputs_ = parts;
  auto prev = op->finish;
  op->finish = [prev, flat, parts]() {
    if (prev) prev();
    at::Tensor all = flat.reshape({-1});
    int64_t at = 0;
    for (auto& p : parts) {
      p.copy_(all.narrow(0, at, p.numel()).view(p.sizes()));
      at += p.numel();
    }
  };
}

// `out` holds size * numel(in) elements, rank by rank.
c10::intrusive_ptr<c10d::Work> allgather(const Ranks& on, const at::Tensor& in,
                                         const at::Tensor& out,
                                         const std::string& name,
                                         std::vector<at::Tensor> parts) {
  auto what = quoted("allgather", name);
  check_tensor(in, what);
  check_tensor(out, what);
  TORCH_CHECK(out.numel() == in.numel() * on.size &&
                  in.scalar_type() == out.scalar_type(),
              prefix(), what, ": the output must hold ", on.size,
              " times the input's ", in.numel(), " elements of ", in.scalar_type(),
              ", not ", out.numel(), " of ", out.scalar_type());
  kf_dtype dt = dtype_of(in, what);
  Op* op = new_op(on.rank, c10d::OpType::_ALLGATHER_BASE, "kungfu:all_gather", what, {out});
  at::Tensor src = input_of(in);
  at::Tensor dst = output_of(op, out);
  op->keep = {src, dst};
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_group_allgather(on.group, ptr(src), ptr(dst), src.numel(), dt, name.c_str(),
                        on_done, o, h);
  });
  scatter_into(op, dst, parts);
  return start(op);
}

// `out` (root only) holds size * numel(in) elements, rank by rank.
c10::intrusive_ptr<c10d::Work> gather(const Ranks& on, const at::Tensor& in,
                                      const at::Tensor& out, int root,
                                      const std::string& name,
                                      std::vector<at::Tensor> parts) {
  auto what = quoted("gather", name);
  check_tensor(in, what);
  kf_dtype dt = dtype_of(in, what);
  bool here = on.rank == root;
  if (here) {
    check_tensor(out, what);
    TORCH_CHECK(out.numel() == in.numel() * on.size &&
                    in.scalar_type() == out.scalar_type(),
                prefix(), what, ": the output must hold ", on.size,
                " times the input's elements, of its type");
  }
  Op* op = new_op(on.rank, c10d::OpType::GATHER, "kungfu:gather", what,
                  here ? std::vector<at::Tensor>{out} : std::vector<at::Tensor>{});
  at::Tensor src = input_of(in);
  at::Tensor dst = here ? output_of(op, out) : at::Tensor();
  op->keep = {src};
  if (here) op->keep.push_back(dst);
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_group_gather(on.group, ptr(src), here ? ptr(dst) : nullptr, src.numel(), dt, root,
                     name.c_str(), on_done, o, h);
  });
  if (here) scatter_into(op, dst, parts);
  return start(op);
}

c10::intrusive_ptr<c10d::Work> send(const Ranks& on, const at::Tensor& t, int dst, uint64_t tag,
                                    const std::string& what) {
  check_tensor(t, what);
  Op* op = new_op(on.rank, c10d::OpType::SEND, "kungfu:send", what, {});
  at::Tensor src = input_of(t);
  op->keep = {src};
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_group_send(on.group, dst, tag, ptr(src), src.nbytes(), on_done, o, h);
  });
  return start(op);
}

c10::intrusive_ptr<c10d::Work> recv(const Ranks& on, const at::Tensor& t, int src, uint64_t tag,
                                    const std::string& what) {
  check_tensor(t, what);
  Op* op = new_op(on.rank, src < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV,
                  "kungfu:recv", what, {t});
  at::Tensor dst = output_of(op, t);
  op->keep = {dst};
  int* source = &op->work->source_;
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_group_recv(on.group, src < 0 ? KF_ANY_SOURCE : src, tag, ptr(dst), dst.nbytes(), source,
                   on_done, o, h);
  });
  return start(op);
}

// `in` (root only) holds size * numel(out) elements, rank by rank; rank r
// gets block r.
c10::intrusive_ptr<c10d::Work> scatter(const Ranks& on, const at::Tensor& in,
                                       const at::Tensor& out, int root,
                                       const std::string& name) {
  auto what = quoted("scatter", name);
  check_tensor(out, what);
  kf_dtype dt = dtype_of(out, what);
  bool here = on.rank == root;
  if (here) {
    check_tensor(in, what);
    TORCH_CHECK(in.numel() == out.numel() * on.size &&
                    in.scalar_type() == out.scalar_type(),
                prefix(), what, ": the input must hold ", on.size,
                " times the output's elements, of its type");
  }
  Op* op = new_op(on.rank, c10d::OpType::SCATTER, "kungfu:scatter", what, {out});
  at::Tensor src = here ? input_of(in) : at::Tensor();
  at::Tensor dst = output_of(op, out);
  op->keep = {dst};
  if (here) op->keep.push_back(src);
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_group_scatter(on.group, here ? ptr(src) : nullptr, ptr(dst), dst.numel(), dt, root,
                      name.c_str(), on_done, o, h);
  });
  return start(op);
}

// `in` holds size * numel(out) elements; rank r gets the reduction of
// block r.
c10::intrusive_ptr<c10d::Work> reduce_scatter(const Ranks& on, const at::Tensor& in,
                                              const at::Tensor& out, kf_op kop,
                                              const std::string& name, uint64_t check) {
  auto what = quoted("reduce_scatter", name);
  check_tensor(in, what);
  check_tensor(out, what);
  TORCH_CHECK(in.numel() == out.numel() * on.size &&
                  in.scalar_type() == out.scalar_type(),
              prefix(), what, ": the input must hold ", on.size,
              " times the output's ", out.numel(), " elements of its type, not ",
              in.numel());
  kf_dtype dt = dtype_of(in, what);
  Op* op = new_op(on.rank, c10d::OpType::_REDUCE_SCATTER_BASE, "kungfu:reduce_scatter", what, {out});
  at::Tensor src = input_of(in);
  at::Tensor dst = output_of(op, out);
  op->keep = {src, dst};
  op->steps.push_back([=](Op* o, kf_handle* h) {
    kf_set_check(check);
    return kf_group_reduce_scatter(on.group, ptr(src), ptr(dst), dst.numel(), dt, kop,
                             name.c_str(), on_done, o, h);
  });
  return start(op);
}

// The coalesced op of tensors of one type as one library op: the inputs
// are laid out in one buffer as the op's blocks need (for a reduce-scatter,
// block r holds block r of every input in turn), and the output is cut
// back into the outputs when the op finishes (for an all-gather, rank r's
// block of the output holds rank r's block of every output in turn).
void packed(const Ranks& on, Op* op, Coalesced kind, const std::vector<at::Tensor>& ins,
            const std::vector<at::Tensor>& outs, kf_op kop, kf_dtype dt,
            const std::string& name) {
  const int64_t n = on.size;
  // per rank's block: each input's share of it, and where it starts
  std::vector<int64_t> len, at;
  int64_t block = 0;
  for (auto& t : (kind == Coalesced::ReduceScatter ? outs : ins)) {
    at.push_back(block);
    len.push_back(t.numel());
    block += t.numel();
  }
  const int64_t blocks = kind == Coalesced::Allgather ? n : 1;  // of the output
  at::Tensor src = at::empty({kind == Coalesced::ReduceScatter ? block * n : block},
                             ins[0].options());
  for (size_t i = 0; i < ins.size(); i++) {
    if (kind == Coalesced::ReduceScatter) {
      src.view({n, block}).narrow(1, at[i], len[i]).copy_(ins[i].reshape({n, len[i]}));
    } else {
      src.narrow(0, at[i], len[i]).copy_(ins[i].reshape({-1}));
    }
  }
  at::Tensor dst = at::empty({kind == Coalesced::Allgather ? block * n : block}, ins[0].options());
  op->keep = {src, dst};
  op->steps.push_back([=](Op* o, kf_handle* h) {
    switch (kind) {
      case Coalesced::Allreduce:
        return kf_group_allreduce(on.group, ptr(src), ptr(dst), block, dt, kop, name.c_str(),
                                  on_done, o, h);
      case Coalesced::Allgather:
        return kf_group_allgather(on.group, ptr(src), ptr(dst), block, dt, name.c_str(), on_done,
                                  o, h);
      default:
        return kf_group_reduce_scatter(on.group, ptr(src), ptr(dst), block, dt, kop,
                                       name.c_str(), on_done, o, h);
    }
  });
  std::vector<at::Tensor> targets = outs;
  op->finish = [=]() {
    at::Tensor all = dst.view({blocks, block});
    for (size_t i = 0; i < targets.size(); i++) {
      at::Tensor piece = all.narrow(1, at[i], len[i]);
      if (targets[i].is_contiguous()) {
        targets[i].view({blocks, len[i]}).copy_(piece);
      } else {
        targets[i].copy_(piece.reshape(targets[i].sizes()));
      }
    }
  };
}

c10::intrusive_ptr<c10d::Work> coalesced(const Ranks& on, Coalesced kind, const std::vector<at::Tensor>& ins,
                                         const std::vector<at::Tensor>& outs, kf_op kop,
                                         const std::string& name) {
  const char* k = kind == Coalesced::Allreduce   ? "allreduce_coalesced"
                  : kind == Coalesced::Allgather ? "all_gather_into_tensor_coalesced"
                                                 : "reduce_scatter_tensor_coalesced";
  auto what = quoted(k, name);
  TORCH_CHECK(ins.size() == outs.size(), prefix(), what, ": ", ins.size(), " inputs and ",
              outs.size(), " outputs");
  const int64_t n = on.size;
  std::vector<kf_dtype> dts;
  for (size_t i = 0; i < ins.size(); i++) {
    check_tensor(ins[i], what);
    check_tensor(outs[i], what);
    const int64_t in = ins[i].numel(), out = outs[i].numel();
    bool fits = kind == Coalesced::Allgather       ? out == in * n
                : kind == Coalesced::ReduceScatter ? in == out * n
                                                   : in == out;
    TORCH_CHECK(fits && ins[i].scalar_type() == outs[i].scalar_type(), prefix(), what,
                ": tensor ", i, ": an output of ", out, " elements for an input of ", in,
                " on ", n, " ranks, or of another type");
    dts.push_back(dtype_of(ins[i], what));
  }
  const c10d::OpType type = kind == Coalesced::Allreduce   ? c10d::OpType::ALLREDUCE_COALESCED
                            : kind == Coalesced::Allgather ? c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED
                                                           : c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
  if (ins.empty()) {
    auto w = c10::make_intrusive<KfWork>(on.rank, type, "kungfu:coalesced", outs);
    w->complete(nullptr);
    return w;
  }
  Op* op = new_op(on.rank, type, "kungfu:coalesced", what, outs);
  bool one_type = std::all_of(dts.begin(), dts.end(), [&](kf_dtype d) { return d == dts[0]; });
  if (one_type) {
    packed(on, op, kind, ins, outs, kop, dts[0], name);
    return start(op);
  }
  // tensors of several types: one op each, one after another
  for (size_t i = 0; i < ins.size(); i++) {
    at::Tensor src = input_of(ins[i]);
    at::Tensor dst = output_of(op, outs[i]);
    op->keep.push_back(src);
    op->keep.push_back(dst);
    std::string each = name + "/" + std::to_string(i);
    kf_dtype dt = dts[i];
    op->steps.push_back([=](Op* o, kf_handle* h) {
      switch (kind) {
        case Coalesced::Allreduce:
          return kf_group_allreduce(on.group, ptr(src), ptr(dst), src.numel(), dt, kop, each.c_str(), on_done,
                              o, h);
        case Coalesced::Allgather:
          return kf_group_allgather(on.group, ptr(src), ptr(dst), src.numel(), dt, each.c_str(), on_done, o, h);
        default:
          return kf_group_reduce_scatter(on.group, ptr(src), ptr(dst), dst.numel(), dt, kop, each.c_str(),
                                   on_done, o, h);
      }
    });
  }
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
c10::intrusive_ptr<c10d::Work> alltoall(const Ranks& on, const at::Tensor& in,
                                        const at::Tensor& out,
                                        std::vector<int64_t> in_splits,
                                        std::vector<int64_t> out_splits,
                                        const std::string& name,
                                        std::vector<at::Tensor> parts) {
  auto what = quoted("alltoall", name);
  check_tensor(in, what);
  check_tensor(out, what);
  TORCH_CHECK(in.scalar_type() == out.scalar_type(), prefix(), what,
              ": output and input differ in type");
  kf_dtype dt = dtype_of(in, what);
  int n = on.size;
  bool even = in_splits.empty() && out_splits.empty();
  // before the op exists, which a raise here would leak
  TORCH_CHECK(!even || (in.numel() == out.numel() && in.numel() % n == 0), prefix(), what,
              ": input and output must hold the same number of elements, a "
              "multiple of the cluster size ", n);
  Op* op = new_op(on.rank, parts.empty() ? c10d::OpType::ALLTOALL_BASE : c10d::OpType::ALLTOALL,
                  "kungfu:all_to_all", what, {out});
  at::Tensor src = input_of(in);
  at::Tensor dst = output_of(op, out);
  if (even) {
    op->keep = {src, dst};
    op->steps.push_back([=](Op* o, kf_handle* h) {
      return kf_group_alltoall(on.group, ptr(src), ptr(dst), src.numel() / n, dt, name.c_str(),
                         on_done, o, h);
    });
    scatter_into(op, dst, parts);
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
    return kf_group_allgather(on.group, ptr(mine), ptr(every), 2 * n, KF_INT64,
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
    return kf_group_alltoall(on.group, ptr(send), ptr(recv), block, dt, name.c_str(), on_done, o, h);
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
  scatter_into(op, dst, parts);
  return start(op);
}

// Every rank's `in` along the first dimension, which may differ by rank
// (the others may not): the result is the Work's result()[0]. The shapes
// are gathered first, so a mismatch fails on every rank.
c10::intrusive_ptr<c10d::Work> allgather_v(const Ranks& on, const at::Tensor& in,
                                           const std::string& name) {
  constexpr int kMaxDims = 16;
  auto what = quoted("allgather", name);
  check_tensor(in, what);
  TORCH_CHECK(in.dim() <= kMaxDims - 1, prefix(), what, ": at most ",
              kMaxDims - 1, " dimensions");
  kf_dtype dt = dtype_of(in, what);
  int n = on.size;
  Op* op = new_op(on.rank, c10d::OpType::ALLGATHER, "kungfu:allgather", what, {});
  at::Tensor src = input_of(in);
  at::Tensor shape = at::full({kMaxDims}, -1, at::kLong);
  shape[0] = src.dim();
  for (int64_t i = 0; i < src.dim(); i++) shape[i + 1] = src.size(i);
  at::Tensor shapes = at::empty({n * kMaxDims}, at::kLong);
  auto bufs = std::make_shared<std::pair<at::Tensor, at::Tensor>>();
  op->keep = {src, shape, shapes};
  std::string name_shape = name + "/shape";
  op->steps.push_back([=](Op* o, kf_handle* h) {
    return kf_group_allgather(on.group, ptr(shape), ptr(shapes), kMaxDims, KF_INT64,
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
    return kf_group_allgather(on.group, ptr(send), ptr(recv), block, dt, name.c_str(), on_done, o, h);
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

c10::intrusive_ptr<c10d::Work> barrier(const Ranks& on) {
  Op* op = new_op(on.rank, c10d::OpType::BARRIER, "kungfu:barrier", "barrier", {});
  op->steps.push_back(
      [on](Op* o, kf_handle* h) { return kf_group_barrier(on.group, on_done, o, h); });
  return start(op);
}

}  // namespace kungfu_torch
