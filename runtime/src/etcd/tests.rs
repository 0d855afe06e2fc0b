//! The etcd client's tests: the JSON mapping, kept connections, and
//! hostile or odd responses from a canned server on the loopback.

use super::json::kv_of;
use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// Calls reuse one connection while the member keeps it open; a read
/// that a kept connection dropped unanswered is sent again on a new
/// one; a kept connection the member closed is not used again.
#[tokio::test]
async fn calls_keep_their_connection_and_leave_a_closed_one() {
    use crate::http::{Framing, Limits, Reader};
    use std::sync::atomic::AtomicUsize;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    // (answers, then take one more request and close unanswered)
    tokio::spawn(async move {
        let limits = Limits {
            head: 4096,
            body: 4096,
        };
        for (answers, drop_one) in [(3, true), (1, false), (usize::MAX, false)] {
            let (s, _) = l.accept().await.unwrap();
            let at = count.fetch_add(1, Ordering::Relaxed);
            let mut r = Reader::new(s, limits);
            for n in 0..answers {
                let Ok(h) = r.request_head().await else { break };
                r.body(Framing::Length(h.length)).await.unwrap();
                let body = format!("{{\"conn\":{at},\"n\":{n}}}");
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                r.get_mut().write_all(resp.as_bytes()).await.unwrap();
            }
            if drop_one {
                let _ = r.request_head().await;
            }
        }
    });
    let e = Etcd::new(&addr);
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(e.call("/v3/kv/range", &json!({}), soon()).await.unwrap());
        // (the member's close of connection 2 arrives before the next)
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let want: Vec<Value> = [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0)]
        .iter()
        .map(|(c, n)| json!({"conn": c, "n": n}))
        .collect();
    assert_eq!(got, want);
    assert_eq!(accepted.load(Ordering::Relaxed), 3);
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
    let cases: Vec<(&[u8], &str)> =
        vec![
        (b"garbage\r\n\r\n", "bad response"),
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
