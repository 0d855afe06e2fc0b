//! A thin client of etcd's v3 API through its JSON gateway (`POST
//! /v3/kv/range`, `/v3/kv/txn`, `/v3/lease/*`, `/v3/watch`; served by
//! etcd 3.4 and later on the client port), so that no protobuf compiler or
//! gRPC stack is needed for the few calls [`crate::store`] makes.
//!
//! Keys and values are base64 in the JSON, 64-bit numbers are strings and
//! zero values are left out (proto3's JSON mapping): [`num`] reads all
//! three forms. Everything read is bounded ([`MAX_BODY`]) and every call
//! has a deadline; a watch is a stream that the caller reads under its own.
//! Several members may be given (`host:port,host:port`): a call goes to
//! the one that answered last and passes over one it cannot reach or that
//! has no leader.
//!
//! HTTP, or HTTPS with the CA, client certificate and etcd user that
//! [`Access`] reads from the environment ([`access`]); a user's token is
//! asked for when first needed and again when etcd says it expired.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::time::Instant;

pub mod access;
mod http;
mod json;
mod watch;

pub use access::Access;
use access::{Auth, Tls};
use http::{Conn, Pool};
pub use json::{b64, delete_op, num, prefix_end, put_op, range_op, same_mod};
use json::{error_text, kvs, revision};
pub use watch::Watch;

/// The largest response body (or watch message) accepted.
pub const MAX_BODY: usize = 16 << 20;
/// The longest response head accepted.
const MAX_HEAD: usize = 16 << 10;

/// The login call.
const AUTHENTICATE: &str = "/v3/auth/authenticate";

/// What etcd says of a token it no longer takes (expired, or etcd
/// restarted; or issued before users or roles changed): the client
/// authenticates again and retries once.
const STALE_TOKEN: [&str; 2] = ["invalid auth token", "revision of auth store is old"];

/// What etcd answers of a request it did not take: the member has no
/// leader (it is asked to refuse then: every request says
/// `Grpc-Metadata-Hasleader: true`), or the proposal was dropped.
pub const NOT_TAKEN: [&str; 2] = ["etcdserver: no leader", "raft proposal dropped"];
/// What etcd answers of a request whose fate it does not know (the leader
/// changed under it, or it took too long): a read may simply be asked
/// again; a write may or may not have been made, which only a read says.
pub const UNDECIDED: [&str; 2] = [
    "etcdserver: leader changed",
    "etcdserver: request timed out",
];

/// The pause between rounds of members that all refused (see [`NOT_TAKEN`]).
const ELECTION_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// How long connecting to one member may take before the next is tried.
const CONNECT_EACH: std::time::Duration = std::time::Duration::from_secs(3);

/// An etcd cluster's client addresses (`host:port,host:port,...`), and
/// how they are reached. A request goes to the member that answered last;
/// one that cannot be reached (connect, TLS or the request's write fail,
/// so etcd saw no whole request) is passed over for the next.
#[derive(Clone)]
pub struct Etcd {
    addr: String,
    members: Arc<[Member]>,
    current: Arc<AtomicUsize>,
    auth: Option<Arc<Auth>>,
}

struct Member {
    addr: String,
    tls: Option<Tls>,
    /// Its idle connections, kept for the next calls.
    pool: Pool,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the password or a token
        f.debug_struct("Etcd")
            .field("addr", &self.addr)
            .field("tls", &self.is_tls())
            .field("user", &self.auth.as_ref().map(|a| &a.user))
            .finish()
    }
}

/// One key and its value, as a range or a watch reads them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: i64,
    /// Whether a watch saw it deleted (or its lease expire).
    pub deleted: bool,
}

/// A transaction's outcome.
#[derive(Debug)]
pub struct TxnResult {
    pub succeeded: bool,
    /// The store's revision after it.
    pub revision: i64,
    /// The keys each range of the branch taken read, in order.
    pub ranges: Vec<Vec<Kv>>,
}

/// Checks a list of members, `host:port[,host:port...]`: each with a
/// host, a port of 1..=65535 and no white space.
pub fn check_members(addr: &str) -> Result<(), String> {
    for m in addr.split(',') {
        let ok = !m.contains(char::is_whitespace)
            && m.rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !ok {
            return Err(format!("{m:?} is not an etcd member's HOST:PORT"));
        }
    }
    Ok(())
}

impl Etcd {
    /// The members at `addr` (`host:port`, several with commas), over
    /// plain HTTP as nobody.
    pub fn new(addr: impl Into<String>) -> Etcd {
        Etcd::with_access(addr, &Access::default()).expect("plain HTTP needs nothing")
    }

    /// The members at `addr`, reached as `access` says.
    pub fn with_access(addr: impl Into<String>, access: &Access) -> Result<Etcd, String> {
        let addr = addr.into();
        let members = addr
            .split(',')
            .map(|a| {
                let tls = access.tls_for(a).map_err(|e| format!("etcd {a}: {e}"))?;
                Ok(Member {
                    addr: a.to_string(),
                    tls,
                    pool: Pool::default(),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Etcd {
            members: members.into(),
            current: Arc::new(AtomicUsize::new(0)),
            auth: access.auth(),
            addr,
        })
    }

    /// The members' addresses, as given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Whether it is reached over TLS.
    pub fn is_tls(&self) -> bool {
        self.members.iter().any(|m| m.tls.is_some())
    }

    /// Sends the request to member `*at`, or the next that can be reached
    /// (each given its share of the time to `deadline`, at most
    /// [`CONNECT_EACH`]); `*at` becomes the member that took it. A member
    /// passed over is passed over by later calls too. The request goes on
    /// a kept connection to the member if it has one (unless `fresh`),
    /// else on a new one.
    async fn send(
        &self,
        path: &str,
        body: &Value,
        token: Option<&str>,
        deadline: Instant,
        at: &mut usize,
        fresh: bool,
    ) -> Result<Conn, String> {
        let n = self.members.len();
        let mut errors = Vec::new();
        for i in 0..n {
            let k = (*at + i) % n;
            let m = &self.members[k];
            if let Some(mut conn) = m.pool.take().filter(|_| !fresh) {
                // a failed write on a kept one: the member closed it; a
                // new connection is tried
                if conn.send(&m.addr, path, body, token).await.is_ok() {
                    *at = k;
                    self.current.store(k, Ordering::Relaxed);
                    return Ok(conn);
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let each = CONNECT_EACH.min(left / (n - i) as u32);
            let open = async {
                let mut conn = Conn::connect(&m.addr, m.tls.as_ref()).await?;
                conn.send(&m.addr, path, body, token).await?;
                Ok::<_, String>(conn)
            };
            match tokio::time::timeout(each, open).await {
                Ok(Ok(conn)) => {
                    *at = k;
                    self.current.store(k, Ordering::Relaxed);
                    return Ok(conn);
                }
                Ok(Err(e)) => errors.push(format!("{}: {e}", m.addr)),
                Err(_) => errors.push(format!("{}: no connection in {each:?}", m.addr)),
            }
            self.pass_over(k);
        }
        Err(match n {
            1 => errors.pop().unwrap_or_default(),
            _ => format!("no member reached ({})", errors.join("; ")),
        })
    }

    /// Later calls start after member `k`, unless another call moved on
    /// already.
    fn pass_over(&self, k: usize) {
        let next = (k + 1) % self.members.len();
        let _ = self
            .current
            .compare_exchange(k, next, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// One unary call: the response's JSON, or the error etcd gave.
    /// A member without a leader is passed over for the next (the request
    /// went nowhere); so is one that could not finish a read, which reads
    /// (range, a transaction of ranges only, a lease's keepalive) are
    /// asked again of.
    pub async fn call(&self, path: &str, body: &Value, deadline: Instant) -> Result<Value, String> {
        let writes = |ops: Option<&Value>| {
            ops.and_then(Value::as_array)
                .is_some_and(|ops| ops.iter().any(|op| op.get("request_range").is_none()))
        };
        let read = match path {
            "/v3/kv/range" | "/v3/lease/keepalive" => true,
            "/v3/kv/txn" => !(writes(body.get("success")) || writes(body.get("failure"))),
            _ => false,
        };
        let what = format!("etcd {} {path}", self.addr);
        let io = async {
            // after a round of them all, again a little later, while the
            // deadline allows
            let n = self.members.len();
            let mut at = self.current.load(Ordering::Relaxed);
            let mut asked = 0;
            loop {
                match self.authed(path, body, read, deadline, &mut at).await {
                    Err(e)
                        if NOT_TAKEN.iter().any(|s| e.contains(s))
                            || (read && UNDECIDED.iter().any(|s| e.contains(s))) =>
                    {
                        self.pass_over(at);
                        at = (at + 1) % n;
                        asked += 1;
                        if asked % n == 0 {
                            let later = Instant::now() + ELECTION_PAUSE;
                            if later >= deadline {
                                return Err(e);
                            }
                            tokio::time::sleep_until(later).await;
                        }
                    }
                    r => return r,
                }
            }
        };
        tokio::time::timeout_at(deadline, io)
            .await
            .map_err(|_| format!("{what}: timed out"))?
            .map_err(|e| format!("{what}: {e}"))
    }

    /// One request as the user, if any: again with a new token if etcd
    /// refused the one it had.
    async fn authed(
        &self,
        path: &str,
        body: &Value,
        read: bool,
        deadline: Instant,
        at: &mut usize,
    ) -> Result<Value, String> {
        let token = self.token(deadline).await?;
        match self
            .once(path, body, token.as_deref(), read, deadline, at)
            .await
        {
            Err(e) if token.is_some() && STALE_TOKEN.iter().any(|s| e.contains(s)) => {
                self.forget(token.as_deref());
                let token = self.token(deadline).await?;
                self.once(path, body, token.as_deref(), read, deadline, at)
                    .await
            }
            r => r,
        }
    }

    /// One request. A `read` (one that may be asked twice) that went on a
    /// kept connection the member had closed, unanswered, is sent again on
    /// a new one; a write is not (the member may have taken it just before
    /// it closed), as with any connection that drops.
    async fn once(
        &self,
        path: &str,
        body: &Value,
        token: Option<&str>,
        read: bool,
        deadline: Instant,
        at: &mut usize,
    ) -> Result<Value, String> {
        let mut conn = self.send(path, body, token, deadline, at, false).await?;
        let (code, body) = match Self::answer(&mut conn).await {
            Err(_) if read && conn.closed_unanswered() => {
                conn = self.send(path, body, token, deadline, at, true).await?;
                Self::answer(&mut conn).await?
            }
            r => r?,
        };
        self.members[*at].pool.give(conn);
        let v: Value = serde_json::from_slice(&body).map_err(|e| {
            // what etcd said instead (a proxy's or the gateway's text), but
            // never of a login, whose body may hold a token
            let start = match path == AUTHENTICATE {
                true => String::new(),
                false => String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned(),
            };
            format!("{code}: not JSON ({e}): {start:?}")
        })?;
        match v.get("error").or_else(|| v.get("message")) {
            Some(e) => Err(format!("{code}: {}", error_text(e))),
            None if code != 200 => Err(format!("status {code}")),
            None => Ok(v),
        }
    }

    /// A response's status code and body.
    async fn answer(conn: &mut Conn) -> Result<(u16, Vec<u8>), String> {
        let code = conn.head().await?;
        Ok((code, conn.body().await?))
    }

    /// The user's token: the one etcd gave last, or a new one. `None`
    /// without a user.
    async fn token(&self, deadline: Instant) -> Result<Option<String>, String> {
        let Some(auth) = &self.auth else {
            return Ok(None);
        };
        if let Some(t) = auth.token.lock().unwrap().clone() {
            return Ok(Some(t));
        }
        let body = json!({"name": auth.user, "password": auth.password});
        let mut at = self.current.load(Ordering::Relaxed);
        let v = self
            .once(AUTHENTICATE, &body, None, true, deadline, &mut at)
            .await
            .map_err(|e| format!("authenticating as {:?}: {e}", auth.user))?;
        let token = v
            .get("token")
            .and_then(Value::as_str)
            // it goes into a header line
            .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| format!("authenticating as {:?}: no usable token", auth.user))?
            .to_string();
        auth.logged_in(&token);
        Ok(Some(token))
    }

    /// Drops `token` (etcd refused it), unless another call replaced it.
    fn forget(&self, token: Option<&str>) {
        if let Some(auth) = &self.auth {
            let mut t = auth.token.lock().unwrap();
            if t.as_deref() == token {
                *t = None;
            }
        }
    }

    /// A transaction: if every compare holds, `success`, else `failure`.
    pub async fn txn(
        &self,
        compare: Vec<Value>,
        success: Vec<Value>,
        failure: Vec<Value>,
        deadline: Instant,
    ) -> Result<TxnResult, String> {
        let body = json!({"compare": compare, "success": success, "failure": failure});
        let v = self.call("/v3/kv/txn", &body, deadline).await?;
        let mut ranges = Vec::new();
        for r in v
            .get("responses")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(range) = r.get("response_range") {
                ranges.push(kvs(range)?);
            }
        }
        Ok(TxnResult {
            succeeded: v.get("succeeded").and_then(Value::as_bool).unwrap_or(false),
            revision: revision(&v)?,
            ranges,
        })
    }

    /// The keys with `prefix` (or the one key), and the revision read at.
    pub async fn range(
        &self,
        key: &str,
        prefix: bool,
        deadline: Instant,
    ) -> Result<(Vec<Kv>, i64), String> {
        let body = &range_op(key, prefix)["request_range"];
        let v = self.call("/v3/kv/range", body, deadline).await?;
        Ok((kvs(&v)?, revision(&v)?))
    }

    /// A new lease of `ttl` seconds; its id.
    pub async fn grant(&self, ttl: i64, deadline: Instant) -> Result<i64, String> {
        let v = self
            .call("/v3/lease/grant", &json!({"TTL": ttl}), deadline)
            .await?;
        match num(v.get("ID").unwrap_or(&Value::Null))? {
            0 => Err(format!("etcd {}: granted no lease", self.addr)),
            id => Ok(id),
        }
    }

    /// Renews lease `id`; its remaining TTL (0 or less: it has expired).
    pub async fn keepalive(&self, id: i64, deadline: Instant) -> Result<i64, String> {
        let v = self
            .call(
                "/v3/lease/keepalive",
                &json!({"ID": id.to_string()}),
                deadline,
            )
            .await?;
        let r = v.get("result").unwrap_or(&v);
        num(r.get("TTL").unwrap_or(&Value::Null))
    }

    /// Ends lease `id` now: its keys go.
    pub async fn revoke(&self, id: i64, deadline: Instant) -> Result<(), String> {
        self.call("/v3/lease/revoke", &json!({"ID": id.to_string()}), deadline)
            .await
            .map(|_| ())
    }

    /// Watches every key with `prefix` from revision `from`.
    pub async fn watch(&self, prefix: &str, from: i64, deadline: Instant) -> Result<Watch, String> {
        let body = json!({"create_request": {
            "key": b64(prefix),
            "range_end": b64(prefix_end(prefix)),
            "start_revision": from.to_string(),
        }});
        let what = format!("etcd {} watch {prefix}", self.addr);
        let open = async {
            let token = self.token(deadline).await?;
            let mut at = self.current.load(Ordering::Relaxed);
            let mut conn = self
                .send(
                    "/v3/watch",
                    &body,
                    token.as_deref(),
                    deadline,
                    &mut at,
                    true,
                )
                .await?;
            match conn.head().await? {
                200 if conn.chunked => Ok((conn, token)),
                200 => Err("the watch is not a chunked stream".to_string()),
                code => Err(format!("status {code}")),
            }
        };
        let (conn, token) = tokio::time::timeout_at(deadline, open)
            .await
            .map_err(|_| format!("{what}: timed out"))?
            .map_err(|e| format!("{what}: {e}"))?;
        Ok(Watch::new(conn, what, self.clone(), token))
    }
}

/// Fuzzing: `data` (after its first byte) as the bytes of an etcd
/// response, read whole and read in pieces of a size the first byte picks;
/// its body as a unary call's JSON and as a watch's stream of messages.
/// Panics only on a broken invariant: the pieces read as the whole does,
/// and nothing is over its bound.
pub(crate) fn fuzz_response(data: &[u8]) {
    use crate::fuzzing::{ready, Chunks};
    use crate::http::{codec, Limits, Reader};
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let limits = Limits {
        head: MAX_HEAD,
        body: MAX_BODY,
    };
    let whole = codec::whole_response(rest, &limits);
    let mut r = Reader::new(Chunks::new(rest, usize::from(pick) * 37 + 1), limits);
    let pieces = ready(async {
        let head = r.response_head().await?;
        let body = r.body(head.framing).await?;
        Ok::<_, String>((head, body))
    });
    match (&whole, &pieces) {
        (Ok(w), Ok(p)) => assert_eq!(w, p, "read whole and in pieces"),
        (Err(_), Err(_)) => {}
        _ => panic!("whole: {whole:?}, in pieces: {pieces:?}"),
    }
    let Ok((_, body)) = whole else {
        return;
    };
    assert!(body.len() <= MAX_BODY, "a body of {}", body.len());
    if let Ok(v) = serde_json::from_slice::<Value>(&body) {
        let _ = kvs(&v);
        let _ = revision(&v);
        if let Some(e) = v.get("error") {
            let _ = error_text(e);
        }
    }
    for line in body.split(|&b| b == b'\n') {
        if let Ok(Some(changes)) = watch::message(line) {
            assert!(!changes.is_empty());
        }
    }
}

#[cfg(test)]
mod tests;
