//! The config server: the current config and the last `HISTORY`
//! versions behind a mutex, what it accepts ([`ServerRules`], the
//! credential), and its answer to each request.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kungfu_topology::{Peer, PeerList};
use kungfu_transport::auth::JobSecret;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use super::credential::{self, Verifier, SIGNATURE_HEADER};
use super::message::{read_request, read_response, Request, LIMITS};
use super::ClusterConfig;
use crate::store::{parse_change, Change, PutError};

/// How long the server gives a client to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// The job's secret: every request must be signed with it, and every
    /// answer is ([`super::credential`]); `None`: anyone who reaches the
    /// port may read and change the config (tests only).
    pub credential: Option<JobSecret>,
    /// Serve over TLS, with a certificate of the job's CA (derived from the
    /// credential, which it needs: see `elastic/tls.rs`); the URL is then
    /// `https://`. `kungfu-run` does across hosts, where the server's
    /// address is routable.
    pub tls: bool,
}

/// A running config server.
pub struct ConfigServer {
    pub(super) addr: SocketAddr,
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
        let acceptor = match (rules.tls, &rules.credential) {
            (false, _) => None,
            (true, None) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "a config server over TLS needs the job's secret (its CA comes from it)",
                ))
            }
            (true, Some(secret)) => Some(tokio_rustls::TlsAcceptor::from(
                super::tls::server_config(secret).map_err(std::io::Error::other)?,
            )),
        };
        let (tx, rx) = watch::channel(initial);
        let history = [tx.borrow().clone()].into();
        let state = Arc::new(ServerState {
            tx,
            verifier: rules.credential.clone().map(Verifier::new),
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
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // the TLS handshake too is within the request's time
                    let _ = tokio::time::timeout(REQUEST_TIMEOUT, async {
                        match acceptor {
                            None => serve_one(s, &state).await,
                            Some(a) => serve_one(a.accept(s).await?, &state).await,
                        }
                    })
                    .await;
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

    /// The URL workers get (`KUNGFU_CONFIG_SERVER`): `https://` over TLS.
    pub fn url(&self) -> String {
        let scheme = if self.state.rules.tls {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}/cluster", self.addr)
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
    ///
    /// [`follow`]: super::follow
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

struct ServerState {
    tx: watch::Sender<ClusterConfig>,
    rules: ServerRules,
    /// Serialises puts (check and replace as one step), and keeps the
    /// last [`HISTORY`] versions (`GET /cluster/V`).
    write: Mutex<std::collections::VecDeque<ClusterConfig>>,
    /// Checks every request, with the rules' credential.
    verifier: Option<Verifier>,
}

/// How many versions the config server keeps for `GET /cluster/V`.
pub(super) const HISTORY: usize = 64;

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

async fn serve_one<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    state: &ServerState,
) -> std::io::Result<()> {
    let (code, body, signature) = respond(state, read_request(&mut s).await, credential::now_ms());
    s.write_all(&response(code, &body, signature.as_deref()))
        .await?;
    s.shutdown().await
}

/// The server's answer to a request read by [`read_request`] (or the
/// reason it could not be read) at time `now` (unix ms): the status code,
/// the body, and the answer's signature (for a request that proved the
/// job's secret, on a server that has one).
fn respond(
    state: &ServerState,
    request: Result<Request, String>,
    now: u64,
) -> (u16, String, Option<String>) {
    let Request { head, body } = match request {
        Err(why) => return (400, why, None),
        Ok(r) => r,
    };
    let nonce = match &state.verifier {
        None => None,
        Some(v) => match v.check(
            head.authorization.as_deref(),
            &head.method,
            &head.path,
            body.as_bytes(),
            now,
        ) {
            Ok(n) => Some(n),
            Err((code, why)) => return (code, format!("{why}\n"), None),
        },
    };
    let (code, body) = match (head.method.as_str(), head.path.as_str()) {
        ("GET", "/cluster") => (200, state.tx.borrow().encode()),
        ("GET", p) if p.starts_with("/cluster/") => state.version(&p["/cluster/".len()..]),
        ("PUT", "/cluster") => match state.put(&body) {
            Ok(c) => (200, c.encode()),
            Err((code, why)) => (code, format!("{why}\n")),
        },
        (_, "/cluster") => (405, "GET or PUT\n".into()),
        _ => (404, "only /cluster is served\n".into()),
    };
    let signature = match (&state.verifier, nonce) {
        (Some(v), Some(n)) => Some(credential::answer_signature(
            v.secret(),
            &n,
            code,
            body.as_bytes(),
        )),
        _ => None,
    };
    (code, body, signature)
}

/// The whole response the server writes.
fn response(code: u16, body: &str, signature: Option<&str>) -> Vec<u8> {
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
    let mut headers = vec![("Content-Type", "text/plain")];
    if code == 401 {
        headers.push(("WWW-Authenticate", credential::SCHEME));
    }
    if let Some(s) = signature {
        headers.push((SIGNATURE_HEADER, s));
    }
    crate::http::response_bytes(code, reason, &headers, body.as_bytes())
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
    let read = crate::fuzzing::ready(read_request(crate::fuzzing::Chunks::new(
        rest,
        usize::from(pick) * 37 + 1,
    )));
    if let Ok(r) = &read {
        assert!(r.body.len() <= LIMITS.body, "body of {}", r.body.len());
        assert!(
            r.body.len() == r.head.length,
            "the body is Content-Length long"
        );
        assert!(
            !r.head.path.contains(char::is_whitespace),
            "a path without white space"
        );
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
            tls: false,
            hosts: Some(vec!["127.0.0.1".into()]),
            new_peer: Box::new(move |_| {
                Ok(Peer {
                    host: "127.0.0.1".into(),
                    port: next_port.fetch_add(1, Ordering::Relaxed),
                })
            }),
        },
        write: Mutex::new(Default::default()),
        verifier: None,
    };
    let (code, body, signature) = respond(&state, read, 1_800_000_000_000);
    assert!(signature.is_none(), "no credential, no signature");
    let text = response(code, &body, None);
    let back = crate::fuzzing::ready(read_response(&text[..])).expect("a response reads back");
    assert_eq!((back.0, back.1.as_str()), (code, body.as_str()));
    assert!(back.2.is_none());
    if code == 200 {
        let c = ClusterConfig::parse(&body).expect("a served config parses");
        assert_eq!(c, *state.tx.borrow());
    }
}
