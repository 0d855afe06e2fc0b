//! Connecting the ranks of a job, whatever the wire (TCP, QUIC): rank `i`
//! dials every rank below it, retrying until the deadline, and accepts
//! every rank above it. A refused handshake is final for the dialer,
//! unless the peer is at an older cluster version (it may yet move to
//! ours); it never stops the acceptor from waiting for the right peer until the
//! deadline, so a stray process (or one without the job's certificate or
//! secret) cannot break a job; every refusal is logged on standard error.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use kungfu_topology::Rank;

use crate::{Instant, TransportError};

/// Runs `attempt` until it succeeds, until it fails with a refusal
/// (`Err((false, why))`: final), or until the deadline; a failed link
/// (`Err((true, why))`) is tried again after a growing pause.
pub(crate) async fn dial<T, F, Fut>(
    peer: Rank,
    addr: String,
    deadline: Instant,
    mut attempt: F,
) -> Result<T, TransportError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, (bool, String)>>,
{
    let fail = |reason: String| TransportError::Handshake {
        peer: Some(peer),
        addr: addr.clone(),
        reason,
    };
    let mut backoff = Duration::from_millis(5);
    let mut last_err = String::from("no attempt");
    loop {
        if Instant::now() >= deadline {
            return Err(fail(format!(
                "could not connect before the deadline: {last_err}"
            )));
        }
        match tokio::time::timeout_at(deadline, attempt()).await {
            Ok(Ok(c)) => return Ok(c),
            // A refusal is final: retrying will not change the peer's mind
            // (the handshake says which are not: `retry`).
            Ok(Err((false, reason))) => return Err(fail(reason)),
            Ok(Err((true, e))) => last_err = e,
            Err(_) => last_err = "timed out".into(),
        }
        tokio::time::sleep(backoff.min(deadline.saturating_duration_since(Instant::now()))).await;
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
}

/// Dials each of `ranks` at once (`dial` gives the future that connects
/// one) and gathers their connections; the first failure fails all.
pub(crate) async fn dial_all<T, D, Fut>(
    ranks: impl Iterator<Item = Rank>,
    dial: D,
) -> Result<HashMap<Rank, T>, TransportError>
where
    D: Fn(Rank) -> Fut,
    Fut: Future<Output = Result<T, TransportError>> + Send + 'static,
    T: Send + 'static,
{
    let mut set = tokio::task::JoinSet::new();
    for peer in ranks {
        let connecting = dial(peer);
        set.spawn(async move { connecting.await.map(|c| (peer, c)) });
    }
    let mut out = HashMap::new();
    while let Some(res) = set.join_next().await {
        let (peer, c) = res.map_err(|e| TransportError::Handshake {
            peer: None,
            addr: String::new(),
            reason: format!("dial task failed: {e}"),
        })??;
        out.insert(peer, c);
    }
    Ok(out)
}

/// A TCP connection to `p`, rank `peer`, with the shared handshake said
/// (`Err((retry, why))` as [`dial`] takes it).
pub(crate) async fn tcp_hello(
    p: &kungfu_topology::Peer,
    me: &crate::handshake::Identity,
    peer: Rank,
) -> Result<tokio::net::TcpStream, (bool, String)> {
    let mut s = tokio::net::TcpStream::connect((p.host.as_str(), p.port))
        .await
        .map_err(|e| (true, format!("connect: {e}")))?;
    s.set_nodelay(true)
        .map_err(|e| (true, format!("nodelay: {e}")))?;
    crate::handshake::dial(&mut s, me, peer)
        .await
        .map_err(|e| (e.retry, e.reason))?;
    Ok(s)
}

/// Answers a TCP dialer's hello on `s`: its rank, if accepted.
pub(crate) async fn tcp_answer(
    s: &mut tokio::net::TcpStream,
    me: &crate::handshake::Identity,
    may_dial: impl Fn(Rank) -> bool,
) -> Result<Rank, String> {
    s.set_nodelay(true).map_err(|e| format!("nodelay: {e}"))?;
    crate::handshake::answer(s, me, may_dial).await
}

/// What the acceptor's `accept` found.
pub(crate) enum Incoming<S> {
    /// A connection from this address, to answer.
    Conn(S, String),
    /// A failed accept, noted among the refusals.
    Failed(String),
    /// The listening end is gone.
    Closed,
}

/// Accepts until every rank of `wanted` connected: each incoming
/// connection is answered on its own task by `answer` (which gives the
/// dialer's rank, or why it was refused), so a silent client cannot hold
/// up the others. Refusals are kept for the error at the deadline, and
/// logged on standard error as rank `log` if given.
pub(crate) async fn accept<S, T, A, AF, H, HF>(
    wanted: &[Rank],
    local: &str,
    deadline: Instant,
    log: Option<Rank>,
    mut incoming: A,
    answer: H,
) -> Result<HashMap<Rank, T>, TransportError>
where
    A: FnMut() -> AF,
    AF: Future<Output = Incoming<S>>,
    H: Fn(S) -> HF,
    HF: Future<Output = Result<(Rank, T), String>> + Send + 'static,
    T: Send + 'static,
{
    let mut out: HashMap<Rank, T> = HashMap::new();
    let mut refusals: Vec<String> = Vec::new();
    let mut pending = tokio::task::JoinSet::new();
    // the address of each handshake still in flight, by its task
    let mut in_flight: HashMap<tokio::task::Id, String> = HashMap::new();
    let refused = |refusals: &mut Vec<String>, why: String| {
        if let Some(me) = log {
            eprintln!("kungfu: {me}: refused a connection from {why}");
        }
        refusals.push(why);
    };
    while out.len() < wanted.len() {
        tokio::select! {
            inc = incoming() => match inc {
                Incoming::Conn(s, addr) => {
                    let handshake = answer(s);
                    let at = addr.clone();
                    let task = pending.spawn(async move {
                        let r = tokio::time::timeout_at(deadline, handshake).await;
                        (addr, r.unwrap_or_else(|_| Err("no hello before the deadline".into())))
                    });
                    in_flight.insert(task.id(), at);
                }
                Incoming::Failed(why) => refused(&mut refusals, why),
                Incoming::Closed => return Err(TransportError::Closed),
            },
            Some(done) = pending.join_next_with_id(), if !pending.is_empty() => {
                let id = match &done {
                    Ok((id, _)) => *id,
                    Err(e) => e.id(),
                };
                in_flight.remove(&id);
                let Ok((_, (addr, res))) = done else { continue };
                match res {
                    Ok((rank, c)) => match out.entry(rank) {
                        // dropped: the second connection closes
                        Entry::Occupied(_) => refused(&mut refusals, format!("{addr}: second connection from {rank}")),
                        Entry::Vacant(v) => {
                            v.insert(c);
                        }
                    },
                    Err(why) => refused(&mut refusals, format!("{addr}: {why}")),
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                let missing: Vec<String> = wanted
                    .iter()
                    .filter(|r| !out.contains_key(r))
                    .map(|r| r.0.to_string())
                    .collect();
                return Err(TransportError::Handshake {
                    peer: None,
                    addr: local.to_string(),
                    reason: format!(
                        "ranks [{}] did not connect before the deadline{}",
                        missing.join(", "),
                        if refusals.is_empty() { String::new() } else {
                            format!("; refused: {}", refusals.join("; "))
                        }
                    ),
                });
            }
        }
    }
    // Every rank is here: a handshake still in flight (a hello cut short
    // and left open, a client that says nothing) is dropped, and said so,
    // as any refused connection is.
    for addr in in_flight.into_values() {
        refused(
            &mut refusals,
            format!("{addr}: no whole hello by the time every rank had connected"),
        );
    }
    Ok(out)
}

#[cfg(any(feature = "fabric", feature = "verbs"))]
/// The control links of a wire whose data moves elsewhere (libfabric,
/// ibverbs): a TCP writer per peer, `None` for this rank and once closed.
pub(crate) type ControlLinks = Vec<tokio::sync::Mutex<Option<tokio::net::tcp::OwnedWriteHalf>>>;

#[cfg(any(feature = "fabric", feature = "verbs"))]
/// Writes each peer its goodbye on its control link: `BYE!` and how many
/// frames this rank sent it (`sent`, by rank), within `deadline`.
pub(crate) async fn say_goodbyes(
    links: &ControlLinks,
    sent: &[std::sync::atomic::AtomicU64],
    deadline: crate::Instant,
) {
    use tokio::io::AsyncWriteExt;
    for (r, link) in links.iter().enumerate() {
        let mut bye = [0u8; 12];
        bye[..4].copy_from_slice(b"BYE!");
        bye[4..].copy_from_slice(
            &sent[r]
                .load(std::sync::atomic::Ordering::Relaxed)
                .to_le_bytes(),
        );
        if let Some(w) = link.lock().await.as_mut() {
            let _ = tokio::time::timeout_at(deadline, w.write_all(&bye)).await;
        }
    }
}

#[cfg(any(feature = "fabric", feature = "verbs"))]
/// Ends the control links that are free now: the peers see this rank gone.
pub(crate) fn drop_links(links: &ControlLinks) {
    for link in links {
        if let Ok(mut w) = link.try_lock() {
            w.take();
        }
    }
}
