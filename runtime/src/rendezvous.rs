//! A small rendezvous for workers that were not given a peer list (torchrun,
//! Slurm, Open MPI): rank 0 serves, every rank (rank 0 included) registers
//! the address it listens on, and once all have registered each gets the
//! full peer list and the cluster id.
//!
//! One line at a time, bounded in length, every read under the deadline:
//! ```text
//! rank 0 -> worker:  KFRV2 <nonce, hex>\n
//! worker -> rank 0:  KFRV2 <rank> <size> <version> <host> <port> <mac, hex | ->\n
//! rank 0 -> worker:  OK <cluster id, hex> <host:port,host:port,...>\n
//!                    ERR <reason>\n
//!
//! mac = HMAC-SHA256(job secret, "kungfu rendezvous v2" | nonce | "<rank> <size> <version> <host> <port>")
//! ```
//! A registration changes the server's state, so with a job secret
//! (`KUNGFU_JOB_SECRET`, the same on every rank) it must carry the MAC,
//! over the server's fresh nonce so that a recorded one cannot be
//! replayed; without a secret on both sides it carries `-`, and one side
//! with a secret and the other without is refused. The reply is not
//! MACed: a false rendezvous can only hand out a peer list whose peers
//! then fail the transports' authenticated handshake.
//!
//! The server listens on the address the launcher names (`MASTER_ADDR`,
//! the first Slurm node, 127.0.0.1 for one-host `mpirun`,
//! `KUNGFU_RENDEZVOUS`), never on every interface. A worker advertises the
//! local address of its connection to the rendezvous, which is an address
//! the rendezvous host (and so, on a flat cluster network, every other
//! host) can reach.

use std::collections::BTreeMap;
use std::time::Duration;

use kungfu_topology::{fnv1a64, Peer, PeerList};
use kungfu_transport::auth::{hex, JobSecret};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::BootstrapError;

const MAX_REQUEST: u64 = 512;
/// The challenge line: `KFRV2 ` and 64 hex digits.
const MAX_CHALLENGE: u64 = 128;
const MAC_LABEL: &[u8] = b"kungfu rendezvous v2";
/// A peer entry is at most ~300 bytes; 16384 of them fit.
const MAX_REPLY: u64 = 8 << 20;

fn err(addr: &str, reason: impl Into<String>) -> BootstrapError {
    BootstrapError::Rendezvous {
        addr: addr.to_string(),
        reason: reason.into(),
    }
}

async fn read_line(
    s: &mut BufReader<TcpStream>,
    max: u64,
    deadline: Instant,
) -> Result<String, String> {
    let mut line = String::new();
    let n = tokio::time::timeout_at(deadline, (&mut *s).take(max).read_line(&mut line))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| format!("read: {e}"))?;
    if n == 0 || !line.ends_with('\n') {
        return Err("connection closed or line too long".into());
    }
    line.pop();
    Ok(line)
}

/// The MAC of a registration's fields (`<rank> <size> <version> <host>
/// <port>`) after the server's `nonce`.
fn registration_mac(secret: &JobSecret, nonce: &str, fields: &str) -> String {
    hex(&secret.mac(MAC_LABEL, &[nonce.as_bytes(), b" ", fields.as_bytes()]))
}

/// Serves one rendezvous for `size` workers of cluster version `version`,
/// until all registered or `deadline`. With `secret`, every registration
/// must prove it (see the module docs); refusals are logged.
pub async fn serve(
    listener: TcpListener,
    size: usize,
    version: u32,
    secret: Option<JobSecret>,
    deadline: Instant,
) -> Result<(), BootstrapError> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let mut joined: BTreeMap<usize, (Peer, BufReader<TcpStream>)> = BTreeMap::new();
    let mut refusals: Vec<String> = Vec::new();
    let mut pending = tokio::task::JoinSet::new();
    while joined.len() < size {
        tokio::select! {
            acc = listener.accept() => {
                let Ok((s, from)) = acc else { continue };
                pending.spawn(async move {
                    let mut s = BufReader::new(s);
                    let r = challenge(&mut s, deadline).await;
                    (from, s, r)
                });
            }
            Some(Ok((from, mut s, line))) = pending.join_next(), if !pending.is_empty() => {
                let verdict = line.and_then(|(nonce, l)| {
                    parse_request(&l, size, version, secret.as_ref(), &nonce)
                });
                match verdict {
                    Ok((rank, _)) if joined.contains_key(&rank) => {
                        let why = format!("rank {rank} registered twice");
                        let _ = s.get_mut().write_all(format!("ERR {why}\n").as_bytes()).await;
                        refusals.push(format!("{from}: {why}"));
                    }
                    Ok((rank, peer)) => {
                        joined.insert(rank, (peer, s));
                    }
                    Err(why) => {
                        let _ = s.get_mut().write_all(format!("ERR {why}\n").as_bytes()).await;
                        eprintln!("kungfu: rendezvous: refused a registration from {from}: {why}");
                        refusals.push(format!("{from}: {why}"));
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                let missing: Vec<String> = (0..size)
                    .filter(|r| !joined.contains_key(r))
                    .map(|r| r.to_string())
                    .collect();
                let mut why = format!("ranks [{}] did not register in time", missing.join(", "));
                if !refusals.is_empty() {
                    why.push_str(&format!("; refused: {}", refusals.join("; ")));
                }
                return Err(err(&addr, why));
            }
        }
    }
    let peers: Vec<Peer> = joined.values().map(|(p, _)| p.clone()).collect();
    let reply = match PeerList::new(peers) {
        Ok(list) => format!("OK {:x} {list}\n", cluster_id(&list)),
        Err(e) => format!("ERR {e}\n"),
    };
    for (_, (_, mut s)) in joined {
        // A worker that left after registering finds out when it connects
        // to its peers; the others must still get the list.
        let _ = tokio::time::timeout_at(deadline, s.get_mut().write_all(reply.as_bytes())).await;
    }
    Ok(())
}

/// Sends a fresh nonce and reads the registration: (nonce, line).
async fn challenge(
    s: &mut BufReader<TcpStream>,
    deadline: Instant,
) -> Result<(String, String), String> {
    let nonce = hex(&kungfu_transport::auth::random::<32>().map_err(|e| e.to_string())?);
    tokio::time::timeout_at(
        deadline,
        s.get_mut().write_all(format!("KFRV2 {nonce}\n").as_bytes()),
    )
    .await
    .map_err(|_| "timed out".to_string())?
    .map_err(|e| format!("send challenge: {e}"))?;
    Ok((nonce, read_line(s, MAX_REQUEST, deadline).await?))
}

/// The first 80 characters of a line, for an error message (not bytes: a
/// cut inside a character panicked).
fn first_chars(line: &str) -> &str {
    line.char_indices()
        .nth(80)
        .map_or(line, |(i, _)| &line[..i])
}

fn parse_request(
    line: &str,
    size: usize,
    version: u32,
    secret: Option<&JobSecret>,
    nonce: &str,
) -> Result<(usize, Peer), String> {
    let f: Vec<&str> = line.split(' ').collect();
    if f.len() != 7 || f[0] != "KFRV2" {
        return Err(format!("malformed registration {:?}", first_chars(line)));
    }
    let fields = f[1..6].join(" ");
    match (secret, f[6]) {
        (None, "-") => {}
        (None, _) => return Err("bad credential: the worker holds a job secret (KUNGFU_JOB_SECRET), the rendezvous does not".into()),
        (Some(_), "-") => return Err("bad credential: the worker holds no job secret (KUNGFU_JOB_SECRET), the rendezvous does".into()),
        (Some(k), mac) => {
            let want = registration_mac(k, nonce, &fields);
            if !kungfu_transport::auth::eq_constant_time(want.as_bytes(), mac.as_bytes()) {
                return Err("bad credential: the registration's MAC is not of the job secret".into());
            }
        }
    }
    let num = |s: &str| s.parse::<u64>().map_err(|_| format!("bad number {s:?}"));
    let (rank, their_size, their_version) = (num(f[1])?, num(f[2])?, num(f[3])?);
    if their_size != size as u64 {
        return Err(format!("size {their_size} differs from {size}"));
    }
    if their_version != u64::from(version) {
        return Err(format!(
            "cluster version {their_version} differs from {version}"
        ));
    }
    if rank >= size as u64 {
        return Err(format!("rank {rank} outside a cluster of {size}"));
    }
    let port = f[5]
        .parse::<u16>()
        .map_err(|_| format!("bad port {:?}", f[5]))?;
    if !Peer::is_valid_host(f[4]) {
        return Err(format!("bad host {:?}", f[4]));
    }
    Ok((
        rank as usize,
        Peer {
            host: f[4].to_string(),
            port,
        },
    ))
}

/// A job-unique id chosen by rank 0 (no RNG crate needed: the clock, the
/// process id and the peer list are unique enough to tell jobs apart).
fn cluster_id(list: &PeerList) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut h = fnv1a64(list.digest().0, &now.to_le_bytes());
    h = fnv1a64(h, &std::process::id().to_le_bytes());
    h
}

/// Registers rank `rank` with the rendezvous at `host:port` (proving
/// `secret` if given) and returns the listener it advertised, the peer
/// list and the cluster id.
pub async fn register(
    host: &str,
    port: u16,
    rank: usize,
    size: usize,
    version: u32,
    secret: Option<&JobSecret>,
    deadline: Instant,
) -> Result<(TcpListener, PeerList, u64), BootstrapError> {
    let addr = format!("{host}:{port}");
    let mut backoff = Duration::from_millis(5);
    let stream = loop {
        match tokio::time::timeout_at(deadline, TcpStream::connect((host, port))).await {
            Ok(Ok(s)) => break s,
            Ok(Err(e)) if Instant::now() + backoff < deadline => {
                let _ = e;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Ok(Err(e)) => return Err(err(&addr, format!("cannot connect: {e}"))),
            Err(_) => return Err(err(&addr, "cannot connect before the deadline")),
        }
    };
    let local = stream
        .local_addr()
        .map_err(|e| err(&addr, format!("local address: {e}")))?;
    let listener = TcpListener::bind((local.ip(), 0))
        .await
        .map_err(|e| err(&addr, format!("bind a data port on {}: {e}", local.ip())))?;
    let my_port = listener
        .local_addr()
        .map_err(|e| err(&addr, format!("data port: {e}")))?
        .port();
    let mut s = BufReader::new(stream);
    let challenge = read_line(&mut s, MAX_CHALLENGE, deadline)
        .await
        .map_err(|e| err(&addr, format!("challenge: {e}")))?;
    let nonce = challenge
        .strip_prefix("KFRV2 ")
        .filter(|n| n.len() == 64 && n.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| {
            err(
                &addr,
                format!(
                    "not a rendezvous: {:?}",
                    &challenge[..challenge.len().min(80)]
                ),
            )
        })?;
    let fields = format!("{rank} {size} {version} {} {my_port}", local.ip());
    let mac = secret.map_or_else(|| "-".into(), |k| registration_mac(k, nonce, &fields));
    let req = format!("KFRV2 {fields} {mac}\n");
    s.get_mut()
        .write_all(req.as_bytes())
        .await
        .map_err(|e| err(&addr, format!("send: {e}")))?;
    let line = read_line(&mut s, MAX_REPLY, deadline)
        .await
        .map_err(|e| err(&addr, e))?;
    let (peers, id) = parse_reply(&line, size).map_err(|e| err(&addr, e))?;
    Ok((listener, peers, id))
}

/// Rank 0's reply to a registration: the peer list of `size` peers and the
/// cluster id.
fn parse_reply(line: &str, size: usize) -> Result<(PeerList, u64), String> {
    if let Some(why) = line.strip_prefix("ERR ") {
        return Err(format!("refused: {why}"));
    }
    let start = first_chars(line);
    let bad = || format!("malformed reply {start:?}");
    let rest = line.strip_prefix("OK ").ok_or_else(bad)?;
    let (id, list) = rest.split_once(' ').ok_or_else(bad)?;
    let id = u64::from_str_radix(id, 16).map_err(|_| bad())?;
    let peers: PeerList = list.parse().map_err(|_| bad())?;
    if peers.len() != size {
        return Err(bad());
    }
    Ok((peers, id))
}

/// Fuzzing: the first two bytes pick a cluster size and version, the rest
/// is one line, read as a registration (by rank 0) and as a reply (by a
/// worker). Panics only on a broken invariant: a registration accepted
/// names a rank of the cluster and a peer that rank 0's reply carries
/// unchanged; a reply accepted has `size` peers.
pub(crate) fn fuzz_rendezvous(data: &[u8]) {
    let [a, b, rest @ ..] = data else { return };
    let (size, version) = (usize::from(a % 8) + 1, u32::from(b % 4));
    let Ok(line) = std::str::from_utf8(rest) else {
        return;
    };
    if let Ok((rank, peer)) = parse_request(line, size, version, None, "n") {
        assert!(rank < size);
        let list = PeerList::new(vec![peer.clone()]).expect("one peer");
        let reply = format!("OK {:x} {list}", 7);
        let (back, id) = parse_reply(&reply, 1).expect("rank 0's reply parses");
        assert_eq!((back.peers(), id), (&[peer][..], 7));
    }
    if let Ok((peers, _)) = parse_reply(line, size) {
        assert_eq!(peers.len(), size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_validated() {
        assert!(parse_request("KFRV2 1 4 0 10.0.0.1 5000 -", 4, 0, None, "n").is_ok());
        for bad in [
            "KFRV2 4 4 0 h 1 -",
            "KFRV2 1 5 0 h 1 -",
            "KFRV2 1 4 1 h 1 -",
            "KFRV2 1 4 0 h 70000 -",
            "HELLO",
            "KFRV2 1 4 0  1 -",
            "KFRV1 1 4 0 h 1",
            "KFRV2 1 4 0 h 1 00ff",
            // a host that would break rank 0's reply to everyone (found by
            // the rendezvous fuzz target)
            "KFRV2 1 4 0 a,b 1 -",
            "KFRV2 1 4 0 a\u{7f}\0 1 -",
            "KFRV2 1 4 0 [::1] 1 -",
        ] {
            assert!(parse_request(bad, 4, 0, None, "n").is_err(), "{bad}");
        }
    }

    /// With a secret, a registration carries the MAC over the server's
    /// nonce: another secret, none, or another nonce (a replay) is a bad
    /// credential.
    #[test]
    fn registrations_prove_the_job_secret() {
        let k = JobSecret::new(b"s3cret").unwrap();
        let other = JobSecret::new(b"guess").unwrap();
        let fields = "1 4 0 10.0.0.1 5000";
        let line = |mac: String| format!("KFRV2 {fields} {mac}");
        let check = |l: &str, nonce: &str| parse_request(l, 4, 0, Some(&k), nonce);
        assert!(check(&line(registration_mac(&k, "n1", fields)), "n1").is_ok());
        for (l, nonce) in [
            (line(registration_mac(&other, "n1", fields)), "n1"),
            (line(registration_mac(&k, "n0", fields)), "n1"),
            (line("-".into()), "n1"),
        ] {
            let e = check(&l, nonce).unwrap_err();
            assert!(e.starts_with("bad credential"), "{e}");
        }
        let e = parse_request(&line(registration_mac(&k, "n", fields)), 4, 0, None, "n");
        assert!(e.unwrap_err().starts_with("bad credential"));
    }

    #[test]
    fn malformed_replies_are_refused_not_panicked_on() {
        // a multibyte character across byte 80, where the error message
        // used to cut the reply
        let line = format!("OK 1 {}\u{e9}b:1", "a".repeat(74));
        let e = parse_reply(&line, 2).unwrap_err();
        assert!(
            e.starts_with("malformed reply") && e.contains('\u{e9}'),
            "{e}"
        );
        assert_eq!(parse_reply("ERR full", 2).unwrap_err(), "refused: full");
        assert!(parse_reply("OK zz a:1", 1).is_err());
        assert_eq!(parse_reply("OK 1f a:1,b:2", 2).unwrap().1, 0x1f);
        // the same in a registration (found by the corpus once the
        // registration grew a field)
        let reg = format!("KFRV2 {}\u{e9}", "a".repeat(79));
        let e = parse_request(&reg, 2, 0, None, "n").unwrap_err();
        assert!(e.starts_with("malformed registration"), "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn everyone_gets_the_same_list() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let deadline = Instant::now() + Duration::from_secs(10);
        let k = JobSecret::new(b"s3cret").unwrap();
        let server = tokio::spawn(serve(l, 3, 0, Some(k.clone()), deadline));
        let clients: Vec<_> = (0..3)
            .map(|r| {
                let k = k.clone();
                tokio::spawn(async move {
                    register("127.0.0.1", port, r, 3, 0, Some(&k), deadline).await
                })
            })
            .collect();
        let mut lists = Vec::new();
        for c in clients {
            let (_l, peers, id) = c.await.unwrap().unwrap();
            lists.push((peers, id));
        }
        server.await.unwrap().unwrap();
        assert!(lists.windows(2).all(|w| w[0] == w[1]));
        assert_eq!(lists[0].0.len(), 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wrong_size_is_refused_and_the_server_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        // the refusal comes long before the server's deadline, however
        // loaded the machine: only the order of magnitude matters
        let deadline = Instant::now() + Duration::from_secs(3);
        let server = tokio::spawn(serve(l, 2, 0, None, deadline));
        let e = register("127.0.0.1", port, 1, 3, 0, None, deadline)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("size 3 differs from 2"), "{e}");
        let k = JobSecret::new(b"s3cret").unwrap();
        let e = register("127.0.0.1", port, 1, 2, 0, Some(&k), deadline)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("refused: bad credential"), "{e}");
        let e = server.await.unwrap().unwrap_err();
        assert!(
            e.to_string().contains("ranks [0, 1] did not register"),
            "{e}"
        );
    }
}
