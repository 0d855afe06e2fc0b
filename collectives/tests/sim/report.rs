//! What a run did: each op's record on each rank, and the trace.

use std::time::Duration;

use kungfu_collectives::{reference, CollectiveError, OpSpec};
use kungfu_topology::{Rank, Strategy};
use kungfu_transport::{Epoch, FrameKind, OpTag};

/// How one rank's op ended.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// The rank's output bytes (None where it has none).
    Done(Option<Vec<u8>>),
    Failed(CollectiveError),
    /// The rank died while the op ran.
    Killed,
}

impl Outcome {
    /// In a line: the error, or a digest of the output.
    pub fn describe(&self) -> String {
        match self {
            Outcome::Done(Some(b)) => {
                let digest = kungfu_topology::fnv1a64(0xcbf2_9ce4_8422_2325, b);
                format!("done: {} bytes, fnv {digest:016x}", b.len())
            }
            Outcome::Done(None) => "done".into(),
            Outcome::Failed(e) => e.to_string(),
            Outcome::Killed => "killed".into(),
        }
    }
}

/// What happened to one op on one rank.
#[derive(Clone, Debug, Default)]
pub struct Record {
    pub submitted: Option<Duration>,
    pub started: Option<Duration>,
    pub tag: Option<OpTag>,
    pub strategy: Option<Strategy>,
    /// The ranks its plan receives from (its `waiting_for` at the start).
    pub receives_from: Vec<Rank>,
    /// The last input that counts as progress (the start, a frame, a
    /// completed send): the op's deadline is this plus the timeout.
    pub last_progress: Duration,
    pub end: Option<(Duration, Outcome)>,
    /// It ended on an abort frame it received.
    pub by_abort: bool,
    /// The aborts the machine asked to send, by receiver.
    pub aborts_sent: Vec<Rank>,
    /// The lost peers the machine was told of (`handle_peer_lost`).
    pub told_lost: Vec<Rank>,
}

/// How a frame fared at its receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landed {
    /// Fed owned to the running op.
    Owned,
    /// Applied in place by the running op.
    InPlace,
    /// Queued for an op the receiver has not started yet.
    Early,
    /// The op had ended there (its header is a stray).
    Stray,
    /// Refused: an older epoch than the receiver's.
    Refused,
    /// The receiver is dead.
    Dead,
}

/// One step of a run, at a virtual time, on a rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    pub at: Duration,
    pub rank: Rank,
    pub what: What,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum What {
    Submit(String),
    /// Held by the swap gate.
    Held(String),
    Start(String, OpTag),
    /// The machine handed out a frame.
    Transmit {
        to: Rank,
        kind: FrameKind,
        tag: OpTag,
        chunk: u32,
        step: u16,
        len: usize,
    },
    /// A send completed (ok: the peer was not known lost).
    Sent {
        to: Rank,
        ok: bool,
    },
    /// A send of an op that had ended: it never leaves.
    Cancelled {
        to: Rank,
    },
    Dropped {
        to: Rank,
    },
    Deliver {
        from: Rank,
        kind: FrameKind,
        tag: OpTag,
        chunk: u32,
        step: u16,
        len: usize,
        landed: Landed,
    },
    Lost(Rank),
    Timeout(String),
    End(String, String),
    Kill,
    Advance(Epoch),
    SwapFailed(String),
    Replay {
        from: Rank,
        tag: OpTag,
    },
}

/// An op of the scenario: what each rank runs (None: never starts it).
#[derive(Clone, Debug)]
pub struct OpReport {
    pub name: String,
    pub specs: Vec<Option<OpSpec>>,
    pub inputs: Vec<Vec<u8>>,
    pub records: Vec<Record>,
    /// A swap's consensus (started by the sim, not the scenario).
    pub internal: bool,
}

impl OpReport {
    /// The reference output of `rank` for the ranks' inputs, if every rank
    /// runs the same spec.
    pub fn expected(&self, rank: usize) -> Option<Vec<u8>> {
        let spec = self.specs[0]?;
        if self.specs.iter().any(|s| *s != Some(spec)) {
            return None;
        }
        reference::expected(&spec, rank, &self.inputs)
    }
}

/// What a run did.
pub struct Report {
    pub seed: u64,
    pub trace: Vec<Trace>,
    pub ops: Vec<OpReport>,
    /// Per rank: how each of its swaps ended, and when.
    pub swaps: Vec<Vec<(Duration, Result<Epoch, String>)>>,
    /// Per rank: frames refused for an older epoch.
    pub refused: Vec<usize>,
}

impl Report {
    pub fn rec(&self, op: usize, rank: usize) -> &Record {
        &self.ops[op].records[rank]
    }

    /// Every output of an op all ranks agree on is the reference's.
    pub fn check_outputs(&self) {
        for op in &self.ops {
            for (r, rec) in op.records.iter().enumerate() {
                if let Some((_, Outcome::Done(out))) = &rec.end {
                    if op.specs.iter().all(|s| *s == op.specs[r]) {
                        assert!(
                            *out == op.expected(r),
                            "seed {}: op {:?} rank {r}: wrong output",
                            self.seed,
                            op.name
                        );
                    }
                }
            }
        }
    }

    /// The trace and every outcome, as text (to compare runs).
    pub fn fingerprint(&self) -> (Vec<Trace>, Vec<String>) {
        let ends = self
            .ops
            .iter()
            .flat_map(|o| o.records.iter())
            .map(|r| match &r.end {
                Some((t, o)) => format!("{t:?}: {}", o.describe()),
                None => "never ended".into(),
            })
            .collect();
        (self.trace.clone(), ends)
    }
}
