//! Generators: one plan per (op kind, topology shape).
//!
//! All offsets are computed in elements and turned into byte ranges at the
//! end, with `usize` arithmetic throughout (ops of more than 4 GiB work).
//!
//! Tags: `chunk` numbers the chunk (for block-wise ops, `block * chunks +
//! chunk`), `step` the phase (tree reduce 0, tree broadcast 1; ring steps
//! `0..2(n-1)`).

use std::ops::Range;

use kungfu_topology::{Graph, Rank, Root, Shape, Topology};

use super::{chunks, segment, ActionId, Plan, PlanBuilder};
use crate::{OpKind, OpSpec, Order, ReduceOp};

/// How to cut and where to run one op.
pub struct PlanInput<'a> {
    pub spec: &'a OpSpec,
    pub me: Rank,
    pub size: usize,
    /// Largest chunk in bytes (at least one element).
    pub chunk_bytes: usize,
    /// The topology for a root (`Root::Any` for unrooted ops); block-wise
    /// tree algorithms ask for one per block owner.
    pub topology: &'a dyn Fn(Root) -> std::sync::Arc<Topology>,
}

struct Ctx<'a> {
    me: Rank,
    n: usize,
    esize: usize,
    b: PlanBuilder,
    input: &'a PlanInput<'a>,
}

impl Ctx<'_> {
    fn bytes(&self, r: &Range<usize>) -> Range<usize> {
        r.start * self.esize..r.end * self.esize
    }

    /// Reduce `range` along `g` into its root: receive from every child,
    /// then send to the parent. Returns (receives, send to parent).
    fn tree_reduce(
        &mut self,
        g: &Graph,
        chunk: u32,
        step: u16,
        range: &Range<usize>,
    ) -> (Vec<ActionId>, Option<ActionId>) {
        let br = self.bytes(range);
        let recvs: Vec<ActionId> = g
            .prevs(self.me)
            .iter()
            .map(|&c| self.b.recv(c, chunk, step, br.clone(), true, &[]))
            .collect();
        let send = g
            .nexts(self.me)
            .first()
            .map(|&p| self.b.send(p, chunk, step, br.clone(), &recvs));
        (recvs, send)
    }

    /// Broadcast `range` along `g` from its root. A non-root receives once
    /// `before_recv` are done (it must not overwrite bytes still to be
    /// sent); the root sends once `root_deps` are done.
    fn tree_bcast(
        &mut self,
        g: &Graph,
        chunk: u32,
        step: u16,
        range: &Range<usize>,
        before_recv: &[ActionId],
        root_deps: &[ActionId],
    ) {
        let br = self.bytes(range);
        let recv;
        let deps: &[ActionId] = match g.prevs(self.me).first() {
            Some(&p) => {
                recv = [self.b.recv(p, chunk, step, br.clone(), false, before_recv)];
                &recv
            }
            None => root_deps,
        };
        for &c in g.nexts(self.me) {
            self.b.send(c, chunk, step, br.clone(), deps);
        }
    }

    /// This rank's position in the ring `order`, and its next and previous
    /// ranks.
    fn ring_place(&self, order: &[Rank]) -> (usize, Rank, Rank) {
        let n = order.len();
        let pos = order
            .iter()
            .position(|&r| r == self.me)
            .expect("me in ring");
        (pos, order[(pos + 1) % n], order[(pos + n - 1) % n])
    }

    /// Ring reduce-scatter of one chunk: after it, position `pos` holds the
    /// full reduction of segment `pos`. `seg(k)` is segment `k`'s element
    /// range. Returns the sends and receives by step.
    fn ring_rs(
        &mut self,
        order: &[Rank],
        chunk: u32,
        seg: &dyn Fn(usize) -> Range<usize>,
    ) -> (Vec<ActionId>, Vec<ActionId>) {
        let n = self.n;
        let (pos, next, prev) = self.ring_place(order);
        let mut sends = Vec::with_capacity(n - 1);
        let mut recvs: Vec<ActionId> = Vec::with_capacity(n - 1);
        for s in 0..n - 1 {
            // Position pos sends segment pos-s-1 and receives pos-s-2, so it
            // ends owning segment pos; a segment is reduced into before it
            // is forwarded (the send depends on the previous receive).
            let deps: Vec<ActionId> = recvs.last().copied().into_iter().collect();
            let out = self.bytes(&seg((pos + 2 * n - s - 1) % n));
            sends.push(self.b.send(next, chunk, s as u16, out, &deps));
            let inn = self.bytes(&seg((pos + 2 * n - s - 2) % n));
            recvs.push(self.b.recv(prev, chunk, s as u16, inn, true, &[]));
        }
        (sends, recvs)
    }

    /// Ring allgather of one chunk, position `pos` starting with segment
    /// `pos`. `first_deps` gate the first send; `recv_deps(s)` gate the
    /// receive of step `s` (it overwrites a segment that may still have to
    /// be sent by an earlier phase). Steps are numbered from `step0`.
    fn ring_ag(
        &mut self,
        order: &[Rank],
        chunk: u32,
        step0: usize,
        seg: &dyn Fn(usize) -> Range<usize>,
        first_deps: &[ActionId],
        recv_deps: &dyn Fn(usize) -> Vec<ActionId>,
    ) {
        let n = self.n;
        let (pos, next, prev) = self.ring_place(order);
        let mut last: Vec<ActionId> = first_deps.to_vec();
        for s in 0..n - 1 {
            let step = (step0 + s) as u16;
            let out = self.bytes(&seg((pos + n - s) % n));
            self.b.send(next, chunk, step, out, &last);
            let inn = self.bytes(&seg((pos + 2 * n - s - 1) % n));
            last = vec![self.b.recv(prev, chunk, step, inn, false, &recv_deps(s))];
        }
    }
}

impl Ctx<'_> {
    /// Broadcast of `count` elements from `root` as a scatter then a ring
    /// allgather (van de Geijn's large broadcast): ranks in ring order
    /// from the root (rank order, rotated), position `k` owns segment `k`
    /// (`n` near-equal parts); the root sends segment `k` to position `k`
    /// (step 0), then each segment goes round the ring as in an allgather
    /// (steps `1..n`), except into the root, which holds them all: the
    /// root's successor gets the segments from it instead. Every rank sends
    /// and receives about `(n-1)/n` of the buffer per phase, and each
    /// segment is cut into chunks that move on as soon as they arrive.
    fn scatter_ring(&mut self, root: Rank, count: usize, chunk_elems: usize) -> Result<(), String> {
        let n = self.n;
        let order: Vec<Rank> = (0..n)
            .map(|i| Rank(((root.idx() + i) % n) as u32))
            .collect();
        let pos = (self.me.idx() + n - root.idx()) % n;
        let seg = |k: usize| segment(&(0..count), n, k);
        let per = seg(0).len().div_ceil(chunk_elems).max(1);
        if n.checked_mul(per)
            .is_none_or(|t| t >= CONFIRM_CHUNK as usize)
        {
            return Err(format!(
                "{per} chunks per segment of {n} are more than a frame tag can number; \
                 raise the chunk size"
            ));
        }
        let pieces = |k: usize| {
            let s = seg(k);
            chunks(s.len(), chunk_elems).map(move |c| s.start + c.start..s.start + c.end)
        };
        let tag = |k: usize, c: usize| (k * per + c) as u32;
        // have[k][c]: the receive that brought piece c of segment k here
        // (none at the root, which has them all)
        let mut have: Vec<Vec<Option<ActionId>>> = vec![Vec::new(); n];
        if pos == 0 {
            for (k, &to) in order.iter().enumerate().skip(1) {
                for (c, r) in pieces(k).enumerate() {
                    let br = self.bytes(&r);
                    self.b.send(to, tag(k, c), 0, br, &[]);
                }
            }
            for (k, h) in have.iter_mut().enumerate() {
                *h = vec![None; pieces(k).len()];
            }
        } else {
            have[pos] = pieces(pos)
                .enumerate()
                .map(|(c, r)| {
                    let br = self.bytes(&r);
                    Some(self.b.recv(root, tag(pos, c), 0, br, false, &[]))
                })
                .collect();
        }
        let (next, prev) = (order[(pos + 1) % n], order[(pos + n - 1) % n]);
        for s in 0..n - 1 {
            let step = (s + 1) as u16;
            if pos != n - 1 {
                let k = (pos + n - s) % n;
                for (c, r) in pieces(k).enumerate() {
                    let br = self.bytes(&r);
                    let deps: Vec<ActionId> = have[k][c].into_iter().collect();
                    self.b.send(next, tag(k, c), step, br, &deps);
                }
            }
            if pos != 0 {
                let k = (pos + 2 * n - s - 1) % n;
                have[k] = pieces(k)
                    .enumerate()
                    .map(|(c, r)| {
                        let br = self.bytes(&r);
                        Some(self.b.recv(prev, tag(k, c), step, br, false, &[]))
                    })
                    .collect();
            }
        }
        Ok(())
    }

    /// Recursive-doubling allreduce of every chunk over positions in
    /// `order` (see `Strategy::RecursiveDoubling`). Steps: 0 folds the
    /// extra ranks in, `1..=rounds` are the exchanges, `rounds + 1` hands
    /// the result back to the extras. Partners reduce lower position first,
    /// so both get the same bits.
    fn butterfly(&mut self, order: &[Rank], cs: &[Range<usize>]) {
        let n = self.n;
        let pos = order
            .iter()
            .position(|&r| r == self.me)
            .expect("me in order");
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let rounds = p.trailing_zeros() as u16;
        for (c, r) in cs.iter().enumerate() {
            let (c, br) = (c as u32, self.bytes(r));
            if pos >= p {
                let partner = order[pos - p];
                let s = self.b.send(partner, c, 0, br.clone(), &[]);
                self.b.recv(partner, c, rounds + 1, br, false, &[s]);
                continue;
            }
            let extra = (pos + p < n).then(|| order[pos + p]);
            let mut last: Vec<ActionId> = Vec::new();
            if let Some(e) = extra {
                let fold = self
                    .b
                    .recv_with(e, c, 0, br.clone(), Some(Order::DstFirst), &[]);
                last.push(fold);
            }
            for k in 0..rounds {
                let q = pos ^ (1 << k);
                let s = self.b.send(order[q], c, k + 1, br.clone(), &last);
                let ord = if pos < q {
                    Order::DstFirst
                } else {
                    Order::SrcFirst
                };
                last = vec![self
                    .b
                    .recv_with(order[q], c, k + 1, br.clone(), Some(ord), &[s])];
            }
            if let Some(e) = extra {
                self.b.send(e, c, rounds + 1, br, &last);
            }
        }
    }
}

/// Whether a broadcast of `nchunks` chunks along `g` from `root` goes as a
/// scatter then a ring allgather ([`Ctx::scatter_ring`]) instead of down
/// the tree: when the root sends more than once (a star, binomial or
/// binary tree: it sends the whole buffer to each child, where the scatter
/// and the ring make every rank send `2 (n-1)/n` of it) and there are at
/// least `n` chunks (each rank's segment a chunk or more; below that the
/// tree's fewer steps win). A chain (the ring strategy's broadcast, and
/// `AUTO`'s for large messages) sends once per rank and stays a pipelined
/// chain. Measured with 4 ranks over TCP, each process's egress shaped to
/// 200 MB/s (`KUNGFU_FAULTS=rate_mb=200`), 16 MiB: a binomial tree 173 ms,
/// a star 257, this 146, the chain 110 (the line rate is 84). Over plain
/// loopback the two ways are within noise of each other (0.8-1.3x): one
/// CPU moves every byte there, so fewer bytes per link buy nothing.
fn scatters(g: &Graph, root: Rank, nchunks: usize, n: usize) -> bool {
    n > 2 && nchunks >= n && g.nexts(root).len() > 1
}

fn pairs_of(t: &Topology) -> &[kungfu_topology::GraphPair] {
    match t.shape() {
        Shape::Trees(p) => p,
        Shape::Ring(_) | Shape::Butterfly(_) => unreachable!("rooted topologies are trees"),
    }
}

/// The smallest frame a ring allreduce cuts a chunk into (see the ring
/// arm of [`build`]): a piece of the buffer goes round the ring in `n`
/// segments, so a piece is `max(chunk, n * RING_MIN_FRAME)` bytes.
pub const RING_MIN_FRAME: usize = 64 * 1024;

/// The chunk tag of a rooted op's confirmations (see `Ctx::confirm`); no
/// data frame has it (an op's tags are fewer than `u32::MAX`).
pub const CONFIRM_CHUNK: u32 = u32::MAX;

/// Up to this many ranks a rooted op's confirmations go directly between
/// every pair (one hop, `n - 1` empty frames per rank); above it, up and
/// down the root's tree (two hops per level, a frame per link).
pub const DIRECT_CONFIRM_MAX: usize = 8;

impl Ctx<'_> {
    /// A rooted op's confirmations (broadcast, reduce, gather), beside its
    /// data. Each is an empty frame that carries its sender's digest, so
    /// every rank hears that every other agrees on the op (kind, root,
    /// type, count, topology) before it completes: a disagreement fails
    /// the op on every rank (the rank that sees it aborts it everywhere),
    /// where a root that only sends, or a leaf that only sends, would have
    /// completed. Up to [`DIRECT_CONFIRM_MAX`] ranks each sends one to
    /// every other and waits for theirs (step 0); above, a frame goes up
    /// the root's tree (step 0) once this rank's subtree has confirmed,
    /// and from the root a release down it (step 1), which a rank waits
    /// for. The confirmations do not wait for the data: they add to an
    /// op's latency only where the data is faster than they are.
    fn confirm(&mut self, root: Rank) {
        if self.n <= DIRECT_CONFIRM_MAX {
            for j in (0..self.n as u32).map(Rank).filter(|&j| j != self.me) {
                self.b.send(j, CONFIRM_CHUNK, 0, 0..0, &[]);
                self.b.recv(j, CONFIRM_CHUNK, 0, 0..0, false, &[]);
            }
            return;
        }
        let topo = (self.input.topology)(Root::At(root));
        let g = &pairs_of(&topo)[0].reduce;
        let ups: Vec<ActionId> = g
            .prevs(self.me)
            .iter()
            .map(|&c| self.b.recv(c, CONFIRM_CHUNK, 0, 0..0, false, &[]))
            .collect();
        let release = match g.nexts(self.me).first() {
            Some(&parent) => {
                self.b.send(parent, CONFIRM_CHUNK, 0, 0..0, &ups);
                vec![self.b.recv(parent, CONFIRM_CHUNK, 1, 0..0, false, &[])]
            }
            None => ups,
        };
        for &c in g.prevs(self.me) {
            self.b.send(c, CONFIRM_CHUNK, 1, 0..0, &release);
        }
    }
}

/// A broadcast's chunks are cut to a quarter of the op, down to this
/// size, so that a broadcast of a few chunks' worth pipelines along its
/// chain or tree: each hop forwards a chunk while the next arrives.
pub const PIPELINE_MIN_CHUNK: usize = 256 << 10;

/// The chunk size of an op: the configured one; a broadcast's, at most a
/// quarter of the op and at least [`PIPELINE_MIN_CHUNK`]. Measured over
/// TCP on loopback (kungfu-bench, 2 ranks, out of place): a 1 MiB
/// broadcast took 262-329 us in one 1 MiB chunk and 190-211 us in four
/// of 256 KiB; other ops (allreduce, allgather) and larger broadcasts were
/// as fast or slower with smaller chunks, each chunk costing its frames'
/// wake-ups (docs/speed.md, "TCP against Open MPI's tcp btl").
fn chunk_bytes(spec: &OpSpec, configured: usize) -> usize {
    let bytes = spec.block_bytes().unwrap_or(0);
    match spec.kind {
        OpKind::Broadcast { .. } => configured.min(PIPELINE_MIN_CHUNK.max(bytes.div_ceil(4))),
        _ => configured,
    }
}

/// Builds rank `input.me`'s plan. Fails only if the op needs more tags than
/// the header can carry (an absurdly small chunk size for the count).
pub fn build(input: &PlanInput<'_>) -> Result<Plan, String> {
    let spec = input.spec;
    let n = input.size;
    let esize = spec.dtype.size();
    let chunk_elems = (chunk_bytes(spec, input.chunk_bytes) / esize).max(1);
    let mut cx = Ctx {
        me: input.me,
        n,
        esize,
        b: PlanBuilder::new(),
        input,
    };
    let op = spec.kind.reduce_op().unwrap_or(ReduceOp::Sum);
    if n == 1 {
        return Ok(cx.b.finish(spec.dtype, op));
    }
    let count = spec.count;
    let cs: Vec<Range<usize>> = chunks(count, chunk_elems).collect();
    let nchunks = cs.len();
    let blockwise = matches!(
        spec.kind,
        OpKind::Allgather
            | OpKind::Gather { .. }
            | OpKind::ReduceScatter(_)
            | OpKind::Alltoall
            | OpKind::Scatter { .. }
    );
    let tags = if blockwise {
        nchunks.checked_mul(n)
    } else {
        Some(nchunks)
    };
    if tags.is_none_or(|t| t >= CONFIRM_CHUNK as usize) {
        return Err(format!(
            "{} chunks of {} bytes are more than a frame tag can number; raise the chunk size",
            nchunks, input.chunk_bytes
        ));
    }
    let tag = |block: usize, c: usize| (block * nchunks + c) as u32;
    let block = |j: usize, r: &Range<usize>| j * count + r.start..j * count + r.end;

    match spec.kind {
        OpKind::Allreduce(_) => {
            let topo = (cx.input.topology)(Root::Any);
            match topo.shape() {
                Shape::Trees(pairs) => {
                    for (c, r) in cs.iter().enumerate() {
                        let p = &pairs[c % pairs.len()];
                        let (recvs, up) = cx.tree_reduce(&p.reduce, c as u32, 0, r);
                        let before: Vec<ActionId> = up.into_iter().collect();
                        cx.tree_bcast(&p.broadcast, c as u32, 1, r, &before, &recvs);
                    }
                }
                Shape::Butterfly(order) => cx.butterfly(order, &cs),
                Shape::Ring(order) => {
                    // Each piece goes round the ring in n segments: a
                    // piece is a chunk, or n frames of RING_MIN_FRAME bytes
                    // when that is more (rings of more than 16 workers at
                    // the default 1 MiB chunk), so that a large ring does
                    // not send 2(n-1) tiny frames per chunk (kungfu-sim: 64
                    // MiB on 256 workers took 13x the line rate with 1 MiB
                    // pieces).
                    let piece = (RING_MIN_FRAME / esize)
                        .max(1)
                        .saturating_mul(n)
                        .max(chunk_elems);
                    let pieces: Vec<Range<usize>> = if piece == chunk_elems {
                        cs.clone()
                    } else {
                        chunks(count, piece).collect()
                    };
                    for (c, r) in pieces.iter().enumerate() {
                        let seg = |k: usize| segment(r, n, k);
                        let (sends, recvs) = cx.ring_rs(order, c as u32, &seg);
                        let last = [*recvs.last().expect("n > 1")];
                        cx.ring_ag(order, c as u32, n - 1, &seg, &last, &|s| vec![sends[s]]);
                    }
                }
            }
        }
        OpKind::Reduce { root, .. } => {
            let topo = (cx.input.topology)(Root::At(root));
            let g = &pairs_of(&topo)[0].reduce;
            for (c, r) in cs.iter().enumerate() {
                cx.tree_reduce(g, c as u32, 0, r);
            }
        }
        OpKind::Broadcast { root } => {
            let topo = (cx.input.topology)(Root::At(root));
            let g = &pairs_of(&topo)[0].broadcast;
            if scatters(g, root, nchunks, n) {
                cx.scatter_ring(root, count, chunk_elems)?;
            } else {
                for (c, r) in cs.iter().enumerate() {
                    cx.tree_bcast(g, c as u32, 0, r, &[], &[]);
                }
            }
        }
        OpKind::Allgather => {
            let topo = (cx.input.topology)(Root::Any);
            match topo.shape() {
                Shape::Ring(order) => {
                    for (c, r) in cs.iter().enumerate() {
                        let seg = |k: usize| block(order[k].idx(), r);
                        cx.ring_ag(order, tag(0, c), 0, &seg, &[], &|_| Vec::new());
                    }
                }
                Shape::Trees(_) | Shape::Butterfly(_) => {
                    for j in 0..n {
                        let tj = (cx.input.topology)(Root::At(Rank(j as u32)));
                        let g = &pairs_of(&tj)[0].broadcast;
                        for (c, r) in cs.iter().enumerate() {
                            cx.tree_bcast(g, tag(j, c), 0, &block(j, r), &[], &[]);
                        }
                    }
                }
            }
        }
        OpKind::ReduceScatter(_) => {
            let topo = (cx.input.topology)(Root::Any);
            match topo.shape() {
                Shape::Ring(order) => {
                    for (c, r) in cs.iter().enumerate() {
                        let seg = |k: usize| block(order[k].idx(), r);
                        cx.ring_rs(order, tag(0, c), &seg);
                    }
                }
                Shape::Trees(_) | Shape::Butterfly(_) => {
                    for j in 0..n {
                        let tj = (cx.input.topology)(Root::At(Rank(j as u32)));
                        let g = &pairs_of(&tj)[0].reduce;
                        for (c, r) in cs.iter().enumerate() {
                            cx.tree_reduce(g, tag(j, c), 0, &block(j, r));
                        }
                    }
                }
            }
        }
        OpKind::Gather { root } => {
            // Tree gather: each rank forwards to its parent its own blocks
            // and every block of its subtree, as they arrive.
            let topo = (cx.input.topology)(Root::At(root));
            let g = &pairs_of(&topo)[0].reduce;
            let parent = g.nexts(cx.me).first().copied();
            let children: Vec<Rank> = g.prevs(cx.me).to_vec();
            for (c, r) in cs.iter().enumerate() {
                if let Some(p) = parent {
                    let br = cx.bytes(&block(cx.me.idx(), r));
                    cx.b.send(p, tag(cx.me.idx(), c), 0, br, &[]);
                }
                for &ch in &children {
                    for j in g.subtree_of(ch) {
                        let br = cx.bytes(&block(j.idx(), r));
                        let got = cx.b.recv(ch, tag(j.idx(), c), 0, br.clone(), false, &[]);
                        if let Some(p) = parent {
                            cx.b.send(p, tag(j.idx(), c), 0, br, &[got]);
                        }
                    }
                }
            }
        }
        OpKind::Scatter { root } => {
            // Tree scatter, a gather reversed: each rank gets from its
            // parent its own block and every block of its subtree, and
            // forwards those of each child's subtree as they arrive.
            let topo = (cx.input.topology)(Root::At(root));
            let g = &pairs_of(&topo)[0].reduce;
            let parent = g.nexts(cx.me).first().copied();
            let children: Vec<Rank> = g.prevs(cx.me).to_vec();
            for (c, r) in cs.iter().enumerate() {
                if let Some(p) = parent {
                    let br = cx.bytes(&block(cx.me.idx(), r));
                    cx.b.recv(p, tag(cx.me.idx(), c), 0, br, false, &[]);
                }
                for &ch in &children {
                    for j in g.subtree_of(ch) {
                        let br = cx.bytes(&block(j.idx(), r));
                        let got: Vec<ActionId> = parent
                            .map(|p| cx.b.recv(p, tag(j.idx(), c), 0, br.clone(), false, &[]))
                            .into_iter()
                            .collect();
                        cx.b.send(ch, tag(j.idx(), c), 0, br, &got);
                    }
                }
            }
        }
        OpKind::Alltoall => {
            // Direct exchange; the output half starts at n * count.
            for (c, r) in cs.iter().enumerate() {
                for j in (0..n).filter(|&j| j != cx.me.idx()) {
                    let out = cx.bytes(&block(j, r));
                    cx.b.send(Rank(j as u32), tag(0, c), 0, out, &[]);
                    let inn = cx.bytes(&block(n + j, r));
                    cx.b.recv(Rank(j as u32), tag(0, c), 0, inn, false, &[]);
                }
            }
        }
    }
    if let OpKind::Broadcast { root }
    | OpKind::Reduce { root, .. }
    | OpKind::Gather { root }
    | OpKind::Scatter { root } = spec.kind
    {
        cx.confirm(root);
    }
    Ok(cx.b.finish(spec.dtype, op))
}
