//! The stall report: which ranks have not posted which ops.
//!
//! A collective waits until every rank posted it; a rank that never does
//! (a bug that skips a layer, a diverging branch, a dead or slow worker)
//! leaves the others waiting until the op timeout, with no word of who is
//! missing. Horovod's stall inspector names them; so does this.
//!
//! Every worker that watches ([`Session::watch_stalls`]) puts the ops it
//! has been waiting on for half the stall time into its transport's
//! heartbeats ([`Matcher::set_beacon`]: tag, name, how long). From its own
//! pending ops and its peers' beacons, each worker knows, for every op that
//! some rank has waited on for the stall time, which ranks posted it; the
//! others are missing. Every worker logs that (once per op and set of
//! missing ranks), and [`Session::stall_report`] returns it.
//!
//! A rank whose heartbeats carry nothing (over libfabric, which sends
//! none, or with liveness off) is listed as unknown, not missing. A lost
//! rank is missing.
//!
//! The beacon (all integers little-endian), from any peer, is untrusted:
//! one that does not parse is ignored.
//!
//! ```text
//! "KS" | u8 version (1) | u16 n | n x (u32 epoch | u64 op | u32 seq
//!      | u32 waited ms | u16 name length | name, UTF-8)
//! ```
//!
//! [`Matcher::set_beacon`]: kungfu_transport::endpoint::Matcher::set_beacon

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use kungfu_topology::Rank;
use kungfu_transport::endpoint::MAX_BEACON;
use kungfu_transport::{Epoch, OpId, OpTag, Transport};

use super::{lock, Inner, Session};

/// The stall time when [`Session::watch_stalls`] was not called.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Ops in one beacon at most (the longest waiting first).
const MAX_ENTRIES: usize = 32;
/// Bytes of a name in a beacon at most (cut at a character boundary).
const MAX_NAME: usize = 256;
const MAGIC: &[u8; 2] = b"KS";
const VERSION: u8 = 1;
const ENTRY: usize = 4 + 8 + 4 + 4 + 2;

/// An op that some rank has waited on for the stall time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stall {
    /// The op's name (internal names end in a NUL and a suffix).
    pub name: Arc<str>,
    pub tag: OpTag,
    /// The longest any rank that posted it has waited.
    pub waited: Duration,
    /// The ranks that posted it, in order.
    pub posted: Vec<Rank>,
    /// The ranks that have not (or were lost), in order.
    pub missing: Vec<Rank>,
    /// The ranks this worker has no report from (their heartbeats carry
    /// none: libfabric, or liveness off).
    pub unknown: Vec<Rank>,
}

fn ranks(rs: &[Rank]) -> String {
    let v: Vec<String> = rs.iter().map(|r| r.0.to_string()).collect();
    v.join(", ")
}

impl fmt::Display for Stall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "op \"{}\" (#{}) waited {:.1} s: ",
            self.name.escape_debug(),
            self.tag.seq,
            self.waited.as_secs_f64()
        )?;
        match self.missing.len() {
            0 => write!(f, "no rank is missing it")?,
            1 => write!(f, "rank {} has not posted it", ranks(&self.missing))?,
            _ => write!(f, "ranks {} have not posted it", ranks(&self.missing))?,
        }
        write!(f, " (posted by {})", ranks(&self.posted))?;
        if !self.unknown.is_empty() {
            write!(f, "; no report from {}", ranks(&self.unknown))?;
        }
        Ok(())
    }
}

/// One op in a beacon.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    tag: OpTag,
    waited: Duration,
    name: Arc<str>,
}

fn encode(entries: &[Entry]) -> Bytes {
    if entries.is_empty() {
        return Bytes::new();
    }
    let mut b = BytesMut::with_capacity(5 + entries.len() * (ENTRY + 32));
    b.put_slice(MAGIC);
    b.put_u8(VERSION);
    b.put_u16_le(entries.len() as u16);
    for e in entries {
        let mut cut = e.name.len().min(MAX_NAME);
        while !e.name.is_char_boundary(cut) {
            cut -= 1;
        }
        b.put_u32_le(e.tag.epoch.0);
        b.put_u64_le(e.tag.op.0);
        b.put_u32_le(e.tag.seq);
        b.put_u32_le(e.waited.as_millis().min(u32::MAX as u128) as u32);
        b.put_u16_le(cut as u16);
        b.put_slice(&e.name.as_bytes()[..cut]);
    }
    b.freeze()
}

/// The entries of a beacon, or `None` if it does not parse.
fn decode(b: &[u8]) -> Option<Vec<Entry>> {
    if b.is_empty() {
        return Some(Vec::new());
    }
    /// The next `n` bytes of `r`, borrowed.
    fn take<'a>(r: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = r.split_at_checked(n)?;
        *r = rest;
        Some(head)
    }
    let mut r = b.strip_prefix(MAGIC)?;
    let u = |v: &[u8]| v.iter().rev().fold(0u64, |a, &x| (a << 8) | u64::from(x));
    if take(&mut r, 1)?[0] != VERSION {
        return None;
    }
    let n = u(take(&mut r, 2)?) as usize;
    if n > MAX_ENTRIES {
        return None;
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let epoch = Epoch(u(take(&mut r, 4)?) as u32);
        let op = OpId(u(take(&mut r, 8)?));
        let seq = u(take(&mut r, 4)?) as u32;
        let waited = Duration::from_millis(u(take(&mut r, 4)?));
        let len = u(take(&mut r, 2)?) as usize;
        if len > MAX_NAME {
            return None;
        }
        let name = std::str::from_utf8(take(&mut r, len)?).ok()?;
        v.push(Entry {
            tag: OpTag { epoch, op, seq },
            waited,
            name: name.into(),
        });
    }
    r.is_empty().then_some(v)
}

/// This worker's pending ops that have waited at least `after`, the
/// longest first, at most [`MAX_ENTRIES`].
fn waiting<T>(inner: &Inner<T>, after: Duration) -> Vec<Entry> {
    let now = Instant::now();
    let mut v: Vec<Entry> = lock(&inner.pending)
        .iter()
        .map(|(tag, (name, since))| Entry {
            tag: *tag,
            waited: now.saturating_duration_since(*since),
            name: name.clone(),
        })
        .filter(|e| e.waited >= after)
        .collect();
    v.sort_by(|a, b| b.waited.cmp(&a.waited).then(a.tag.seq.cmp(&b.tag.seq)));
    v.truncate(MAX_ENTRIES);
    v
}

/// One op as the report gathers it: its name, the longest wait, who
/// posted it.
struct Seen {
    name: Arc<str>,
    waited: Duration,
    posted: BTreeSet<Rank>,
}

/// The stall report of `inner`'s session (see the module docs), with
/// `mine`, this worker's ops waited on for half the stall time
/// ([`waiting`]).
fn report<T: Transport>(inner: &Inner<T>, mine: Vec<Entry>) -> Vec<Stall> {
    let after = *lock(&inner.stall_after);
    let t = inner.transport();
    let (me, n) = (t.rank(), t.size());
    // What each rank posted: this one's pending ops, its peers' beacons.
    let mut heard: Vec<(Rank, Vec<Entry>)> = vec![(me, mine)];
    let beacons = t.matcher().beacons();
    let reporting: BTreeSet<Rank> = beacons.iter().map(|(r, _)| *r).collect();
    for (r, b) in beacons {
        if let Some(v) = decode(&b) {
            heard.push((r, v));
        }
    }
    let lost: BTreeSet<Rank> = t.matcher().lost_in_order().into_iter().collect();
    // by (epoch, op, seq): the order of the report
    let mut ops: BTreeMap<(u32, u64, u32), Seen> = BTreeMap::new();
    for (r, entries) in heard {
        for e in entries {
            let key = (e.tag.epoch.0, e.tag.op.0, e.tag.seq);
            let o = ops.entry(key).or_insert_with(|| Seen {
                name: e.name.clone(),
                waited: Duration::ZERO,
                posted: BTreeSet::new(),
            });
            o.waited = o.waited.max(e.waited);
            o.posted.insert(r);
        }
    }
    ops.into_iter()
        .filter(|(_, o)| o.waited >= after)
        .map(
            |(
                (epoch, op, seq),
                Seen {
                    name,
                    waited,
                    posted,
                },
            )| {
                let all = (0..n as u32).map(Rank);
                let unknown = all
                    .clone()
                    .filter(|r| *r != me && !reporting.contains(r) && !lost.contains(r))
                    .collect();
                let missing = all
                    .filter(|r| !posted.contains(r))
                    .filter(|r| *r == me || reporting.contains(r) || lost.contains(r))
                    .collect();
                Stall {
                    name,
                    tag: OpTag {
                        epoch: Epoch(epoch),
                        op: OpId(op),
                        seq,
                    },
                    waited,
                    posted: posted.into_iter().collect(),
                    missing,
                    unknown,
                }
            },
        )
        .collect()
}

impl<T: Transport> Session<T> {
    /// The ops that some rank has waited on for the stall time
    /// ([`Session::watch_stalls`]; [`DEFAULT_STALL_TIMEOUT`] otherwise),
    /// with the ranks that have not posted them: see the module docs.
    /// Without a watch, peers publish nothing, so only this worker's own
    /// ops are listed, with the others unknown.
    pub fn stall_report(&self) -> Vec<Stall> {
        let after = *lock(&self.inner.stall_after);
        report(&self.inner, waiting(&self.inner, after / 2))
    }

    /// From now on, publishes the ops this worker has waited on for half
    /// of `after` to its peers (on the heartbeats of
    /// [`Endpoint::watch_peers`](kungfu_transport::endpoint::Endpoint::watch_peers)),
    /// and logs to stderr, once per op and set of missing ranks, every op
    /// some rank has waited on for `after`, naming the missing ranks
    /// ([`Session::stall_report`]). Ends with the session or its
    /// transport. A zero `after` is refused (nothing is watched).
    pub fn watch_stalls(&self, after: Duration) {
        if after.is_zero() {
            return;
        }
        *lock(&self.inner.stall_after) = after;
        let weak = Arc::downgrade(&self.inner);
        let tick = (after / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        self.inner.runtime.spawn(async move {
            let mut logged: HashMap<OpTag, Vec<Rank>> = HashMap::new();
            let mut every = tokio::time::interval(tick);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                let t = inner.transport();
                if t.matcher().is_closed() {
                    return;
                }
                let mine = waiting(&inner, after / 2);
                let beacon = encode(&mine);
                // at most 32 entries of 278 bytes: always within the limit
                debug_assert!(beacon.len() <= MAX_BEACON);
                t.matcher().set_beacon(beacon);
                let stalls = report(&inner, mine);
                logged.retain(|tag, _| stalls.iter().any(|s| s.tag == *tag));
                for s in stalls {
                    if logged.get(&s.tag) != Some(&s.missing) {
                        let me = t.rank();
                        let this = if s.missing.contains(&me) {
                            " (this worker is one of them)"
                        } else {
                            ""
                        };
                        eprintln!("kungfu: rank {}: stall: {s}{this}", me.0);
                        logged.insert(s.tag, s.missing);
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u32, name: &str, ms: u64) -> Entry {
        Entry {
            tag: OpTag {
                epoch: Epoch(2),
                op: OpId(0xfeed),
                seq,
            },
            waited: Duration::from_millis(ms),
            name: name.into(),
        }
    }

    #[test]
    fn beacons_round_trip_and_bad_ones_are_refused() {
        let v = vec![entry(1, "grad/fc1", 7000), entry(9, "é\0len", 1)];
        let b = encode(&v);
        assert_eq!(decode(&b), Some(v.clone()));
        assert_eq!(decode(&[]), Some(vec![]));
        for cut in 1..b.len() {
            assert_eq!(decode(&b[..cut]), None, "truncated at {cut}");
        }
        let mut extra = b.to_vec();
        extra.push(0);
        assert_eq!(decode(&extra), None, "trailing bytes");
        let mut many = b.to_vec();
        many[3..5].copy_from_slice(&(MAX_ENTRIES as u16 + 1).to_le_bytes());
        assert_eq!(decode(&many), None, "too many entries");
        // a long name is cut at a character boundary
        let long = "é".repeat(200);
        let d = decode(&encode(&[entry(0, &long, 0)])).unwrap();
        assert!(d[0].name.len() <= MAX_NAME && long.starts_with(&*d[0].name));
    }

    #[test]
    fn a_stall_names_the_missing() {
        let s = Stall {
            name: "grad".into(),
            tag: OpTag {
                epoch: Epoch(0),
                op: OpId(1),
                seq: 3,
            },
            waited: Duration::from_millis(10_260),
            posted: vec![Rank(0), Rank(1), Rank(3)],
            missing: vec![Rank(2)],
            unknown: vec![],
        };
        assert_eq!(
            s.to_string(),
            "op \"grad\" (#3) waited 10.3 s: rank 2 has not posted it (posted by 0, 1, 3)"
        );
    }
}
