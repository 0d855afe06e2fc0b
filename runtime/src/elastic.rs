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

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kungfu_topology::{Peer, PeerList};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
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
    /// If set, every peer must be on this host (a launcher that starts
    /// workers only here).
    pub only_host: Option<String>,
    /// Makes the address of a new peer when `size N` grows the cluster;
    /// given the peers so far.
    pub new_peer: NewPeer,
}

/// A running config server.
pub struct ConfigServer {
    addr: SocketAddr,
    rx: watch::Receiver<ClusterConfig>,
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
        let state = Arc::new(ServerState {
            tx,
            rules,
            write: Mutex::new(()),
        });
        let task = tokio::spawn(async move {
            loop {
                let Ok((s, _)) = listener.accept().await else {
                    continue;
                };
                let state = state.clone();
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(REQUEST_TIMEOUT, serve_one(s, &state)).await;
                });
            }
        });
        Ok(ConfigServer { addr, rx, task })
    }

    /// The URL workers get (`KUNGFU_CONFIG_SERVER`).
    pub fn url(&self) -> String {
        format!("http://{}/cluster", self.addr)
    }

    /// The current config, and each new one as it is put.
    pub fn subscribe(&self) -> watch::Receiver<ClusterConfig> {
        self.rx.clone()
    }
}

struct ServerState {
    tx: watch::Sender<ClusterConfig>,
    rules: ServerRules,
    /// Serialises puts (check and replace as one step).
    write: Mutex<()>,
}

impl ServerState {
    fn put(&self, body: &str) -> Result<ClusterConfig, (u16, String)> {
        let _w = self.write.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.tx.borrow().clone();
        let bad = |why: String| (400, why);
        let next_version = cur
            .version
            .checked_add(1)
            .ok_or_else(|| bad("the version cannot grow further".into()))?;
        let body = body.trim();
        let next = if let Some(n) = body.strip_prefix("size ") {
            let n: usize = n
                .trim()
                .parse()
                .map_err(|_| bad(format!("bad size {n:?}")))?;
            if n == 0 || n > self.rules.max_size {
                return Err(bad(format!(
                    "size {n} is outside 1..={}",
                    self.rules.max_size
                )));
            }
            let mut peers: Vec<Peer> = cur.peers.peers().iter().take(n).cloned().collect();
            while peers.len() < n {
                let p = (self.rules.new_peer)(&peers).map_err(|e| (503, e))?;
                peers.push(p);
            }
            ClusterConfig {
                version: next_version,
                peers: PeerList::new(peers).map_err(|e| bad(e.to_string()))?,
            }
        } else {
            let c = ClusterConfig::parse(body).map_err(bad)?;
            if c.version != next_version {
                return Err((
                    409,
                    format!(
                        "version {} given; the next version is {next_version}",
                        c.version
                    ),
                ));
            }
            if c.peers.len() > self.rules.max_size {
                return Err(bad(format!(
                    "{} peers; at most {}",
                    c.peers.len(),
                    self.rules.max_size
                )));
            }
            c
        };
        if let Some(h) = &self.rules.only_host {
            if let Some(p) = next.peers.peers().iter().find(|p| &p.host != h) {
                return Err(bad(format!("{p} is not on {h}, the only host served")));
            }
        }
        self.tx.send_replace(next.clone());
        Ok(next)
    }
}

async fn serve_one(mut s: TcpStream, state: &ServerState) -> std::io::Result<()> {
    let (code, body) = match read_message(&mut s).await {
        Err(why) => (400, why),
        Ok((head, body)) => {
            let line = head.lines().next().unwrap_or_default();
            let mut parts = line.split_whitespace();
            match (parts.next(), parts.next()) {
                (Some("GET"), Some("/cluster")) => (200, state.tx.borrow().encode()),
                (Some("PUT"), Some("/cluster")) => match state.put(&body) {
                    Ok(c) => (200, c.encode()),
                    Err((code, why)) => (code, format!("{why}\n")),
                },
                (Some(_), Some("/cluster")) => (405, "GET or PUT\n".into()),
                _ => (404, "only /cluster is served\n".into()),
            }
        }
    };
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        _ => "Service Unavailable",
    };
    let msg = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(msg.as_bytes()).await?;
    s.shutdown().await
}

/// Reads one HTTP message: the head (up to the blank line) and a body of
/// `Content-Length` bytes (none if absent), both bounded.
async fn read_message(s: &mut TcpStream) -> Result<(String, String), String> {
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

/// One HTTP request to the config server; the status code and the body.
pub async fn request(
    method: &str,
    url: &str,
    body: &str,
    deadline: Instant,
) -> Result<(u16, String), String> {
    let (addr, path) = split_url(url)?;
    let io = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect to {addr}: {e}"))?;
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let (head, body) = read_message(&mut s).await?;
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| format!("bad status line {:?}", head.lines().next()))?;
        Ok((code, body))
    };
    tokio::time::timeout_at(deadline, io)
        .await
        .map_err(|_| format!("{method} {url}: timed out"))?
}

/// Gets the current config.
pub async fn get_config(url: &str, deadline: Instant) -> Result<ClusterConfig, String> {
    match request("GET", url, "", deadline).await? {
        (200, body) => ClusterConfig::parse(&body),
        (code, body) => Err(format!("GET {url}: {code} {}", body.trim())),
    }
}

/// Puts `body` (`size N` or a whole config); the new config.
pub async fn put_config(url: &str, body: &str, deadline: Instant) -> Result<ClusterConfig, String> {
    match request("PUT", url, body, deadline).await? {
        (200, body) => ClusterConfig::parse(&body),
        (code, body) => Err(format!("PUT {url}: {code} {}", body.trim())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[tokio::test]
    async fn serves_gets_and_puts_and_refuses_bad_ones() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let initial = ClusterConfig {
            version: 0,
            peers: "127.0.0.1:1000,127.0.0.1:1001".parse().unwrap(),
        };
        let next_port = std::sync::atomic::AtomicU16::new(2000);
        let server = ConfigServer::start(
            l,
            initial.clone(),
            ServerRules {
                max_size: 4,
                only_host: Some("127.0.0.1".into()),
                new_peer: Box::new(move |_| {
                    Ok(Peer {
                        host: "127.0.0.1".into(),
                        port: next_port.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                    })
                }),
            },
        )
        .unwrap();
        let url = server.url();
        let mut rx = server.subscribe();
        assert_eq!(get_config(&url, soon()).await.unwrap(), initial);

        let c = put_config(&url, "size 3", soon()).await.unwrap();
        assert_eq!(c.version, 1);
        assert_eq!(
            c.peers.to_string(),
            "127.0.0.1:1000,127.0.0.1:1001,127.0.0.1:2000"
        );
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), c);

        let c = put_config(&url, "size 1", soon()).await.unwrap();
        assert_eq!(
            (c.version, c.peers.to_string()),
            (2, "127.0.0.1:1000".into())
        );

        let whole = "version 3\npeers 127.0.0.1:7,127.0.0.1:8\n";
        assert_eq!(put_config(&url, whole, soon()).await.unwrap().version, 3);
        // a stale writer loses
        let e = put_config(&url, whole, soon()).await.unwrap_err();
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
            let e = put_config(&url, bad, soon()).await.unwrap_err();
            assert!(e.contains("400"), "{bad:?}: {e}");
        }
        assert_eq!(get_config(&url, soon()).await.unwrap().version, 3);
        let (code, _) = request("POST", &url, "", soon()).await.unwrap();
        assert_eq!(code, 405);
        let (code, _) = request("GET", &url.replace("/cluster", "/x"), "", soon())
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
}
