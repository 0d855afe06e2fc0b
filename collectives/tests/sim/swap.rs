//! Swaps in the simulation, as `Session::swap_strategy` runs them: the
//! rank's [`SwapGate`] holds the ops started meanwhile; once its ops in
//! flight have ended, a consensus (on the lengths, then on the digest, two
//! allreduce-max ops at the old epoch) agrees; then its endpoint advances
//! the epoch and the held ops start, in order.

use kungfu_collectives::{Agreement, CollectiveError, DType, OpKind, OpSpec, ReduceOp, SwapTo};
use kungfu_topology::{Rank, Strategy};
use kungfu_transport::Epoch;

use super::{Ev, Fault, OpReport, Outcome, Record, Sim, What};

/// Where a rank's swap is.
#[derive(Clone, Copy)]
pub(super) enum SwapPhase {
    Draining,
    /// The consensus on the lengths, then on the digest (op indices).
    Lengths(usize, Agreement),
    Digests(usize),
}

impl Sim {
    pub(super) fn begin_swap(&mut self, r: Rank, to: Strategy) {
        let node = &mut self.nodes[r.idx()];
        if !node.alive {
            return;
        }
        if let Err(e) = node.gate.begin(SwapTo::Strategy(to)) {
            self.swaps[r.idx()].push((self.now, Err(e.to_string())));
            return;
        }
        node.swap = Some(SwapPhase::Draining);
        self.advance_swap(r);
    }

    /// Moves `r`'s swap on, as `Session::swap_strategy` does: drain, agree
    /// (a consensus on the lengths, then on the digest), advance, release.
    pub(super) fn advance_swap(&mut self, r: Rank) {
        let node = &self.nodes[r.idx()];
        let (phase, drained) = (node.swap, node.running.is_empty());
        let end = |op: usize, sim: &Sim| sim.ops[op].records[r.idx()].end.clone();
        match phase {
            Some(SwapPhase::Draining) if drained => {
                let node = &mut self.nodes[r.idx()];
                match node.gate.agreement(node.epoch, &self.peers) {
                    Ok(a) => {
                        let lens = [8u64, !8u64];
                        let op = self.internal(r, "len", bytemuck::cast_slice(&lens), DType::U64);
                        // The phase first: the op may end as it starts.
                        self.nodes[r.idx()].swap = Some(SwapPhase::Lengths(op, a));
                        self.start(r, op);
                    }
                    Err(e) => self.finish_swap(r, Err(e)),
                }
            }
            Some(SwapPhase::Lengths(op, a)) => match end(op, self) {
                None => {}
                Some((_, Outcome::Done(Some(v)))) => {
                    let v: Vec<u64> = bytemuck::pod_collect_to_vec(&v);
                    if v[0] != !v[1] {
                        let e = self.nodes[r.idx()].gate.agreed(false).err();
                        return self.finish_swap(r, Err(e.expect("a disagreement")));
                    }
                    let mut both = a.digest.to_vec();
                    both.extend(a.digest.iter().map(|b| !b));
                    let op = self.internal(r, "data", &both, DType::U8);
                    self.nodes[r.idx()].swap = Some(SwapPhase::Digests(op));
                    self.start(r, op);
                }
                Some((_, Outcome::Failed(e))) => self.finish_swap(r, Err(e)),
                Some(o) => panic!("seed {}: a consensus ended {o:?}", self.seed),
            },
            Some(SwapPhase::Digests(op)) => match end(op, self) {
                None => {}
                Some((_, Outcome::Done(Some(b)))) => {
                    let (max, notmin) = b.split_at(b.len() / 2);
                    let same = max.iter().zip(notmin).all(|(a, b)| *a == !*b);
                    match self.nodes[r.idx()].gate.agreed(same) {
                        Ok((next, to)) => {
                            let SwapTo::Strategy(s) = to else {
                                unreachable!("the simulation swaps strategies")
                            };
                            let node = &mut self.nodes[r.idx()];
                            node.epoch = next;
                            node.strategy = s;
                            // As the matcher: queued frames of older epochs go.
                            node.early.retain(|k, _| k.0 >= next.0);
                            self.log(r, What::Advance(next));
                            self.replay(r);
                            self.finish_swap(r, Ok(next));
                        }
                        Err(e) => self.finish_swap(r, Err(e)),
                    }
                }
                Some((_, Outcome::Failed(e))) => self.finish_swap(r, Err(e)),
                Some(o) => panic!("seed {}: a consensus ended {o:?}", self.seed),
            },
            _ => {}
        }
    }

    /// A swap's consensus op (`{Agreement::NAME}\0{what}`), an
    /// allreduce-max of `input`, to start outside the gate.
    fn internal(&mut self, r: Rank, what: &str, input: &[u8], dtype: DType) -> usize {
        let name = format!("{}\0{what}", Agreement::NAME);
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Max),
            dtype,
            count: input.len() / dtype.size(),
            check: 0,
        };
        // One op per (name, seq): the k-th swap of every rank meets the
        // k-th of the others.
        let seq = self.nodes[r.idx()].names.get(&name).copied().unwrap_or(0);
        let nth = self
            .ops
            .iter()
            .enumerate()
            .filter(|(_, o)| o.internal && o.name == name)
            .nth(seq as usize)
            .map(|(i, _)| i);
        let op = nth.unwrap_or_else(|| {
            self.ops.push(OpReport {
                name: name.clone(),
                specs: vec![None; self.n],
                inputs: vec![Vec::new(); self.n],
                records: vec![Record::default(); self.n],
                internal: true,
            });
            self.ops.len() - 1
        });
        self.ops[op].specs[r.idx()] = Some(spec);
        self.ops[op].inputs[r.idx()] = input.to_vec();
        self.ops[op].records[r.idx()].submitted = Some(self.now);
        op
    }

    fn finish_swap(&mut self, r: Rank, result: Result<Epoch, CollectiveError>) {
        if let Err(e) = &result {
            self.log(r, What::SwapFailed(e.to_string()));
        }
        self.swaps[r.idx()].push((self.now, result.map_err(|e| e.to_string())));
        let node = &mut self.nodes[r.idx()];
        node.swap = None;
        for op in node.gate.end() {
            self.start(r, op);
        }
    }

    fn replay(&mut self, r: Rank) {
        let wanted = self
            .faults
            .iter()
            .any(|f| matches!(*f, Fault::ReplayAfterAdvance { to } if to == r));
        if let (true, Some(f)) = (wanted, self.nodes[r.idx()].last_data.clone()) {
            self.log(
                r,
                What::Replay {
                    from: f.from,
                    tag: f.header.tag,
                },
            );
            let at = self.now + self.draw(self.cfg.net);
            self.schedule(at, Ev::Deliver(r, f));
        }
    }
}
