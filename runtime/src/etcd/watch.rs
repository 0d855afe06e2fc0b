//! A watch: one chunked response that etcd keeps open, each of its
//! lines a JSON message of changes; read under the caller's deadline.

use serde_json::Value;
use tokio::time::Instant;

use super::http::Conn;
use super::json::{error_text, kv_of, num};
use super::{Etcd, Kv, MAX_BODY};

/// A watch's stream of changes.
pub struct Watch {
    conn: Conn,
    /// Bytes of the stream not yet split into messages.
    lines: Vec<u8>,
    what: String,
    /// Who opened it, with the token it was opened with: a watch that
    /// fails makes the next call ask for a new one.
    etcd: Etcd,
    token: Option<String>,
}

impl Watch {
    /// The next changes (in revision order), waiting until `deadline`:
    /// `Ok(None)` when it passes with none; an error when the stream ends
    /// or etcd cancels the watch (a compacted start revision).
    pub async fn next(&mut self, deadline: Instant) -> Result<Option<Vec<Kv>>, String> {
        let r = self.read_next(deadline).await;
        if r.is_err() {
            // etcd cancels a watch of an expired token as "permission
            // denied", not as an invalid token: whatever ended the watch,
            // the next call asks for a new token (one request more)
            self.etcd.forget(self.token.as_deref());
        }
        r
    }

    pub(super) fn new(conn: Conn, what: String, etcd: Etcd, token: Option<String>) -> Watch {
        Watch {
            conn,
            lines: Vec::new(),
            what,
            etcd,
            token,
        }
    }

    async fn read_next(&mut self, deadline: Instant) -> Result<Option<Vec<Kv>>, String> {
        loop {
            if let Some(i) = self.lines.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.lines.drain(..=i).collect();
                match message(&line).map_err(|e| format!("{}: {e}", self.what))? {
                    Some(changes) => return Ok(Some(changes)),
                    None => continue,
                }
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

/// One line of a watch's stream: its changes, `None` if it has none (a
/// blank line, the watch's creation, a progress notice), an error if etcd
/// says one or cancels the watch.
pub(super) fn message(line: &[u8]) -> Result<Option<Vec<Kv>>, String> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let v: Value =
        serde_json::from_slice(line).map_err(|e| format!("a message is not JSON ({e})"))?;
    if let Some(e) = v.get("error") {
        return Err(error_text(e));
    }
    let r = v.get("result").unwrap_or(&v);
    if r.get("canceled").and_then(Value::as_bool) == Some(true) {
        let why = match (
            r.get("cancel_reason").and_then(Value::as_str),
            r.get("compact_revision"),
        ) {
            (Some(why), _) => why.to_string(),
            (None, Some(rev)) => format!("compacted to revision {}", num(rev).unwrap_or(0)),
            (None, None) => "no reason given".into(),
        };
        return Err(format!("canceled by etcd ({why})"));
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
        out.push(kv_of(kv, deleted)?);
    }
    Ok(if out.is_empty() { None } else { Some(out) })
}
