//! Elastic clusters: the cluster config (a version and a peer list), the
//! HTTP config server `kungfu-run -w` runs, and its client.
//!
//! The server speaks a deliberately small slice of HTTP/1.1 (one request
//! per connection, bounded heads and bodies, every read under a deadline):
//!
//! ```text
//! GET /cluster            200  version 3\npeers 127.0.0.1:4001,127.0.0.1:4002\n
//! PUT /cluster  size N    200  the new config (version + 1; the first N
//!                              peers kept, or new ones added on this host)
//! PUT /cluster  version V\npeers ...
//!                         200  the config as given; V must be the current
//!                              version + 1 (409 otherwise)
//! ```
//! So `curl -X PUT -d 'size 4' http://127.0.0.1:PORT/cluster` resizes a
//! running job, and a worker does the same with
//! [`crate::Worker::propose_new_size`].
//!
//! A worker's identity across versions is its address: its rank in a
//! version is its position in that version's peer list.
//!
//! # Credential
//!
//! A server with a credential ([`ServerRules::credential`]; `kungfu-run
//! -w` always gives one) refuses a `PUT` without `Authorization: Bearer
//! <token>` (401) or with another token (403), compared in constant time.
//! The token is [`JobSecret::config_token`] of the job's secret
//! (`KUNGFU_JOB_SECRET`): workers make it themselves, and `kungfu-run
//! --config-token` prints it for a user whose environment holds the
//! secret. It is derived, not the secret, because plain HTTP carries it in
//! clear (over loopback: `kungfu-run` binds the server to 127.0.0.1). `GET`
//! stays open: it changes nothing, and what it shows (the workers'
//! loopback addresses) any local user can list with `ss -tln`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::store::{parse_change, Change, PutError};
use kungfu_topology::{Peer, PeerList};
use kungfu_transport::auth::{eq_constant_time, JobSecret};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// The longest request or response head accepted.
const MAX_HEAD: usize = 8 << 10;
/// The longest body accepted (a peer list of ~16k entries).
const MAX_BODY: usize = 1 << 20;
/// How long the server gives a client to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// One version of the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    pub version: u32,
    pub peers: PeerList,
}

impl ClusterConfig {
    /// The text form served and accepted by the config server.
    pub fn encode(&self) -> String {
        format!("version {}\npeers {}\n", self.version, self.peers)
    }

    /// Parses [`ClusterConfig::encode`]'s form.
    pub fn parse(text: &str) -> Result<ClusterConfig, String> {
        let mut version = None;
        let mut peers = None;
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            match line.split_once(' ') {
                Some(("version", v)) => {
                    version = Some(
                        v.trim()
                            .parse::<u32>()
                            .map_err(|_| format!("bad version {v:?}"))?,
                    )
                }
                Some(("peers", p)) => {
                    peers = Some(
                        p.trim()
                            .parse::<PeerList>()
                            .map_err(|e| format!("bad peer list: {e}"))?,
                    )
                }
                _ => return Err(format!("unexpected line {line:?}")),
            }
        }
        Ok(ClusterConfig {
            version: version.ok_or("no version line")?,
            peers: peers.ok_or("no peers line")?,
        })
    }
}

/// Makes the address of a new peer, given the peers so far.
pub type NewPeer = Box<dyn Fn(&[Peer]) -> Result<Peer, String> + Send + Sync>;

/// What a config server accepts.
pub struct ServerRules {
    /// The largest cluster.
    pub max_size: usize,
    /// If set, every peer must be on one of these hosts (the hosts a
    /// launcher starts workers on).
    pub hosts: Option<Vec<String>>,
    /// Makes the address of a new peer when `size N` grows the cluster;
    /// given the peers so far.
    pub new_peer: NewPeer,
    /// The bearer token a request that changes the config must carry
    /// ([`JobSecret::config_token`]); `None`: anyone who reaches the port
    /// may (tests only).
    pub credential: Option<String>,
}

/// A running config server.
pub struct ConfigServer {
    addr: SocketAddr,
    rx: watch::Receiver<ClusterConfig>,
    state: Arc<ServerState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ConfigServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ConfigServer {
    /// Serves `initial` on `listener` until dropped.
    pub fn start(
        listener: TcpListener,
        initial: ClusterConfig,
        rules: ServerRules,
    ) -> std::io::Result<ConfigServer> {
        let addr = listener.local_addr()?;
        let (tx, rx) = watch::channel(initial);
        let history = [tx.borrow().clone()].into();
        let state = Arc::new(ServerState {
            tx,
            rules,
            write: Mutex::new(history),
        });
        let served = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((s, _)) = listener.accept().await else {
                    continue;
                };
                let state = served.clone();
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(REQUEST_TIMEOUT, serve_one(s, &state)).await;
                });
            }
        });
        Ok(ConfigServer {
            addr,
            rx,
            state,
            task,
        })
    }

    /// The URL workers get (`KUNGFU_CONFIG_SERVER`).
    pub fn url(&self) -> String {
        format!("http://{}/cluster", self.addr)
    }

    /// The current config, and each new one as it is put (the latest
    /// only: see [`ConfigServer::since`]).
    pub fn subscribe(&self) -> watch::Receiver<ClusterConfig> {
        self.rx.clone()
    }

    /// Every config it keeps (the last 64) after `version`, oldest first:
    /// a watcher that was told only of the latest learns of each version
    /// between (a launcher must start the workers a version adds even when
    /// a later one came before it looked: workers may connect it).
    pub fn since(&self, version: u32) -> Vec<ClusterConfig> {
        self.state.since(version)
    }
}

impl ConfigServer {
    /// Every version after `after`, in order, as it is made: a launcher
    /// must see each one (see [`ConfigServer::since`]), not only the
    /// latest. Ends when the server is dropped.
    /// (Always `Ok`: the type is [`follow`]'s.)
    pub fn versions(&self, after: u32) -> mpsc::UnboundedReceiver<Result<ClusterConfig, String>> {
        let (tx, out) = mpsc::unbounded_channel();
        let mut rx = self.rx.clone();
        let state = Arc::downgrade(&self.state);
        tokio::spawn(async move {
            let mut seen = after;
            loop {
                let Some(state) = state.upgrade() else { return };
                for c in state.since(seen) {
                    seen = c.version;
                    if tx.send(Ok(c)).is_err() {
                        return;
                    }
                }
                drop(state);
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        out
    }
}

/// Follows the config server at `url` from another host: every version
/// after `after`, in order, as a poll every `period` finds it (each
/// version between two polls is fetched from the server's history; one it
/// forgot already is skipped). A server unreachable for `give_up` ends it
/// with the error.
pub fn follow(
    url: String,
    after: u32,
    period: Duration,
    give_up: Duration,
) -> mpsc::UnboundedReceiver<Result<ClusterConfig, String>> {
    let (tx, out) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut seen = after;
        let mut reached = Instant::now();
        loop {
            let deadline = Instant::now() + period.max(Duration::from_secs(2));
            match get_config(&url, deadline).await {
                Ok(latest) => {
                    reached = Instant::now();
                    // the server keeps the last HISTORY versions: older
                    // ones are gone anyway
                    seen = seen.max(latest.version.saturating_sub(HISTORY as u32));
                    while seen < latest.version {
                        let v = seen + 1;
                        let c = if v == latest.version {
                            Some(latest.clone())
                        } else {
                            match get_version(&url, v, deadline).await {
                                Ok(c) => c,
                                // not skipped: tried again at the next poll
                                Err(_) => break,
                            }
                        };
                        seen = v;
                        if let Some(c) = c {
                            if tx.send(Ok(c)).is_err() {
                                return;
                            }
                        }
                    }
                }
                Err(e) if reached.elapsed() > give_up => {
                    let _ = tx.send(Err(format!(
                        "the config server {url} is unreachable for {give_up:?}: {e}"
                    )));
                    return;
                }
                Err(_) => {}
            }
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(period).await;
        }
    });
    out
}

struct ServerState {
    tx: watch::Sender<ClusterConfig>,
    rules: ServerRules,
    /// Serialises puts (check and replace as one step), and keeps the
    /// last [`HISTORY`] versions (`GET /cluster/V`).
    write: Mutex<std::collections::VecDeque<ClusterConfig>>,
}

/// How many versions the config server keeps for `GET /cluster/V`.
const HISTORY: usize = 64;

impl ServerState {
    fn since(&self, version: u32) -> Vec<ClusterConfig> {
        let history = self.write.lock().unwrap_or_else(|e| e.into_inner());
        history
            .iter()
            .filter(|c| c.version > version)
            .cloned()
            .collect()
    }

    fn put(&self, body: &str) -> Result<ClusterConfig, (u16, String)> {
        let mut history = self.write.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.tx.borrow().clone();
        let bad = |why: String| (400, why);
        let refused = |e: PutError| match e {
            PutError::Conflict(why) => (409, why),
            PutError::Failed(why) => (400, why),
        };
        let (next_version, change) =
            parse_change(body, cur.version, self.rules.max_size).map_err(refused)?;
        let next = match change {
            // the size it has: no new version
            Change::Size(n) if n == cur.peers.len() => return Ok(cur),
            Change::Size(n) => {
                let mut peers: Vec<Peer> = cur.peers.peers().iter().take(n).cloned().collect();
                while peers.len() < n {
                    let p = (self.rules.new_peer)(&peers).map_err(|e| (503, e))?;
                    peers.push(p);
                }
                ClusterConfig {
                    version: next_version,
                    peers: PeerList::new(peers).map_err(|e| bad(e.to_string()))?,
                }
            }
            Change::Whole(c) => c,
        };
        if let Some(hosts) = &self.rules.hosts {
            if let Some(p) = next.peers.peers().iter().find(|p| !hosts.contains(&p.host)) {
                return Err(bad(format!(
                    "{p} is not on a host of the job ({})",
                    hosts.join(", ")
                )));
            }
        }
        self.tx.send_replace(next.clone());
        if history.len() == HISTORY {
            history.pop_front();
        }
        history.push_back(next.clone());
        Ok(next)
    }

    /// Version `v`, if it was made and is still kept.
    fn version(&self, v: &str) -> (u16, String) {
        let history = self.write.lock().unwrap_or_else(|e| e.into_inner());
        match v.parse::<u32>() {
            Err(_) => (400, format!("bad version {v:?}\n")),
            Ok(v) => match history.iter().find(|c| c.version == v) {
                Some(c) => (200, c.encode()),
                None => (
                    404,
                    format!("no version {v} (not made yet, or forgotten)\n"),
                ),
            },
        }
    }
}

async fn serve_one(mut s: TcpStream, state: &ServerState) -> std::io::Result<()> {
    let (code, body) = respond(state, read_message(&mut s).await);
    s.write_all(response(code, &body).as_bytes()).await?;
    s.shutdown().await
}

/// The server's answer to a request read by [`read_message`] (or the
/// reason it could not be read): the status code and the body.
fn respond(state: &ServerState, request: Result<(String, String), String>) -> (u16, String) {
    match request {
        Err(why) => (400, why),
        Ok((head, body)) => {
            let line = head.lines().next().unwrap_or_default();
            let mut parts = line.split_whitespace();
            match (parts.next(), parts.next()) {
                (Some("GET"), Some("/cluster")) => (200, state.tx.borrow().encode()),
                (Some("GET"), Some(p)) if p.starts_with("/cluster/") => {
                    state.version(&p["/cluster/".len()..])
                }
                (Some("PUT"), Some("/cluster")) => {
                    match authorized(&head, state.rules.credential.as_deref())
                        .and_then(|()| state.put(&body))
                    {
                        Ok(c) => (200, c.encode()),
                        Err((code, why)) => (code, format!("{why}\n")),
                    }
                }
                (Some(_), Some("/cluster")) => (405, "GET or PUT\n".into()),
                _ => (404, "only /cluster is served\n".into()),
            }
        }
    }
}

/// The whole response the server writes.
fn response(code: u16, body: &str) -> String {
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        _ => "Service Unavailable",
    };
    let challenge = if code == 401 {
        "WWW-Authenticate: Bearer\r\n"
    } else {
        ""
    };
    format!(
        "HTTP/1.1 {code} {reason}\r\n{challenge}Content-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Whether the request of `head` carries `credential` as its bearer
/// token: 401 without one, 403 with another.
fn authorized(head: &str, credential: Option<&str>) -> Result<(), (u16, String)> {
    let Some(want) = credential else {
        return Ok(());
    };
    let given = head.lines().skip(1).find_map(|line| {
        let (k, v) = line.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("authorization")
            .then(|| v.trim())
    });
    let Some(given) = given else {
        return Err((401, "this server wants the job's credential (Authorization: Bearer <kungfu-run --config-token>)".into()));
    };
    let token = given
        .split_once(' ')
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim());
    match token {
        Some(t) if eq_constant_time(t.as_bytes(), want.as_bytes()) => Ok(()),
        _ => Err((403, "bad credential".into())),
    }
}

/// Reads one HTTP message: the head (up to the blank line) and a body of
/// `Content-Length` bytes (none if absent), both bounded.
async fn read_message<S: AsyncRead + Unpin>(s: &mut S) -> Result<(String, String), String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > MAX_HEAD {
            return Err("head too long".into());
        }
        let n = s.read(&mut chunk).await.map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("closed before the end of the head".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end])
        .map_err(|_| "head is not UTF-8".to_string())?
        .to_string();
    let mut len = 0usize;
    for line in head.lines().skip(1) {
        if let Some((k, v)) = line.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                len = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("bad Content-Length {v:?}"))?;
            }
        }
    }
    if len > MAX_BODY {
        return Err(format!("body of {len} bytes; at most {MAX_BODY}"));
    }
    let mut body = buf[head_end + 4..].to_vec();
    if body.len() > len {
        return Err("more bytes than Content-Length".into());
    }
    while body.len() < len {
        let n = s.read(&mut chunk).await.map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("closed before the end of the body".into());
        }
        body.extend_from_slice(&chunk[..n.min(len - body.len())]);
    }
    let body = String::from_utf8(body).map_err(|_| "body is not UTF-8".to_string())?;
    Ok((head, body))
}

/// Splits `http://host:port/path` into the address and the path.
fn split_url(url: &str) -> Result<(&str, &str), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url:?}: only http:// URLs are served"))?;
    Ok(match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    })
}

/// The status code of a response head.
fn status(head: &str) -> Result<u16, String> {
    head.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad status line {:?}", head.lines().next()))
}

/// One HTTP request to the config server, with the job's credential if
/// `secret` is given; the status code and the body.
pub async fn request(
    method: &str,
    url: &str,
    body: &str,
    secret: Option<&JobSecret>,
    deadline: Instant,
) -> Result<(u16, String), String> {
    let (addr, path) = split_url(url)?;
    let io = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect to {addr}: {e}"))?;
        let auth = secret.map_or_else(String::new, |k| {
            format!("Authorization: Bearer {}\r\n", k.config_token())
        });
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let (head, body) = read_message(&mut s).await?;
        Ok((status(&head)?, body))
    };
    tokio::time::timeout_at(deadline, io)
        .await
        .map_err(|_| format!("{method} {url}: timed out"))?
}

/// Gets the current config.
pub async fn get_config(url: &str, deadline: Instant) -> Result<ClusterConfig, String> {
    match request("GET", url, "", None, deadline).await? {
        (200, body) => ClusterConfig::parse(&body),
        (code, body) => Err(format!("GET {url}: {code} {}", body.trim())),
    }
}

/// Gets version `v` of the config, if the server made it (and still
/// keeps it): the successor a recovery decided, whatever came after it.
pub async fn get_version(
    url: &str,
    v: u32,
    deadline: Instant,
) -> Result<Option<ClusterConfig>, String> {
    match request("GET", &format!("{url}/{v}"), "", None, deadline).await? {
        (200, body) => ClusterConfig::parse(&body).map(Some),
        (404, _) => Ok(None),
        (code, body) => Err(format!("GET {url}/{v}: {code} {}", body.trim())),
    }
}

/// Puts `body` (`size N` or a whole config), with the job's credential if
/// `secret` is given; the new config.
pub async fn put_config(
    url: &str,
    body: &str,
    secret: Option<&JobSecret>,
    deadline: Instant,
) -> Result<ClusterConfig, String> {
    match request("PUT", url, body, secret, deadline).await? {
        (200, body) => ClusterConfig::parse(&body),
        (code, body) => Err(format!("PUT {url}: {code} {}", body.trim())),
    }
}

/// Fuzzing: `data` as the bytes a config server reads, in reads of a
/// size the first byte picks; a request that reads is answered by a server
/// of at most 64 peers on 127.0.0.1, and the response must read back the
/// same through the client's side. Panics only on a broken invariant.
pub(crate) fn fuzz_http(data: &[u8]) {
    use std::sync::atomic::{AtomicU16, Ordering};
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let read = crate::fuzzing::ready(read_message(&mut crate::fuzzing::Chunks::new(
        rest,
        usize::from(pick) * 37 + 1,
    )));
    if let Ok((head, body)) = &read {
        assert!(head.len() <= MAX_HEAD + 4096, "head of {}", head.len());
        assert!(
            !head.contains("\r\n\r\n"),
            "the head ends at its blank line"
        );
        assert!(body.len() <= MAX_BODY, "body of {}", body.len());
    }
    let next_port = AtomicU16::new(5000);
    let (tx, _) = watch::channel(ClusterConfig {
        version: 7,
        peers: "127.0.0.1:4000,127.0.0.1:4001"
            .parse()
            .expect("a peer list"),
    });
    let state = ServerState {
        tx,
        rules: ServerRules {
            max_size: 64,
            // the credential check has its own tests; here, what follows it
            credential: None,
            hosts: Some(vec!["127.0.0.1".into()]),
            new_peer: Box::new(move |_| {
                Ok(Peer {
                    host: "127.0.0.1".into(),
                    port: next_port.fetch_add(1, Ordering::Relaxed),
                })
            }),
        },
        write: Mutex::new(Default::default()),
    };
    let (code, body) = respond(&state, read);
    let text = response(code, &body);
    let (head, back) =
        crate::fuzzing::ready(read_message(&mut text.as_bytes())).expect("a response reads back");
    assert_eq!((status(&head), back.as_str()), (Ok(code), body.as_str()));
    if code == 200 {
        let c = ClusterConfig::parse(&body).expect("a served config parses");
        assert_eq!(c, *state.tx.borrow());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    /// Up to `max_size` peers on 127.0.0.1, new ones from port 2000.
    fn rules(max_size: usize, job: Option<&JobSecret>) -> ServerRules {
        let next_port = std::sync::atomic::AtomicU16::new(2000);
        ServerRules {
            max_size,
            hosts: Some(vec!["127.0.0.1".into()]),
            new_peer: Box::new(move |_| {
                Ok(Peer {
                    host: "127.0.0.1".into(),
                    port: next_port.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                })
            }),
            credential: job.map(JobSecret::config_token),
        }
    }

    #[tokio::test]
    async fn serves_gets_and_puts_and_refuses_bad_ones() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let job = JobSecret::new(b"s3cret").unwrap();
        let initial = ClusterConfig {
            version: 0,
            peers: "127.0.0.1:1000,127.0.0.1:1001".parse().unwrap(),
        };
        let server = ConfigServer::start(l, initial.clone(), rules(4, Some(&job))).unwrap();
        let url = server.url();
        let mut rx = server.subscribe();
        assert_eq!(get_config(&url, soon()).await.unwrap(), initial);
        // changes need the job's credential: 401 without, 403 with another
        let e = put_config(&url, "size 3", None, soon()).await.unwrap_err();
        assert!(e.contains("401"), "{e}");
        let other = JobSecret::new(b"guess").unwrap();
        let e = put_config(&url, "size 3", Some(&other), soon())
            .await
            .unwrap_err();
        assert!(e.contains("403 bad credential"), "{e}");
        assert!(!rx.has_changed().unwrap(), "refused: nothing changed");
        let put = |body: &'static str| put_config(&url, body, Some(&job), soon());

        let c = put("size 3").await.unwrap();
        assert_eq!(c.version, 1);
        assert_eq!(
            c.peers.to_string(),
            "127.0.0.1:1000,127.0.0.1:1001,127.0.0.1:2000"
        );
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), c);

        let c = put("size 1").await.unwrap();
        assert_eq!(
            (c.version, c.peers.to_string()),
            (2, "127.0.0.1:1000".into())
        );
        // the size it has already: no new version
        assert_eq!(put("size 1").await.unwrap(), c);

        let whole = "version 3\npeers 127.0.0.1:7,127.0.0.1:8\n";
        assert_eq!(put(whole).await.unwrap().version, 3);
        // a stale writer loses
        let e = put(whole).await.unwrap_err();
        assert!(e.contains("409"), "{e}");
        for bad in [
            "size 0",
            "size 5",
            "size x",
            "version 4\npeers 10.0.0.1:7\n",
            "version 4\npeers 127.0.0.1:7,127.0.0.1:7,127.0.0.1:7,127.0.0.1:7,127.0.0.1:7\n",
            "version 4\n",
            "hello",
        ] {
            let e = put(bad).await.unwrap_err();
            assert!(e.contains("400"), "{bad:?}: {e}");
        }
        assert_eq!(get_config(&url, soon()).await.unwrap().version, 3);
        let (code, _) = request("POST", &url, "", None, soon()).await.unwrap();
        assert_eq!(code, 405);
        let (code, _) = request("GET", &url.replace("/cluster", "/x"), "", None, soon())
            .await
            .unwrap();
        assert_eq!(code, 404);
        // garbage and silence get an answer or a closed connection, not a hang
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        s.write_all(&[0xff; 9000]).await.unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out).await;
        assert!(out.starts_with("HTTP/1.1 400"), "{out}");
        assert!(get_config("ftp://x/cluster", soon()).await.is_err());
    }

    /// A launcher of another host sees every version in order, also those
    /// made between two of its polls, and a server that stops answering
    /// ends its watch with an error, in bounded time.
    #[tokio::test]
    async fn followers_see_every_version_and_a_lost_server() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let initial = ClusterConfig {
            version: 0,
            peers: "127.0.0.1:1000".parse().unwrap(),
        };
        let server = ConfigServer::start(l, initial, rules(8, None)).unwrap();
        let url = server.url();
        let mut local = server.versions(0);
        let mut remote = follow(
            url.clone(),
            0,
            Duration::from_millis(300),
            Duration::from_secs(1),
        );
        // three versions at once, well within one poll
        for n in [3, 2, 5] {
            put_config(&url, &format!("size {n}"), None, soon())
                .await
                .unwrap();
        }
        for rx in [&mut local, &mut remote] {
            for (v, n) in [(1, 3), (2, 2), (3, 5)] {
                let c = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap();
                assert_eq!((c.version, c.peers.len()), (v, n));
            }
        }
        // a peer outside the hosts served is refused
        let e = put_config(&url, "version 4\npeers 10.0.0.1:1", None, soon())
            .await
            .unwrap_err();
        assert!(e.contains("is not on a host of the job (127.0.0.1)"), "{e}");
        drop(server);
        let last = tokio::time::timeout(Duration::from_secs(10), remote.recv())
            .await
            .expect("the follower gives up in bounded time")
            .unwrap();
        assert!(last.unwrap_err().contains("unreachable"));
        assert!(local.recv().await.is_none(), "ends with the server");
    }
}
