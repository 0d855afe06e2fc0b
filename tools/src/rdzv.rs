//! The launchers' rendezvous, for when the host list is not known in
//! advance (torchrun's `--rdzv-endpoint`): every node runs `kungfu-run -np N
//! --rdzv HOST:PORT --slots S prog`; the launcher on HOST serves the
//! rendezvous at HOST:PORT, every launcher (that one too) joins it with its
//! slot count, and once the slots joined reach N each gets the host list
//! (ordered by address, so that the ranks do not depend on who came
//! first), its own host (the address it reached the
//! rendezvous from, which the others can reach too) and the job's cluster
//! id; then each goes on as in per-node mode (`--self`).
//!
//! One line at a time, bounded in length, every read and the whole wait
//! under the deadline:
//! ```text
//! server -> launcher:  KFRDZV2 <server nonce, hex>\n
//! launcher -> server:  JOIN <slots> <launcher nonce, hex> <join mac, hex>\n
//! server -> launcher:  OK <cluster id, hex> <host:slots,host:slots,...> <answer mac, hex>\n
//!                      ERR <reason>\n
//!
//! join mac   = HMAC-SHA256(job secret, "kungfu-run rendezvous v2"
//!                          | server nonce | slots | launcher nonce)
//! answer mac = HMAC-SHA256(job secret, "kungfu-run rendezvous answer v2"
//!                          | launcher nonce | cluster id | host list)
//! ```
//! A join needs the job secret (`KUNGFU_JOB_SECRET`, the same on every
//! node), over the server's fresh nonce, so that nobody without it can
//! join and a recorded join cannot be replayed; the answer proves the
//! secret too, over the launcher's fresh nonce, so that nobody else can
//! hand out a host list (an `ERR` is not proved: a forged one can only
//! make the join fail, which whoever sits on the path can do anyway).
//! Joins are read at once, each bounded on its own, so a slow or hostile
//! one holds nobody up.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use kungfu_transport::auth::{eq_constant_time, hex, random, JobSecret};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::{parse_hosts, HostSlots};

const MAC_LABEL: &[u8] = b"kungfu-run rendezvous v2";
const ANSWER_LABEL: &[u8] = b"kungfu-run rendezvous answer v2";
/// How long one join may take, from its connection to its JOIN line.
const JOIN_WITHIN: Duration = Duration::from_secs(10);
/// The most joins read at once (more wait in the listen backlog).
const MAX_PENDING: usize = 256;
/// The most workers a node may bring.
const MAX_SLOTS: usize = 1 << 16;
/// The longest line either side reads (a host list of a few thousand).
const MAX_LINE: u64 = 256 << 10;

/// What the rendezvous gives a launcher.
#[derive(Debug, PartialEq, Eq)]
pub struct Joined {
    pub hosts: Vec<HostSlots>,
    /// This launcher's host in `hosts`.
    pub me: String,
    pub cluster_id: u64,
}

/// A host's name in the job's host list: its address as the rendezvous
/// saw it (`-H` reads an IPv6 one in brackets, as the list writes it).
fn host_name(ip: std::net::IpAddr) -> String {
    ip.to_string()
}

fn join_mac(secret: &JobSecret, nonce: &str, slots: usize, theirs: &str) -> String {
    let slots = slots.to_string();
    let parts: [&[u8]; 5] = [
        nonce.as_bytes(),
        b" ",
        slots.as_bytes(),
        b" ",
        theirs.as_bytes(),
    ];
    hex(&secret.mac(MAC_LABEL, &parts))
}

fn answer_mac(secret: &JobSecret, theirs: &str, id: &str, hosts: &str) -> String {
    let parts: [&[u8]; 5] = [
        theirs.as_bytes(),
        b" ",
        id.as_bytes(),
        b" ",
        hosts.as_bytes(),
    ];
    hex(&secret.mac(ANSWER_LABEL, &parts))
}

fn nonce() -> anyhow::Result<String> {
    Ok(hex(&random::<32>().map_err(|e| anyhow::anyhow!("{e}"))?))
}

async fn read_line<R: tokio::io::AsyncRead + Unpin>(
    r: &mut BufReader<R>,
    deadline: Instant,
) -> anyhow::Result<String> {
    let mut line = String::new();
    let n = tokio::time::timeout_at(deadline, r.take(MAX_LINE).read_line(&mut line))
        .await
        .context("timed out")??;
    if n == 0 || !line.ends_with('\n') {
        bail!("the connection closed (or sent a line of more than {MAX_LINE} bytes)");
    }
    Ok(line.trim_end().to_string())
}

/// One launcher that joined: its host, and the connection its answer goes
/// on, with the nonce the answer proves.
struct Joiner {
    host: HostSlots,
    s: BufReader<TcpStream>,
    nonce: String,
}

/// Serves the rendezvous on `listener` for `np` slots: returns once every
/// launcher that joined has its answer, or at `deadline` (when the joined
/// are told why).
pub async fn serve(
    listener: TcpListener,
    np: usize,
    secret: JobSecret,
    cluster_id: u64,
    deadline: Instant,
) -> anyhow::Result<()> {
    let mut joined: Vec<Joiner> = Vec::new();
    let mut pending = tokio::task::JoinSet::new();
    let slots = |joined: &[Joiner]| joined.iter().map(|j| j.host.slots).sum::<usize>();
    while slots(&joined) < np {
        tokio::select! {
            accepted = listener.accept(), if pending.len() < MAX_PENDING => {
                let Ok((s, from)) = accepted else {
                    // out of descriptors, say: not in a spin
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let secret = secret.clone();
                pending.spawn(async move {
                    let mut s = BufReader::new(s);
                    let within = (Instant::now() + JOIN_WITHIN).min(deadline);
                    let got = handshake(&mut s, from, &secret, within).await;
                    (s, from, got)
                });
            }
            Some(done) = pending.join_next(), if !pending.is_empty() => {
                let Ok((mut s, from, got)) = done else { continue };
                let host = host_name(from.ip());
                match got {
                    Ok(_) if joined.iter().any(|j| j.host.host == host) => {
                        tell(&mut s, "this host joined already").await;
                    }
                    Ok((slots, nonce)) => joined.push(Joiner {
                        host: HostSlots { host, slots },
                        s,
                        nonce,
                    }),
                    Err(e) => {
                        tell(&mut s, &format!("{e:#}")).await;
                        eprintln!("kungfu-run: rendezvous: refused {from}: {e:#}");
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                let why = format!(
                    "{} of {np} slots joined the rendezvous before its deadline",
                    slots(&joined)
                );
                for j in &mut joined {
                    tell(&mut j.s, &why).await;
                }
                bail!("{why}");
            }
        }
    }
    // ranks by address, not by the order the joins happened to finish in
    joined.sort_by_key(|j| {
        let ip = j.host.host.parse::<std::net::IpAddr>().ok();
        (ip, j.host.host.clone())
    });
    // joins read already come too late; those still being read are cut
    while let Some(done) = pending.try_join_next() {
        if let Ok((mut s, _, Ok(_))) = done {
            tell(
                &mut s,
                &format!("the rendezvous is full ({np} slots joined)"),
            )
            .await;
        }
    }
    pending.abort_all();
    let list: Vec<String> = joined
        .iter()
        .map(|j| {
            let h = &j.host;
            if h.host.contains(':') {
                format!("[{}]:{}", h.host, h.slots)
            } else {
                format!("{}:{}", h.host, h.slots)
            }
        })
        .collect();
    let (id, hosts) = (format!("{cluster_id:x}"), list.join(","));
    for j in &mut joined {
        let mac = answer_mac(&secret, &j.nonce, &id, &hosts);
        let ok = format!("OK {id} {hosts} {mac}\n");
        let _ = tokio::time::timeout_at(
            Instant::now() + JOIN_WITHIN,
            j.s.get_mut().write_all(ok.as_bytes()),
        )
        .await;
    }
    Ok(())
}

/// Tells a joiner why it gets no host list (within a bound: it may not
/// read).
async fn tell(s: &mut BufReader<TcpStream>, why: &str) {
    let line = format!("ERR {why}\n");
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        s.get_mut().write_all(line.as_bytes()),
    )
    .await;
}

/// The server's side of one join: the slots asked for, and the joiner's
/// nonce.
async fn handshake(
    s: &mut BufReader<TcpStream>,
    from: SocketAddr,
    secret: &JobSecret,
    deadline: Instant,
) -> anyhow::Result<(usize, String)> {
    let nonce = nonce()?;
    tokio::time::timeout_at(
        deadline,
        s.get_mut()
            .write_all(format!("KFRDZV2 {nonce}\n").as_bytes()),
    )
    .await
    .context("timed out")??;
    let line = read_line(s, deadline).await?;
    let mut f = line.split(' ');
    let (Some("JOIN"), Some(slots), Some(theirs), Some(mac), None) =
        (f.next(), f.next(), f.next(), f.next(), f.next())
    else {
        bail!(
            "not a join from {from}: {:?}",
            line.chars().take(80).collect::<String>()
        );
    };
    let slots: usize = slots.parse().context("bad slot count")?;
    if slots == 0 || slots > MAX_SLOTS {
        bail!("bad slot count {slots}");
    }
    if theirs.len() != 64 || !theirs.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("a bad nonce");
    }
    if !eq_constant_time(
        join_mac(secret, &nonce, slots, theirs).as_bytes(),
        mac.as_bytes(),
    ) {
        bail!("bad credential (another KUNGFU_JOB_SECRET?)");
    }
    Ok((slots, theirs.to_string()))
}

/// Joins the rendezvous at `endpoint` with `slots`, retrying the
/// connection until `deadline` (its server may start later).
pub async fn join(
    endpoint: &str,
    slots: usize,
    secret: &JobSecret,
    deadline: Instant,
) -> anyhow::Result<Joined> {
    join_from(None, endpoint, slots, secret, deadline).await
}

/// [`join`], from source address `from` if given (tests: loopback
/// addresses stand for hosts).
async fn join_from(
    from: Option<std::net::IpAddr>,
    endpoint: &str,
    slots: usize,
    secret: &JobSecret,
    deadline: Instant,
) -> anyhow::Result<Joined> {
    let connect = || async {
        match from {
            None => TcpStream::connect(endpoint).await,
            Some(ip) => {
                let to: SocketAddr = tokio::net::lookup_host(endpoint)
                    .await?
                    .next()
                    .ok_or_else(|| std::io::Error::other("no address"))?;
                let sock = tokio::net::TcpSocket::new_v4()?;
                sock.bind(SocketAddr::new(ip, 0))?;
                sock.connect(to).await
            }
        }
    };
    let s = loop {
        match tokio::time::timeout_at(deadline, connect()).await {
            Ok(Ok(s)) => break s,
            Ok(Err(e)) if Instant::now() + Duration::from_millis(200) < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok(Err(e)) => bail!("cannot reach the rendezvous at {endpoint}: {e}"),
            Err(_) => bail!("cannot reach the rendezvous at {endpoint} before the deadline"),
        }
    };
    let me = host_name(s.local_addr()?.ip());
    let mut s = BufReader::new(s);
    let hello = read_line(&mut s, deadline)
        .await
        .context("the rendezvous's greeting")?;
    let Some(theirs) = hello.strip_prefix("KFRDZV2 ") else {
        bail!("{endpoint} is not a kungfu-run rendezvous (of this version)");
    };
    let ours = nonce()?;
    let mac = join_mac(secret, theirs, slots, &ours);
    let join = format!("JOIN {slots} {ours} {mac}\n");
    tokio::time::timeout_at(deadline, s.get_mut().write_all(join.as_bytes()))
        .await
        .context("timed out joining the rendezvous")??;
    let answer = read_line(&mut s, deadline)
        .await
        .context("waiting for the other nodes at the rendezvous")?;
    if let Some(why) = answer.strip_prefix("ERR ") {
        bail!("the rendezvous at {endpoint} refused: {why}");
    }
    let mut f = answer.split(' ');
    let (Some("OK"), Some(id), Some(hosts), Some(mac), None) =
        (f.next(), f.next(), f.next(), f.next(), f.next())
    else {
        bail!("a bad answer from the rendezvous at {endpoint}");
    };
    if !eq_constant_time(
        answer_mac(secret, &ours, id, hosts).as_bytes(),
        mac.as_bytes(),
    ) {
        bail!("the answer of the rendezvous at {endpoint} is not proved by the job secret");
    }
    let cluster_id = u64::from_str_radix(id, 16).context("a bad cluster id from the rendezvous")?;
    let hosts = parse_hosts(hosts)?;
    if !hosts.iter().any(|h| h.host == me) {
        bail!("the rendezvous's host list leaves this host ({me}) out");
    }
    if hosts.iter().any(|h| h.slots > MAX_SLOTS) {
        bail!("the rendezvous's host list asks for more than {MAX_SLOTS} slots on a host");
    }
    let loopback = |h: &HostSlots| {
        h.host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
    };
    // all on loopback: one machine (tests); some: this node reached its
    // own rendezvous over loopback, and the others cannot
    if hosts.iter().any(loopback) && !hosts.iter().all(loopback) {
        bail!(
            "the rendezvous at {endpoint} is reached over a loopback address, which the other \
             nodes cannot reach: give --rdzv an address of the network (a name that resolves to \
             127.0.1.1, as Debian's /etc/hosts has it for this machine's own name, will not do)"
        );
    }
    Ok(Joined {
        hosts,
        me,
        cluster_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three launchers join (on loopback addresses of their own); each gets
    /// the same list and id, and itself in it; a joiner with another secret
    /// is refused without holding the others up.
    #[tokio::test]
    async fn launchers_meet_and_strangers_are_refused() {
        let k = JobSecret::new(b"0123456789abcdef").unwrap();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = l.local_addr().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(20);
        let server = tokio::spawn(serve(l, 5, k.clone(), 0xabc, deadline));
        let other = JobSecret::new(b"fedcba9876543210").unwrap();
        let e = join(&at, 1, &other, deadline).await.unwrap_err();
        assert!(format!("{e:#}").contains("bad credential"), "{e:#}");
        // connections that say nothing hold nobody up (the joins below
        // end long before the 10 s such a connection has)
        let _silent: Vec<TcpStream> = {
            let mut v = Vec::new();
            for _ in 0..3 {
                v.push(TcpStream::connect(&at).await.unwrap());
            }
            v
        };
        let began = Instant::now();
        let mut joins = Vec::new();
        for (ip, slots) in [("127.0.0.2", 2), ("127.0.0.3", 1), ("127.0.0.4", 2)] {
            let (at, k) = (at.clone(), k.clone());
            joins.push(tokio::spawn(async move {
                join_from(Some(ip.parse().unwrap()), &at, slots, &k, deadline).await
            }));
        }
        let mut lists = Vec::new();
        for (j, ip) in joins
            .into_iter()
            .zip(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
        {
            let got = j.await.unwrap().unwrap();
            assert_eq!(got.me, ip);
            assert_eq!(got.cluster_id, 0xabc);
            lists.push(got.hosts);
        }
        assert!(lists.windows(2).all(|w| w[0] == w[1]));
        assert_eq!(lists[0].iter().map(|h| h.slots).sum::<usize>(), 5);
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "{:?}",
            began.elapsed()
        );
        server.await.unwrap().unwrap();
    }

    /// A rendezvous that does not know the secret cannot hand out a host
    /// list: its answer is refused.
    #[tokio::test]
    async fn an_answer_without_the_secret_is_refused() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = l.local_addr().unwrap().to_string();
        let fake = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let mut s = BufReader::new(s);
            s.get_mut()
                .write_all(format!("KFRDZV2 {}\n", "ab".repeat(32)).as_bytes())
                .await
                .unwrap();
            let mut line = String::new();
            s.read_line(&mut line).await.unwrap();
            let mac = "00".repeat(32);
            s.get_mut()
                .write_all(format!("OK 1 127.0.0.1:1 {mac}\n").as_bytes())
                .await
                .unwrap();
        });
        let k = JobSecret::new(b"0123456789abcdef").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let e = join(&at, 1, &k, deadline).await.unwrap_err();
        assert!(
            format!("{e:#}").contains("not proved by the job secret"),
            "{e:#}"
        );
        fake.await.unwrap();
    }

    /// Too few slots by the deadline: everybody is told, nobody hangs.
    #[tokio::test]
    async fn a_rendezvous_short_of_slots_ends_at_its_deadline() {
        let k = JobSecret::new(b"0123456789abcdef").unwrap();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = l.local_addr().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(2);
        let server = tokio::spawn(serve(l, 4, k.clone(), 1, deadline));
        let e = join(&at, 2, &k, deadline + Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(format!("{e:#}").contains("2 of 4 slots joined"), "{e:#}");
        assert!(server.await.unwrap().is_err());
    }
}
