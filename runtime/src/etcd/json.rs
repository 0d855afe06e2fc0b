//! etcd's v3 API in the JSON of its gateway: keys and values are base64,
//! 64-bit numbers are strings (or numbers), and zero values are left out
//! (proto3's JSON mapping). The operations a transaction is made of, and
//! what is read out of a response.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};

use super::Kv;

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

pub(super) fn kvs(v: &Value) -> Result<Vec<Kv>, String> {
    let Some(list) = v.get("kvs") else {
        return Ok(Vec::new());
    };
    let list = list.as_array().ok_or("kvs is not a list")?;
    list.iter().map(|kv| kv_of(kv, false)).collect()
}

/// What an error of the gateway says: a string, or an object's message
/// (`{"error": {"message": ...}}`, as streams report), or the JSON.
pub(super) fn error_text(e: &Value) -> String {
    match e {
        Value::String(s) => s.clone(),
        other => match other.get("message").and_then(Value::as_str) {
            Some(m) => m.to_string(),
            None => other.to_string(),
        },
    }
}

pub(super) fn kv_of(kv: &Value, deleted: bool) -> Result<Kv, String> {
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

pub(super) fn revision(v: &Value) -> Result<i64, String> {
    num(v.pointer("/header/revision").unwrap_or(&Value::Null))
}
