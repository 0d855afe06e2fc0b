// The c10d backend "kungfu" and the Python module (see ops.cpp).

#include <pybind11/chrono.h>

#include <set>

#include "kungfu_torch.h"

namespace kungfu_torch {


class KungfuBackend;
void membership_changed();

// The live backends of groups of every rank (they run in KF_GROUP_WORLD):
// when the library's cluster changes (a reconfigure, kf_recover, a resize)
// they all take its rank and size (membership_changed).
std::mutex world_mu;
std::set<KungfuBackend*> world_live;

class KungfuBackend : public c10d::Backend {
 public:
  // `on`: the library's group this process group runs in (KF_GROUP_WORLD
  // for a group of every rank in rank order); `id` tells apart process
  // groups that share one library group. `configured`: false for a group
  // made with enable_reconfigure whose members no launcher connected: its
  // ops wait for the first reconfigure.
  KungfuBackend(int rank, int size, int id, Ranks on, bool configured = true)
      : c10d::Backend(rank, size), id_(id), on_(on), configured_(configured) {
    if (on_.group == KF_GROUP_WORLD) {
      std::lock_guard<std::mutex> g(world_mu);
      world_live.insert(this);
    }
  }

  ~KungfuBackend() override {
    if (on_.group == KF_GROUP_WORLD) {
      std::lock_guard<std::mutex> g(world_mu);
      world_live.erase(this);
    }
    // its ops in flight finish; an error (the library finalized) is moot
    if (on_.group != KF_GROUP_WORLD) kf_group_destroy(on_.group);
  }

  // Takes the library's cluster as it is now (after a reconfigure,
  // kf_recover or a resize): its rank and size; op names count from 0
  // again on every member of the new cluster. Only for groups of every
  // rank.
  void follow_library() {
    rank_ = kf_rank();
    size_ = kf_size();
    on_ = ranks_of(KF_GROUP_WORLD);
    seq_ = 0;
    configured_ = true;
  }

  const std::string getBackendName() const override { return "kungfu"; }

  // torch's fault-tolerance contract (Backend.hpp): the group of every
  // rank becomes exactly the workers whose handles are listed, in that
  // order (kf_reconfigure); this object stays, with the new rank and size.
  bool supportsReconfigure() const override { return on_.group == KF_GROUP_WORLD; }

  c10d::ReconfigureHandle get_reconfigure_handle() const override {
    TORCH_CHECK(on_.group == KF_GROUP_WORLD, prefix(),
                "get_reconfigure_handle: only the group of every rank reconfigures");
    std::vector<char> buf(512);
    int32_t len = 0;
    kf_status s = kf_reconfigure_handle(buf.data(), static_cast<int32_t>(buf.size()), &len);
    if (s == KF_OK && len >= static_cast<int32_t>(buf.size())) {
      buf.resize(static_cast<size_t>(len) + 1);
      s = kf_reconfigure_handle(buf.data(), static_cast<int32_t>(buf.size()), &len);
    }
    if (s != KF_OK) raise("get_reconfigure_handle", s);
    return std::string(buf.data(), static_cast<size_t>(len));
  }

  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override {
    TORCH_CHECK(on_.group == KF_GROUP_WORLD, prefix(),
                "reconfigure: only the group of every rank reconfigures");
    std::vector<std::string> handles;
    std::visit([&](const auto& hs) { handles.assign(hs.begin(), hs.end()); }, opts.handles);
    // a set: the backend orders it, the same way on every member
    if (std::holds_alternative<std::unordered_set<c10d::ReconfigureHandle>>(opts.handles)) {
      std::sort(handles.begin(), handles.end());
    }
    std::vector<const char*> ptrs;
    for (auto& h : handles) ptrs.push_back(h.c_str());
    int64_t timeout_ms = opts.timeout ? static_cast<int64_t>(opts.timeout->count()) : 0;
    kf_status s = kf_reconfigure(static_cast<int64_t>(opts.uuid), ptrs.data(),
                                 static_cast<int32_t>(ptrs.size()), timeout_ms);
    if (s != KF_OK) {
      // refused (a bad argument): nothing changed; failed: in no cluster
      if (s != KF_ERR_INVALID_ARGUMENT) configured_ = false;
      std::ostringstream what;
      what << "reconfigure (uuid " << opts.uuid << ", " << handles.size() << " handles)";
      raise(what.str(), s);
    }
    // this group and every other group of every rank take the new cluster
    membership_changed();
    return completed_work();
  }

  // Fails every op in flight (kf_abort); a reconfigure with a fresh uuid
  // brings the group back.
  void abort() override {
    kf_status s = kf_abort();
    if (s != KF_OK) raise("abort", s);
    configured_ = false;
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    auto& t = one(tensors, "broadcast");
    return kungfu_torch::broadcast(on_, t, t, opts.rootRank, next("broadcast"));
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    auto& t = one(tensors, "allreduce");
    return kungfu_torch::allreduce(on_, t, t, op_of(opts.reduceOp, t, "allreduce"),
                                   next("allreduce"));
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    auto& t = one(tensors, "reduce");
    return kungfu_torch::reduce(on_, t, op_of(opts.reduceOp, t, "reduce"),
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
    return kungfu_torch::allgather(on_, in, flat, next("all_gather"), outputs[0]);
  }

  c10::intrusive_ptr<c10d::Work> all_gather_single(
      at::Tensor& out, at::Tensor& in,
      const c10d::AllgatherOptions& /*opts*/) override {
    return kungfu_torch::allgather(on_, in, out, next("all_gather_into_tensor"));
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
      return kungfu_torch::gather(on_, in, at::Tensor(), root, next("gather"));
    }
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                prefix(), "gather: the root needs one output list of ", size_, " tensors");
    at::Tensor flat = at::empty({in.numel() * size_}, in.options());
    return kungfu_torch::gather(on_, in, flat, root, next("gather"), outputs[0]);
  }

  // The coalesced forms (FSDP's, and _coalescing_manager's): the ops one
  // after another, in one Work.
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    kf_op kop = tensors.empty() ? KF_SUM
                                : op_of(opts.reduceOp, tensors[0], "allreduce_coalesced");
    return kungfu_torch::coalesced(on_, kungfu_torch::Coalesced::Allreduce, tensors, tensors, kop,
                                   next("allreduce_coalesced"));
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& /*opts*/) override {
    return kungfu_torch::coalesced(on_, kungfu_torch::Coalesced::Allgather, inputs, outputs, KF_SUM,
                                   next("all_gather_into_tensor_coalesced"));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    kf_op kop = outputs.empty()
                    ? KF_SUM
                    : op_of(opts.reduceOp, outputs[0], "reduce_scatter_tensor_coalesced");
    return kungfu_torch::coalesced(on_, kungfu_torch::Coalesced::ReduceScatter, inputs, outputs, kop,
                                   next("reduce_scatter_tensor_coalesced"));
  }

  // Point to point: the tag is this group's (its id in the high half),
  // so that two groups' messages never match.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override {
    auto& t = one(tensors, "send");
    return kungfu_torch::send(on_, t, dstRank, tag_of(tag), where("send", dstRank, tag));
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override {
    auto& t = one(tensors, "recv");
    return kungfu_torch::recv(on_, t, srcRank, tag_of(tag), where("recv", srcRank, tag));
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override {
    auto& t = one(tensors, "recv");
    return kungfu_torch::recv(on_, t, -1, tag_of(tag), where("recv", -1, tag));
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    auto& out = one(outputs, "scatter");
    int root = static_cast<int>(opts.rootRank);
    if (rank_ != root) {
      return kungfu_torch::scatter(on_, at::Tensor(), out, root, next("scatter"));
    }
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                prefix(), "scatter: the root needs one input list of ", size_, " tensors");
    std::vector<at::Tensor> flat;
    for (auto& t : inputs[0]) {
      check_tensor(t, "scatter");
      TORCH_CHECK(t.numel() == out.numel() && t.scalar_type() == out.scalar_type(), prefix(),
                  "scatter: every input tensor must match the output's size and type");
      flat.push_back(t.reshape({-1}));
    }
    return kungfu_torch::scatter(on_, at::cat(flat), out, root, next("scatter"));
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
    return kungfu_torch::reduce_scatter(on_, at::cat(flat), out,
                                        op_of(opts.reduceOp, out, "reduce_scatter"),
                                        next("reduce_scatter"));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_single(
      at::Tensor& out, at::Tensor& in,
      const c10d::ReduceScatterOptions& opts) override {
    return kungfu_torch::reduce_scatter(on_, in, out,
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
    return kungfu_torch::alltoall(on_, in, out, in_splits, out_splits,
                                  next("all_to_all_single"));
  }

  // The list form: inputs[r] goes to rank r, outputs[r] comes from it;
  // sizes may differ (one uneven all_to_all of the flattened tensors).
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& /*opts*/) override {
    TORCH_CHECK(static_cast<int>(inputs.size()) == size_ &&
                    static_cast<int>(outputs.size()) == size_,
                prefix(), "all_to_all: ", size_, " input and ", size_, " output tensors, not ",
                inputs.size(), " and ", outputs.size());
    std::vector<at::Tensor> flat;
    std::vector<int64_t> in_splits, out_splits;
    int64_t total = 0;
    for (auto* list : {&inputs, &outputs}) {
      for (auto& t : *list) {
        check_tensor(t, "all_to_all");
        TORCH_CHECK(t.scalar_type() == inputs[0].scalar_type(), prefix(),
                    "all_to_all: every tensor must be of one type");
      }
    }
    for (auto& t : inputs) {
      flat.push_back(t.reshape({-1}));
      in_splits.push_back(t.numel());
    }
    for (auto& t : outputs) {
      out_splits.push_back(t.numel());
      total += t.numel();
    }
    at::Tensor out = at::empty({total}, inputs[0].options());
    return kungfu_torch::alltoall(on_, at::cat(flat), out, in_splits, out_splits,
                                  next("all_to_all"), outputs);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
      std::vector<int64_t>& in_splits,
      const c10d::AllToAllOptions& opts) override {
    return all_to_all_single(out, in, out_splits, in_splits, opts);
  }

  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& /*opts*/) override {
    check_configured("barrier");
    return kungfu_torch::barrier(on_);
  }

 private:
  at::Tensor& one(std::vector<at::Tensor>& ts, const char* what) {
    TORCH_CHECK(ts.size() == 1, prefix(), what,
                ": one tensor per call (the kungfu backend has one device per "
                "process), not ", ts.size());
    return ts[0];
  }

  void check_configured(const char* kind) const {
    TORCH_CHECK(configured_, prefix(), kind,
                ": this process group is in no cluster: it was made with "
                "enable_reconfigure=True and not reconfigured yet, or it was aborted, or its "
                "last reconfigure failed; call dist._reconfigure(uuid, handles) first");
  }

  static c10::intrusive_ptr<c10d::Work> completed_work() {
    auto f = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    f->markCompleted(c10::IValue(std::vector<at::Tensor>()));
    return c10d::Work::create_from_future(f);
  }

  // Ops of a process group are issued in the same order on every rank
  // (c10d's contract), so a counter names them: "c10d/<group>/<seq>".
  std::string next(const char* kind) {
    check_configured(kind);
    std::ostringstream s;
    s << "c10d/" << id_ << "/" << seq_++ << "/" << kind;
    return s.str();
  }

  uint64_t tag_of(int tag) const {
    return (static_cast<uint64_t>(static_cast<uint32_t>(id_)) << 32) |
           static_cast<uint32_t>(tag);
  }

  // e.g. send "to rank 1, tag 0"
  std::string where(const char* kind, int peer, int tag) const {
    check_configured(kind);
    std::ostringstream s;
    if (peer < 0) {
      s << "from any rank";
    } else {
      s << (kind[0] == 's' ? "to" : "from") << " rank " << peer;
    }
    s << ", tag " << tag;
    return kungfu_torch::quoted(kind, s.str());
  }

  int id_;
  Ranks on_;
  uint64_t seq_ = 0;
  bool configured_;
};

// Process groups of every rank made so far (they share KF_GROUP_WORLD,
// and every rank makes them in one order).
std::atomic<int> world_backends{0};

void membership_changed() {
  std::lock_guard<std::mutex> g(world_mu);
  for (KungfuBackend* b : world_live) b->follow_library();
}

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

// The backend of a process group: `ranks` are its members' global ranks
// in group order (empty: every rank), of which this process is `rank`.
// A group of every rank in rank order runs in KF_GROUP_WORLD, after a
// barrier that starts the runtime; any other in a library group that its
// members make here (kf_group_create, a collective of the members alone:
// torch creates a backend only on the group's members).
c10::intrusive_ptr<c10d::Backend> create_backend(int64_t rank, int64_t size,
                                                 std::vector<int64_t> ranks, bool reconfigure) {
  init();
  bool every = ranks.empty();
  if (!every && static_cast<int64_t>(ranks.size()) == size) {
    every = true;
    for (int64_t i = 0; i < size; i++) every = every && ranks[i] == i;
  }
  // torch's reconfigure regime (enable_reconfigure=True) for workers no
  // launcher connected as torch numbers them: the group waits for its
  // first reconfigure (the library's worker starts alone, reachable by
  // its handle).
  if (reconfigure && every && (size != kf_size() || rank != kf_rank())) {
    return c10::make_intrusive<KungfuBackend>(static_cast<int>(rank), static_cast<int>(size),
                                              world_backends++, ranks_of(KF_GROUP_WORLD), false);
  }
  bool world = ranks.empty() && size == kf_size();
  if (static_cast<int64_t>(ranks.size()) == kf_size()) {
    world = true;
    for (int64_t i = 0; i < size; i++) world = world && ranks[i] == i;
  }
  if (world) {
    TORCH_CHECK(rank == kf_rank() && size == kf_size(), prefix(),
                "torch asked for rank ", rank, " of ", size, " of every rank, "
                "but the library's cluster has this process as rank ", kf_rank(), " of ",
                kf_size(), ": RANK/WORLD_SIZE must agree with the launcher's");
    // A worker that joined a running elastic job: the others are not
    // making a group now (they meet it at the state sync that follows
    // their resize), so no barrier, and its runtime starts at its first
    // op (that sync): the others take it in once it has connected, and
    // so find it ready to sync rather than still making its model.
    if (kf_version() == 0) start_runtime();
    return c10::make_intrusive<KungfuBackend>(static_cast<int>(rank), static_cast<int>(size),
                                              world_backends++, ranks_of(KF_GROUP_WORLD));
  }
  TORCH_CHECK(static_cast<int64_t>(ranks.size()) == size && rank >= 0 && rank < size &&
                  ranks[rank] == kf_rank(),
              prefix(), "torch asked for rank ", rank, " of a group of ", size,
              " over global ranks ", c10::Join(",", ranks), ", which does not place this "
              "process (global rank ", kf_rank(), ") there");
  std::vector<int> list(ranks.begin(), ranks.end());
  kf_group_t g = KF_GROUP_WORLD;
  kf_status s = kf_group_create(list.data(), static_cast<int>(list.size()), &g);
  if (s != KF_OK) raise("making the group of ranks " + c10::Join(",", ranks), s);
  return c10::make_intrusive<KungfuBackend>(static_cast<int>(rank), static_cast<int>(size), 0,
                                            ranks_of(g));
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
        "The backend of a process group: (group rank, group size, global ranks, "
        "enable_reconfigure)",
        nogil);
  m.def("membership_changed", &kt::membership_changed,
        "Every group of every rank takes the library's cluster as it is now (after "
        "kf_recover or a resize)");
  m.def("set_job_secret", [](const std::string& secret) {
    kf_status s = kf_set_job_secret(secret.c_str());
    if (s != KF_OK) kt::raise("kf_set_job_secret", s);
  });
  m.def("init", &kt::init, nogil);
  // Every named op runs in `group` (0: KF_GROUP_WORLD, every rank).
  auto group = py::arg("group") = static_cast<uint64_t>(KF_GROUP_WORLD);
  // op: 0 SUM, 1 MIN, 2 MAX, 3 PRODUCT, 4 AVG (kungfu.h's numbers)
  // check: kf_set_check's value for the op (0: none)
  auto check = py::arg("check") = static_cast<uint64_t>(0);
  m.def("allreduce",
        [](Tensor in, Tensor out, int64_t op, const std::string& name, uint64_t g,
           uint64_t check) {
          return kt::allreduce(kt::ranks_of(g), in, out,
                               kt::op_from_int(op, in, kt::quoted("allreduce", name)), name,
                               check);
        },
        py::arg("input"), py::arg("output"), py::arg("op"), py::arg("name"), group, check);
  m.def("broadcast",
        [](Tensor in, Tensor out, int root, const std::string& name, uint64_t g,
           uint64_t check) {
          return kt::broadcast(kt::ranks_of(g), in, out, root, name, check);
        },
        py::arg("input"), py::arg("output"), py::arg("root"), py::arg("name"), group, check);
  m.def("allgather",
        [](Tensor in, Tensor out, const std::string& name, uint64_t g) {
          return kt::allgather(kt::ranks_of(g), in, out, name);
        },
        py::arg("input"), py::arg("output"), py::arg("name"), group);
  m.def("allgather_v",
        [](Tensor in, const std::string& name, uint64_t g) {
          return kt::allgather_v(kt::ranks_of(g), in, name);
        },
        py::arg("input"), py::arg("name"), group);
  m.def("alltoall",
        [](Tensor in, Tensor out, std::vector<int64_t> in_splits,
           std::vector<int64_t> out_splits, const std::string& name, uint64_t g) {
          return kt::alltoall(kt::ranks_of(g), in, out, in_splits, out_splits, name);
        },
        py::arg("input"), py::arg("output"), py::arg("in_splits"), py::arg("out_splits"),
        py::arg("name"), group);
  m.def("reduce_scatter",
        [](Tensor in, Tensor out, int64_t op, const std::string& name, uint64_t g,
           uint64_t check) {
          return kt::reduce_scatter(kt::ranks_of(g), in, out,
                                    kt::op_from_int(op, in, kt::quoted("reduce_scatter", name)),
                                    name, check);
        },
        py::arg("input"), py::arg("output"), py::arg("op"), py::arg("name"), group, check);
  m.def("barrier", [](uint64_t g) { return kt::barrier(kt::ranks_of(g)); }, group);
  // Library groups (Horovod's process sets): made by their members alone.
  m.def("group_create",
        [](std::vector<int> ranks) {
          kf_group_t g = KF_GROUP_WORLD;
          kf_status s = kf_group_create(ranks.data(), static_cast<int>(ranks.size()), &g);
          if (s != KF_OK) kt::raise("kf_group_create", s);
          return static_cast<uint64_t>(g);
        },
        nogil);
  m.def("group_destroy", [](uint64_t g) {
    kf_status s = kf_group_destroy(g);
    if (s != KF_OK) kt::raise("kf_group_destroy", s);
  });
  m.def("group_rank", [](uint64_t g) { return kt::ranks_of(g).rank; });
  m.def("group_size", [](uint64_t g) { return kt::ranks_of(g).size; });
  m.def("group_start", []() {
    kf_status s = kf_group_start();
    if (s != KF_OK) kt::raise("kf_group_start", s);
  });
  m.def("group_end", []() {
    kf_status s = kf_group_end();
    if (s != KF_OK) kt::raise("kf_group_end", s);
  });
}

