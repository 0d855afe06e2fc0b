//! A thin client of etcd's v3 API through its JSON gateway (`POST
//! /v3/kv/range`, `/v3/kv/txn`, `/v3/lease/*`, `/v3/watch`; served by
//! etcd 3.4 and later on the client port), so that no protobuf compiler or
//! gRPC stack is needed for the few calls [`crate::store`] makes.
//!
//! Keys and values are base64 in the JSON, 64-bit numbers are strings and
//! zero values are left out (proto3's JSON mapping): [`num`] reads all
//! three forms. Everything read is bounded ([`MAX_BODY`]) and every call
//! has a deadline; a watch is a stream that the caller reads under its own.
//! Plain HTTP only: an etcd with TLS or authentication is not reached by
//! this client (see `docs/` and the store's docs).

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The largest response body (or watch message) accepted.
pub const MAX_BODY: usize = 16 << 20;
/// The longest response head accepted.
const MAX_HEAD: usize = 16 << 10;

/// An etcd member's client address (`host:port`).
#[derive(Clone, Debug)]
pub struct Etcd {
    addr: String,
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

/// The base64 of `s`.
pub fn b64(s: impl AsRef<[u8]>) -> String {
    B64.encode(s)
}

/// A 64-bit number of the gateway's JSON: a string, a number, or absent (0).
pub fn num(v: &Value) -> Result<i64, String> {
    match v {
        Value::Null => Ok(0),
        Value::Number(n) => n.as_i64().ok_or_else(|| format!("bad number {n}")),
        Value::String(s) => s.parse().map_err(|_| format!("bad number {s:?}")),
        other => Err(format!("not a number: {other}")),
    }
}

/// The key just after every key that starts with `prefix` (a range's end).
pub fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// A put, as a transaction's operation.
pub fn put_op(key: &str, value: &str, lease: i64) -> Value {
    let mut put = json!({"key": b64(key), "value": b64(value)});
    if lease != 0 {
        put["lease"] = json!(lease.to_string());
    }
    json!({ "request_put": put })
}

/// A range over one key, or every key with a prefix, as an operation.
pub fn range_op(key: &str, prefix: bool) -> Value {
    let mut r = json!({"key": b64(key)});
    if prefix {
        r["range_end"] = json!(b64(prefix_end(key)));
    }
    json!({ "request_range": r })
}

/// A delete of one key, or every key with a prefix, as an operation.
pub fn delete_op(key: &str, prefix: bool) -> Value {
    let mut d = json!({"key": b64(key)});
    if prefix {
        d["range_end"] = json!(b64(prefix_end(key)));
    }
    json!({ "request_delete_range": d })
}

/// A compare: `key` was last changed at revision `rev` (0: it is absent).
pub fn same_mod(key: &str, rev: i64) -> Value {
    json!({"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": rev.to_string()})
}

fn kvs(v: &Value) -> Result<Vec<Kv>, String> {
    let Some(list) = v.get("kvs") else {
        return Ok(Vec::new());
    };
    let list = list.as_array().ok_or("kvs is not a list")?;
    list.iter().map(|kv| kv_of(kv, false)).collect()
}

/// What an error of the gateway says: a string, or an object's message
/// (`{"error": {"message": ...}}`, as streams report), or the JSON.
fn error_text(e: &Value) -> String {
    match e {
        Value::String(s) => s.clone(),
        other => match other.get("message").and_then(Value::as_str) {
            Some(m) => m.to_string(),
            None => other.to_string(),
        },
    }
}

fn kv_of(kv: &Value, deleted: bool) -> Result<Kv, String> {
    let field = |name: &str| -> Result<Vec<u8>, String> {
        match kv.get(name) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => B64
                .decode(s)
                .map_err(|e| format!("{name} is not base64: {e}")),
            Some(other) => Err(format!("{name} is not a string: {other}")),
        }
    };
    let key = String::from_utf8(field("key")?).map_err(|_| "a key is not UTF-8".to_string())?;
    Ok(Kv {
        key,
        value: field("value")?,
        mod_revision: num(kv.get("mod_revision").unwrap_or(&Value::Null))?,
        deleted,
    })
}

fn revision(v: &Value) -> Result<i64, String> {
    num(v.pointer("/header/revision").unwrap_or(&Value::Null))
}

impl Etcd {
    /// The member at `addr` (`host:port`).
    pub fn new(addr: impl Into<String>) -> Etcd {
        Etcd { addr: addr.into() }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// One unary call: the response's JSON, or the error etcd gave.
    pub async fn call(&self, path: &str, body: &Value, deadline: Instant) -> Result<Value, String> {
        let what = format!("etcd {} {path}", self.addr);
        let io = async {
            let mut conn = Conn::open(&self.addr, path, body).await?;
            let code = conn.head().await?;
            let body = conn.body().await?;
            let v: Value =
                serde_json::from_slice(&body).map_err(|e| format!("{code}: not JSON ({e})"))?;
            match v.get("error").or_else(|| v.get("message")) {
                Some(e) => Err(format!("{code}: {}", error_text(e))),
                None if code != 200 => Err(format!("status {code}")),
                None => Ok(v),
            }
        };
        tokio::time::timeout_at(deadline, io)
            .await
            .map_err(|_| format!("{what}: timed out"))?
            .map_err(|e| format!("{what}: {e}"))
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
            let mut conn = Conn::open(&self.addr, "/v3/watch", &body).await?;
            match conn.head().await? {
                200 if conn.chunked => Ok(conn),
                200 => Err("the watch is not a chunked stream".to_string()),
                code => Err(format!("status {code}")),
            }
        };
        let conn = tokio::time::timeout_at(deadline, open)
            .await
            .map_err(|_| format!("{what}: timed out"))?
            .map_err(|e| format!("{what}: {e}"))?;
        Ok(Watch {
            conn,
            lines: Vec::new(),
            what,
        })
    }
}

/// A watch's stream of changes.
pub struct Watch {
    conn: Conn,
    /// Bytes of the stream not yet split into messages.
    lines: Vec<u8>,
    what: String,
}

impl Watch {
    /// The next changes (in revision order), waiting until `deadline`:
    /// `Ok(None)` when it passes with none; an error when the stream ends
    /// or etcd cancels the watch (a compacted start revision).
    pub async fn next(&mut self, deadline: Instant) -> Result<Option<Vec<Kv>>, String> {
        loop {
            if let Some(i) = self.lines.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.lines.drain(..=i).collect();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let v: Value = serde_json::from_slice(&line)
                    .map_err(|e| format!("{}: a message is not JSON ({e})", self.what))?;
                if let Some(e) = v.get("error") {
                    return Err(format!("{}: {}", self.what, error_text(e)));
                }
                let r = v.get("result").unwrap_or(&v);
                if r.get("canceled").and_then(Value::as_bool) == Some(true) {
                    let why = match (
                        r.get("cancel_reason").and_then(Value::as_str),
                        r.get("compact_revision"),
                    ) {
                        (Some(why), _) => why.to_string(),
                        (None, Some(rev)) => {
                            format!("compacted to revision {}", num(rev).unwrap_or(0))
                        }
                        (None, None) => "no reason given".into(),
                    };
                    return Err(format!("{}: canceled by etcd ({why})", self.what));
                }
                let mut out = Vec::new();
                for ev in r
                    .get("events")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let deleted = ev.get("type").and_then(Value::as_str) == Some("DELETE");
                    let kv = ev.get("kv").ok_or("an event without kv")?;
                    out.push(kv_of(kv, deleted).map_err(|e| format!("{}: {e}", self.what))?);
                }
                if !out.is_empty() {
                    return Ok(Some(out));
                }
                continue;
            }
            if self.lines.len() > MAX_BODY {
                return Err(format!("{}: a message over {MAX_BODY} bytes", self.what));
            }
            match tokio::time::timeout_at(deadline, self.conn.chunk()).await {
                Err(_) => return Ok(None),
                Ok(Ok(Some(c))) => self.lines.extend_from_slice(&c),
                Ok(Ok(None)) => return Err(format!("{}: the stream ended", self.what)),
                Ok(Err(e)) => return Err(format!("{}: {e}", self.what)),
            }
        }
    }
}

/// One HTTP/1.1 request's connection, and what of its response was read.
struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
    chunked: bool,
    length: Option<usize>,
}

impl Conn {
    async fn open(addr: &str, path: &str, body: &Value) -> Result<Conn, String> {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let body = body.to_string();
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        Ok(Conn {
            s,
            buf: Vec::new(),
            chunked: false,
            length: None,
        })
    }

    /// More bytes into `buf`; an error at the end of the stream.
    async fn fill(&mut self) -> Result<(), String> {
        let mut chunk = [0u8; 8192];
        let n = self
            .s
            .read(&mut chunk)
            .await
            .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("closed early".into());
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    /// Reads the response head: its status code.
    async fn head(&mut self) -> Result<u16, String> {
        let end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
            if self.buf.len() > MAX_HEAD {
                return Err("response head too long".into());
            }
            self.fill().await?;
        };
        let head = String::from_utf8_lossy(&self.buf[..end]).into_owned();
        self.buf.drain(..end + 4);
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| format!("bad status line {:?}", head.lines().next()))?;
        for line in head.lines().skip(1) {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            let (k, v) = (k.trim(), v.trim());
            if k.eq_ignore_ascii_case("transfer-encoding") {
                // chunked, last, and no other coding (none is asked for)
                if !v.eq_ignore_ascii_case("chunked") {
                    return Err(format!("Transfer-Encoding {v:?}: only chunked is read"));
                }
                self.chunked = true;
            } else if k.eq_ignore_ascii_case("content-length") {
                let n: usize = v.parse().map_err(|_| format!("bad Content-Length {v:?}"))?;
                if n > MAX_BODY {
                    return Err(format!("a body of {n} bytes; at most {MAX_BODY}"));
                }
                self.length = Some(n);
            }
        }
        Ok(code)
    }

    /// The next chunk of a chunked body (`None` at its end).
    async fn chunk(&mut self) -> Result<Option<Vec<u8>>, String> {
        let line_end = loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                break i;
            }
            if self.buf.len() > 64 {
                return Err("bad chunk size line".into());
            }
            self.fill().await?;
        };
        let size = std::str::from_utf8(&self.buf[..line_end])
            .ok()
            .and_then(|l| usize::from_str_radix(l.split(';').next()?.trim(), 16).ok())
            .ok_or("bad chunk size")?;
        if size > MAX_BODY {
            return Err(format!("a chunk of {size} bytes; at most {MAX_BODY}"));
        }
        if size == 0 {
            // the last chunk: trailer lines, if any, up to an empty one
            self.buf.drain(..line_end + 2);
            loop {
                match self.buf.windows(2).position(|w| w == b"\r\n") {
                    Some(0) => {
                        self.buf.drain(..2);
                        return Ok(None);
                    }
                    Some(i) => {
                        self.buf.drain(..i + 2);
                    }
                    None if self.buf.len() > MAX_HEAD => return Err("trailers too long".into()),
                    None => self.fill().await?,
                }
            }
        }
        while self.buf.len() < line_end + 2 + size + 2 {
            self.fill().await?;
        }
        let data = self.buf[line_end + 2..line_end + 2 + size].to_vec();
        if &self.buf[line_end + 2 + size..line_end + 4 + size] != b"\r\n" {
            return Err("a chunk not ended by CRLF".into());
        }
        self.buf.drain(..line_end + 4 + size);
        Ok(Some(data))
    }

    /// The whole body, of whatever framing.
    async fn body(&mut self) -> Result<Vec<u8>, String> {
        if self.chunked {
            let mut all = Vec::new();
            while let Some(c) = self.chunk().await? {
                all.extend_from_slice(&c);
                if all.len() > MAX_BODY {
                    return Err(format!("a body over {MAX_BODY} bytes"));
                }
            }
            return Ok(all);
        }
        match self.length {
            Some(n) => {
                while self.buf.len() < n {
                    self.fill().await?;
                }
                Ok(self.buf[..n].to_vec())
            }
            None => {
                // to the end of the connection
                loop {
                    if self.buf.len() > MAX_BODY {
                        return Err(format!("a body over {MAX_BODY} bytes"));
                    }
                    let mut chunk = [0u8; 8192];
                    match self.s.read(&mut chunk).await {
                        Ok(0) => return Ok(std::mem::take(&mut self.buf)),
                        Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                        Err(e) => return Err(format!("read: {e}")),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_prefixes_and_values() {
        assert_eq!(num(&json!("42")).unwrap(), 42);
        assert_eq!(num(&json!(7)).unwrap(), 7);
        assert_eq!(num(&Value::Null).unwrap(), 0);
        assert!(num(&json!("x")).is_err());
        assert!(num(&json!([1])).is_err());
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
        let kv = kv_of(
            &json!({"key": b64("/k"), "value": b64("v"), "mod_revision": "3"}),
            false,
        );
        assert_eq!(kv.unwrap().mod_revision, 3);
        assert!(kv_of(&json!({"key": "!!"}), false).is_err());
        assert!(kvs(&json!({"kvs": 3})).is_err());
    }

    /// A server on the loopback that answers one request with `parts`,
    /// written apart (so that the reads split where they do).
    async fn canned(parts: Vec<Vec<u8>>) -> Etcd {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut req = [0u8; 4096];
            let _ = s.read(&mut req).await;
            for p in parts {
                if s.write_all(&p).await.is_err() {
                    return;
                }
                s.flush().await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            // held open: a reader that waits for more must time out
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        });
        Etcd::new(&addr)
    }

    fn soon() -> Instant {
        Instant::now() + std::time::Duration::from_millis(500)
    }

    #[tokio::test]
    async fn hostile_or_odd_responses_give_errors_not_panics_or_hangs() {
        let ok = |e: &str| e.to_string();
        // chunked, a chunk extension, a body split inside a chunk, trailers
        let e = canned(vec![
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n7;x=y\r\n{\"a\"".to_vec(),
            b":1}\r\n0\r\nX-T: 1\r\n\r\n".to_vec(),
        ])
        .await;
        let v = e
            .call("/v3/kv/range", &json!({}), soon())
            .await
            .map_err(|e| ok(&e));
        assert_eq!(v.unwrap(), json!({"a": 1}));
        let cases: Vec<(&[u8], &str)> = vec![
            (b"garbage\r\n\r\n", "bad status line"),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n", "at most"),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "only chunked"),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX", "CRLF"),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{\"a", "timed out"),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnope", "not JSON"),
            (
                b"HTTP/1.1 503 x\r\nContent-Length: 33\r\n\r\n{\"error\":{\"message\":\"no leader\"}}",
                "no leader",
            ),
            (b"HTTP/1.1 200 OK\r\n", "timed out"),
        ];
        for (reply, want) in cases {
            let e = canned(vec![reply.to_vec()]).await;
            let err = e
                .call("/v3/kv/range", &json!({}), soon())
                .await
                .unwrap_err();
            assert!(err.contains(want), "{want:?} not in {err:?}");
        }
        // a watch: one message split across chunks, then a cancel
        let chunk = |m: &str| format!("{:x}\r\n{m}\r\n", m.len()).into_bytes();
        let e = canned(vec![
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(),
            chunk("{\"result\":{\"created\":true}}\n"),
            chunk("{\"result\":{\"events"),
            chunk("\":[{\"kv\":{\"key\":\"L2s=\",\"value\":\"\"}}]}}\n"),
            chunk("{\"result\":{\"canceled\":true,\"compact_revision\":\"9\"}}\n"),
        ])
        .await;
        let mut w = e.watch("/k", 1, soon()).await.unwrap();
        let kvs = w.next(soon()).await.unwrap().unwrap();
        assert_eq!(kvs[0].key, "/k");
        let err = w.next(soon()).await.unwrap_err();
        assert!(err.contains("compacted to revision 9"), "{err}");
    }
}
