//! A seeded network of op machines on a virtual clock, shared by the
//! simulation tests (`mod sim;`).
//!
//! Every rank runs its ops as [`OpMachine`]s, driven the way the session's
//! async driver drives them, over a modelled transport:
//!
//! - frames take a seeded time to arrive, so they are reordered freely
//!   (also between one pair of ranks); sends complete (`handle_sent`) a
//!   seeded time after the machine handed them out, so the window matters;
//!   a send either copies its bytes at once (`handle_copied`) or is read
//!   from the working buffer when it completes (sent in place), by a
//!   seeded coin; a data frame is offered in place (`try_apply`, in one or
//!   two pieces) or owned (`handle_frame`), by a seeded coin;
//! - each receiving endpoint works like the transport's matcher: it
//!   refuses frames whose epoch is older than its own, queues frames of an
//!   op it has not started (also of a newer epoch) until it does, and
//!   keeps the headers of frames for ops that ended as strays;
//! - faults: a dropped frame, a killed rank (its sends stop; every frame
//!   that left it still arrives, and the others are told it is lost a
//!   seeded time later, after its last frame to them, as a connection
//!   close would be), a silent rank (an op it never starts), a rank with
//!   another spec, swaps ([`SwapGate`] plus the consensus, as the session
//!   runs them) at per-rank virtual times, and an old frame replayed after
//!   a rank advanced its epoch.
//!
//! The clock jumps to the earliest of the next event and the earliest
//! deadline of a running machine (then `handle_timeout`). The drive is
//! bounded: it panics, naming the seed, on livelock (too many events or too
//! much virtual time), on deadlock (nothing left to happen while an op
//! runs) and when a machine hands out a frame beyond its window. Every
//! table is ordered (no hash maps), so the same seed gives the same trace.

// Each test file uses a part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_collectives::names::op_id;
use kungfu_collectives::op::{MachineConfig, OpEvent, OpInstance, OpMachine, Transmit};
use kungfu_collectives::plan::build::{build, PlanInput};
use kungfu_collectives::plan::ActionId;
use kungfu_collectives::{reference, OpSpec, SwapGate};
use kungfu_topology::{PeerList, Rank, Strategy};
use kungfu_transport::mem::SeededRng;
use kungfu_transport::{Epoch, FrameKind, Header, Instant, OpTag, PeerSet, TransportError};

mod config;
mod report;
mod swap;

pub use config::{Config, Fault};
pub use report::{Landed, OpReport, Outcome, Record, Report, Trace, What};
use swap::SwapPhase;

/// An op instance as a receiving endpoint keys it: (epoch, op id, seq).
type Key = (u32, u64, u32);

fn key(t: OpTag) -> Key {
    (t.epoch.0, t.op.0, t.seq)
}

#[derive(Clone)]
struct Frame {
    from: Rank,
    header: Header,
    payload: Bytes,
}

struct Slot {
    op: usize,
    m: OpMachine,
    work: Vec<u8>,
    /// Data sends handed out and not completed, and their bytes.
    outstanding: usize,
    inflight: usize,
}

/// One rank: its endpoint (epoch, lost peers, queued frames, retired
/// ops) and its session (names, strategy, swap gate, running ops).
struct Node {
    alive: bool,
    epoch: Epoch,
    strategy: Strategy,
    lost: PeerSet,
    names: BTreeMap<String, u32>,
    running: BTreeMap<Key, Slot>,
    early: BTreeMap<Key, Vec<Frame>>,
    retired: BTreeSet<Key>,
    gate: SwapGate<usize>,
    swap: Option<SwapPhase>,
    last_data: Option<Frame>,
}

enum Ev {
    Submit(Rank, usize),
    Swap(Rank, Strategy),
    SendDone {
        rank: Rank,
        key: Key,
        id: ActionId,
        to: Rank,
        header: Header,
        range: Range<usize>,
        copy: Option<Bytes>,
    },
    Deliver(Rank, Frame),
    Lost {
        at: Rank,
        peer: Rank,
    },
    Kill(Rank),
}

/// A scenario and its run. Build it with [`Sim::op`], [`Sim::swap`] and
/// [`Sim::fault`], then [`Sim::run`].
pub struct Sim {
    seed: u64,
    cfg: Config,
    peers: PeerList,
    n: usize,
    base: Instant,
    now: Duration,
    rng: SeededRng,
    seq: u64,
    queue: BTreeMap<(Duration, u64), Ev>,
    nodes: Vec<Node>,
    ops: Vec<OpReport>,
    faults: Vec<Fault>,
    trace: Vec<Trace>,
    swaps: Vec<Vec<(Duration, Result<Epoch, String>)>>,
    refused: Vec<usize>,
    /// Per (from, to): data frames sent, and when the last frame arrives.
    sent: Vec<Vec<usize>>,
    last_arrival: Vec<Vec<Duration>>,
}

fn lost_error(peer: Rank) -> TransportError {
    TransportError::PeerLost {
        peer,
        reason: "connection closed".into(),
    }
}

impl Sim {
    pub fn new(peers: PeerList, strategy: Strategy, cfg: Config, seed: u64) -> Sim {
        let n = peers.len();
        let node = || Node {
            alive: true,
            epoch: Epoch(0),
            strategy,
            lost: PeerSet::new(),
            names: BTreeMap::new(),
            running: BTreeMap::new(),
            early: BTreeMap::new(),
            retired: BTreeSet::new(),
            gate: SwapGate::default(),
            swap: None,
            last_data: None,
        };
        Sim {
            seed,
            cfg,
            peers,
            n,
            base: Instant::now(),
            now: Duration::ZERO,
            rng: SeededRng::new(seed),
            seq: 0,
            queue: BTreeMap::new(),
            nodes: (0..n).map(|_| node()).collect(),
            ops: Vec::new(),
            faults: Vec::new(),
            trace: Vec::new(),
            swaps: vec![Vec::new(); n],
            refused: vec![0; n],
            sent: vec![vec![0; n]; n],
            last_arrival: vec![vec![Duration::ZERO; n]; n],
        }
    }

    /// An op that rank `r` submits at `at[r]` with `specs[r]` (None: it
    /// never does), its input the reference's for its own spec. Returns
    /// the op's index.
    pub fn op(&mut self, name: &str, specs: Vec<Option<OpSpec>>, at: Vec<Duration>) -> usize {
        assert_eq!(specs.len(), self.n);
        assert!(self.ops.iter().all(|o| o.name != name), "one op per name");
        let i = self.ops.len();
        // Each rank's input is the reference's for its own spec.
        let mut of_spec: Vec<(OpSpec, Vec<Vec<u8>>)> = Vec::new();
        let mut inputs = Vec::new();
        for (r, s) in specs.iter().enumerate() {
            let Some(s) = *s else {
                inputs.push(Vec::new());
                continue;
            };
            let i = match of_spec.iter().position(|(t, _)| *t == s) {
                Some(i) => i,
                None => {
                    of_spec.push((s, reference::inputs(&s, self.n)));
                    of_spec.len() - 1
                }
            };
            inputs.push(of_spec[i].1[r].clone());
        }
        for (r, s) in specs.iter().enumerate() {
            if s.is_some() {
                self.schedule(at[r], Ev::Submit(Rank(r as u32), i));
            }
        }
        self.ops.push(OpReport {
            name: name.into(),
            specs,
            inputs,
            records: vec![Record::default(); self.n],
            internal: false,
        });
        i
    }

    /// An op every rank submits at `at` with `spec`.
    pub fn same_op(&mut self, name: &str, spec: OpSpec, at: Duration) -> usize {
        self.op(name, vec![Some(spec); self.n], vec![at; self.n])
    }

    /// Rank `rank` swaps to `to` at `at` (as `Session::swap_strategy`).
    pub fn swap(&mut self, rank: Rank, at: Duration, to: Strategy) {
        self.schedule(at, Ev::Swap(rank, to));
    }

    pub fn fault(&mut self, f: Fault) {
        if let Fault::KillAt { rank, at } = f {
            self.schedule(at, Ev::Kill(rank));
        }
        self.faults.push(f);
    }

    pub fn run(mut self) -> Report {
        let horizon = self.cfg.timeout * 1000;
        let mut events = 0usize;
        loop {
            events += 1;
            if events > self.cfg.max_events || self.now > horizon {
                panic!(
                    "seed {}: livelock: {events} events, {:?} of virtual time; running: {:?}",
                    self.seed,
                    self.now,
                    self.running_summary()
                );
            }
            let next_event = self.queue.first_key_value().map(|(k, _)| k.0);
            let next_deadline = self.next_deadline();
            match (next_event, next_deadline) {
                (None, None) => break,
                // A frame that arrives at the deadline still counts.
                (Some(e), Some(d)) if d < e => self.fire_timeouts(d),
                (None, Some(d)) => self.fire_timeouts(d),
                _ => {
                    let ((at, _), ev) = self.queue.pop_first().expect("an event");
                    self.now = at;
                    self.handle(ev);
                }
            }
        }
        // Nothing left to happen: whatever still waits would wait for ever.
        let stuck = self.running_summary();
        assert!(stuck.is_empty(), "seed {}: deadlock: {stuck:?}", self.seed);
        for (r, node) in self.nodes.iter().enumerate() {
            assert!(
                !node.alive || node.swap.is_none(),
                "seed {}: the swap of rank {r} never ended",
                self.seed
            );
        }
        Report {
            seed: self.seed,
            trace: self.trace,
            ops: self.ops,
            swaps: self.swaps,
            refused: self.refused,
        }
    }

    fn running_summary(&self) -> Vec<(usize, String, Vec<Rank>)> {
        let mut v = Vec::new();
        for (r, node) in self.nodes.iter().enumerate() {
            for s in node.running.values() {
                v.push((r, self.ops[s.op].name.clone(), s.m.waiting_for()));
            }
        }
        v
    }

    fn schedule(&mut self, at: Duration, ev: Ev) {
        self.seq += 1;
        self.queue.insert((at, self.seq), ev);
    }

    fn draw(&mut self, (lo, hi): (Duration, Duration)) -> Duration {
        let span = (hi - lo).as_nanos() as u64;
        lo + Duration::from_nanos(self.rng.below(span + 1))
    }

    fn t(&self) -> Instant {
        self.base + self.now
    }

    fn log(&mut self, rank: Rank, what: What) {
        self.trace.push(Trace {
            at: self.now,
            rank,
            what,
        });
    }

    fn next_deadline(&self) -> Option<Duration> {
        self.nodes
            .iter()
            .filter(|n| n.alive)
            .flat_map(|n| n.running.values())
            .filter_map(|s| s.m.poll_timeout())
            .min()
            .map(|d| d.duration_since(self.base))
    }

    fn fire_timeouts(&mut self, at: Duration) {
        self.now = at;
        let now = self.t();
        for r in 0..self.n {
            let due: Vec<Key> = self.nodes[r]
                .running
                .iter()
                .filter(|(_, s)| s.m.poll_timeout().is_some_and(|d| d <= now))
                .map(|(k, _)| *k)
                .collect();
            for k in due {
                let mut slot = self.nodes[r].running.remove(&k).expect("due");
                let rank = Rank(r as u32);
                self.log(rank, What::Timeout(self.ops[slot.op].name.clone()));
                slot.m.handle_timeout(now);
                self.settle(rank, k, slot);
            }
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Submit(r, op) => self.submit(r, op),
            Ev::Swap(r, to) => self.begin_swap(r, to),
            Ev::SendDone {
                rank,
                key,
                id,
                to,
                header,
                range,
                copy,
            } => self.send_done(rank, key, id, to, header, range, copy),
            Ev::Deliver(to, f) => self.land(to, f),
            Ev::Lost { at, peer } => self.peer_lost(at, peer),
            Ev::Kill(r) => self.kill(r),
        }
    }

    fn submit(&mut self, r: Rank, op: usize) {
        if !self.nodes[r.idx()].alive {
            return;
        }
        self.ops[op].records[r.idx()].submitted = Some(self.now);
        let name = self.ops[op].name.clone();
        self.log(r, What::Submit(name.clone()));
        match self.nodes[r.idx()].gate.admit(op, |op| op) {
            Some(op) => self.start(r, op),
            None => self.log(r, What::Held(name)),
        }
    }

    /// Starts `op` on `r` now, as the session's `prepare` and the first
    /// steps of its driver do.
    fn start(&mut self, r: Rank, op: usize) {
        let (n, me) = (self.n, r);
        let spec = self.ops[op].specs[r.idx()].expect("a rank starts only its ops");
        let name = self.ops[op].name.clone();
        let node = &mut self.nodes[r.idx()];
        let seq = node.names.entry(name.clone()).or_insert(0);
        let tag = OpTag {
            epoch: node.epoch,
            op: op_id(&name),
            seq: *seq,
        };
        *seq += 1;
        let bytes = spec.block_bytes().expect("a valid spec");
        let (strategy, peers) = (node.strategy, &self.peers);
        let topology = |root| Arc::new(strategy.resolve(peers, root, bytes));
        let topo = topology(spec.kind.root());
        let plan = build(&PlanInput {
            spec: &spec,
            me,
            size: n,
            chunk_bytes: self.cfg.chunk_bytes,
            topology: &topology,
        })
        .expect("a valid spec");
        let instance = OpInstance {
            name: name.as_str().into(),
            spec,
            tag,
            digest: spec.digest(&topo).short(),
            strategy: topo.strategy(),
        };
        let cfg = MachineConfig {
            timeout: self.cfg.timeout,
            max_inflight_bytes: self.cfg.window,
        };
        let mut m = OpMachine::new(instance, plan, me, n, cfg, self.t());
        let work = spec.init_work(&self.ops[op].inputs[r.idx()], me, n);
        let rec = &mut self.ops[op].records[r.idx()];
        rec.started = Some(self.now);
        rec.tag = Some(tag);
        rec.strategy = Some(topo.strategy());
        rec.receives_from = m.waiting_for();
        rec.last_progress = self.now;
        self.log(r, What::Start(name, tag));
        // The driver's first check: a lost target fails the op now, and so
        // does a lost peer it needs none of whose frames for it are here.
        let k = key(tag);
        let node = &mut self.nodes[r.idx()];
        let early = node.early.remove(&k).unwrap_or_default();
        let lost = m
            .targets()
            .iter()
            .find(|&p| node.lost.contains(p))
            .or_else(|| {
                m.needed()
                    .iter()
                    .find(|&p| node.lost.contains(p) && !early.iter().any(|f| f.from == p))
            });
        if let Some(p) = lost {
            m.handle_error(lost_error(p));
        }
        let slot = Slot {
            op,
            m,
            work,
            outstanding: 0,
            inflight: 0,
        };
        self.settle(r, k, slot);
        // Frames that came first, in the order they came; then the lost
        // peers it listens to (the matcher reports those only when none of
        // their frames is queued).
        for f in early {
            self.land(r, f);
        }
        for p in self.nodes[r.idx()].lost.clone().iter() {
            self.tell_lost(r, k, p);
        }
    }

    /// Sends what the machine asks, then records its end, if it ended.
    fn settle(&mut self, r: Rank, k: Key, mut slot: Slot) {
        self.transmit(r, &mut slot);
        let Some(ev) = slot.m.poll_event(&mut slot.work) else {
            self.nodes[r.idx()].running.insert(k, slot);
            return;
        };
        self.transmit(r, &mut slot);
        let outcome = match ev {
            OpEvent::Done => Outcome::Done(slot.m.output_range().map(|o| slot.work[o].to_vec())),
            OpEvent::Failed(e) => Outcome::Failed(e),
        };
        self.log(
            r,
            What::End(self.ops[slot.op].name.clone(), outcome.describe()),
        );
        self.ops[slot.op].records[r.idx()].end = Some((self.now, outcome));
        self.nodes[r.idx()].retired.insert(k);
        self.ended(r, slot.op);
    }

    fn transmit(&mut self, r: Rank, slot: &mut Slot) {
        while let Some(tx) = slot.m.poll_transmit() {
            match tx {
                Transmit::Data {
                    id,
                    to,
                    header,
                    range,
                } => {
                    assert!(
                        slot.outstanding == 0 || slot.inflight < self.cfg.window,
                        "seed {}: {r} handed out a frame with {} bytes in flight (window {})",
                        self.seed,
                        slot.inflight,
                        self.cfg.window
                    );
                    slot.outstanding += 1;
                    slot.inflight += range.len();
                    self.log(
                        r,
                        What::Transmit {
                            to,
                            kind: header.kind,
                            tag: header.tag,
                            chunk: header.chunk,
                            step: header.step,
                            len: range.len(),
                        },
                    );
                    // A backend copies the bytes now, or sends them from
                    // the buffer later: the plan must not touch the range
                    // until the send completes.
                    let copy = (self.rng.below(2) == 0).then(|| {
                        let b = Bytes::copy_from_slice(&slot.work[range.clone()]);
                        slot.m.handle_copied(id, &mut slot.work);
                        b
                    });
                    let at = self.now + self.draw(self.cfg.send);
                    let ev = Ev::SendDone {
                        rank: r,
                        key: key(header.tag),
                        id,
                        to,
                        header,
                        range,
                        copy,
                    };
                    self.schedule(at, ev);
                }
                Transmit::Abort {
                    to,
                    header,
                    payload,
                } => {
                    self.ops[slot.op].records[r.idx()].aborts_sent.push(to);
                    self.log(
                        r,
                        What::Transmit {
                            to,
                            kind: header.kind,
                            tag: header.tag,
                            chunk: header.chunk,
                            step: header.step,
                            len: payload.len(),
                        },
                    );
                    // As the session's send_abort: not to a rank known lost.
                    if !self.nodes[r.idx()].lost.contains(to) {
                        self.depart(r, to, header, payload);
                    }
                }
            }
        }
    }

    /// A frame leaves `from` for `to`.
    fn depart(&mut self, from: Rank, to: Rank, mut header: Header, payload: Bytes) {
        header.len = payload.len() as u64;
        if header.kind == FrameKind::Data {
            let nth = self.sent[from.idx()][to.idx()];
            self.sent[from.idx()][to.idx()] += 1;
            let dropped = self.faults.iter().any(
                |f| matches!(*f, Fault::Drop { from: a, to: b, nth: k } if (a, b, k) == (from, to, nth)),
            );
            if dropped {
                self.log(from, What::Dropped { to });
                return;
            }
        }
        if header.kind == FrameKind::Abort
            && self
                .faults
                .iter()
                .any(|f| matches!(*f, Fault::DropAborts { from: a, to: b } if (a, b) == (from, to)))
        {
            self.log(from, What::Dropped { to });
            return;
        }
        let at = self.now + self.draw(self.cfg.net);
        let last = &mut self.last_arrival[from.idx()][to.idx()];
        *last = (*last).max(at);
        self.schedule(
            at,
            Ev::Deliver(
                to,
                Frame {
                    from,
                    header,
                    payload,
                },
            ),
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn send_done(
        &mut self,
        r: Rank,
        k: Key,
        id: ActionId,
        to: Rank,
        header: Header,
        range: Range<usize>,
        copy: Option<Bytes>,
    ) {
        if !self.nodes[r.idx()].alive {
            return;
        }
        let Some(mut slot) = self.nodes[r.idx()].running.remove(&k) else {
            // The op ended (failed): its driver dropped the send.
            self.log(r, What::Cancelled { to });
            return;
        };
        let payload = copy.unwrap_or_else(|| Bytes::copy_from_slice(&slot.work[range.clone()]));
        let ok = !self.nodes[r.idx()].lost.contains(to);
        self.log(r, What::Sent { to, ok });
        slot.outstanding -= 1;
        slot.inflight -= range.len();
        let result = if ok {
            self.depart(r, to, header, payload);
            self.ops[slot.op].records[r.idx()].last_progress = self.now;
            Ok(())
        } else {
            Err(lost_error(to))
        };
        slot.m.handle_sent(self.t(), id, result, &mut slot.work);
        self.settle(r, k, slot);
    }

    /// A frame arrives at `to`, whose endpoint matches it as the
    /// transport's does.
    fn land(&mut self, to: Rank, f: Frame) {
        let h = f.header;
        let landed = |sim: &mut Sim, how: Landed| {
            sim.log(
                to,
                What::Deliver {
                    from: f.from,
                    kind: h.kind,
                    tag: h.tag,
                    chunk: h.chunk,
                    step: h.step,
                    len: f.payload.len(),
                    landed: how,
                },
            )
        };
        let node = &mut self.nodes[to.idx()];
        if !node.alive {
            return landed(self, Landed::Dead);
        }
        if h.tag.epoch < node.epoch {
            self.refused[to.idx()] += 1;
            return landed(self, Landed::Refused);
        }
        let k = key(h.tag);
        let Some(mut slot) = node.running.remove(&k) else {
            if node.retired.contains(&k) {
                return landed(self, Landed::Stray);
            }
            node.early.entry(k).or_default().push(f.clone());
            return landed(self, Landed::Early);
        };
        if h.kind == FrameKind::Data {
            node.last_data = Some(f.clone());
        }
        self.ops[slot.op].records[to.idx()].last_progress = self.now;
        let now = self.t();
        if h.kind == FrameKind::Data && self.rng.below(2) == 0 {
            let at = self.rng.below(f.payload.len() as u64 + 1) as usize;
            let (a, b) = f.payload.split_at(at);
            if slot.m.try_apply(now, f.from, &h, &[a, b], &mut slot.work) {
                landed(self, Landed::InPlace);
                return self.settle(to, k, slot);
            }
        }
        slot.m
            .handle_frame(now, f.from, &h, f.payload.clone(), &mut slot.work);
        if h.kind == FrameKind::Abort && !slot.m.is_running() {
            self.ops[slot.op].records[to.idx()].by_abort = true;
        }
        landed(self, Landed::Owned);
        self.settle(to, k, slot);
    }

    fn tell_lost(&mut self, r: Rank, k: Key, peer: Rank) {
        let node = &mut self.nodes[r.idx()];
        let Some(slot) = node.running.get(&k) else {
            return;
        };
        if !slot.m.listening().contains(peer) {
            return;
        }
        let mut slot = node.running.remove(&k).expect("just seen");
        self.ops[slot.op].records[r.idx()].told_lost.push(peer);
        slot.m.handle_peer_lost(self.t(), peer, lost_error(peer));
        self.settle(r, k, slot);
    }

    fn peer_lost(&mut self, at: Rank, peer: Rank) {
        let node = &mut self.nodes[at.idx()];
        if !node.alive || node.lost.contains(peer) {
            return;
        }
        node.lost.insert(peer);
        self.log(at, What::Lost(peer));
        let keys: Vec<Key> = self.nodes[at.idx()].running.keys().copied().collect();
        for k in keys {
            self.tell_lost(at, k, peer);
        }
    }

    fn kill(&mut self, r: Rank) {
        let node = &mut self.nodes[r.idx()];
        if !node.alive {
            return;
        }
        node.alive = false;
        let running = std::mem::take(&mut node.running);
        self.log(r, What::Kill);
        for slot in running.into_values() {
            self.ops[slot.op].records[r.idx()].end = Some((self.now, Outcome::Killed));
        }
        for q in 0..self.n {
            if q != r.idx() && self.nodes[q].alive {
                let at = (self.now + self.draw(self.cfg.detect)).max(self.last_arrival[r.idx()][q]);
                self.schedule(
                    at,
                    Ev::Lost {
                        at: Rank(q as u32),
                        peer: r,
                    },
                );
            }
        }
    }

    /// An op of `r` ended: the faults and the swap that wait for it.
    fn ended(&mut self, r: Rank, op: usize) {
        let done = matches!(
            self.ops[op].records[r.idx()].end,
            Some((_, Outcome::Done(_)))
        );
        let kill = self
            .faults
            .iter()
            .any(|f| matches!(*f, Fault::KillWhenDone { rank, op: o } if rank == r && o == op));
        if done && kill {
            self.kill(r);
            return;
        }
        self.advance_swap(r);
    }
}

/// `n` ranks on one host, or on hosts of three (for host-aware strategies).
pub fn layout(n: usize, hosts: bool) -> PeerList {
    if !hosts || n < 3 {
        return PeerList::local(n);
    }
    let mut per = vec![3; n / 3];
    if !n.is_multiple_of(3) {
        per.push(n % 3);
    }
    PeerList::with_hosts(&per)
}
