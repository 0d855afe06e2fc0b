//! The one HTTP/1.1 of the crate, under the config server of `kungfu-run
//! -w`, its client ([`crate::elastic`]) and the etcd client
//! ([`crate::etcd`]): [`codec`] frames messages without I/O (heads by
//! `httparse`), [`Reader`] feeds it from a tokio stream, and
//! [`request_bytes`] and [`response_bytes`] write messages whose header
//! values are checked to hold no line break.

pub mod codec;

use tokio::io::{AsyncRead, AsyncReadExt};

pub use codec::{Body, Framing, Limits, RequestHead, ResponseHead, Step};

/// A stream and the bytes read from it that no message has taken yet.
/// Reading is cancel safe: a read cut short by a timeout loses nothing.
pub struct Reader<S> {
    s: S,
    buf: Vec<u8>,
    limits: Limits,
    eof: bool,
    /// Whether any byte was read since [`Reader::new`] or the last
    /// [`Reader::mark`] (the end of the stream is not one).
    read_any: bool,
}

impl<S> Reader<S> {
    pub fn new(s: S, limits: Limits) -> Reader<S> {
        Reader {
            s,
            buf: Vec::new(),
            limits,
            eof: false,
            read_any: false,
        }
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.s
    }

    /// Whether bytes are buffered that no message took (after a response
    /// on a connection to be used again: the peer sent more than asked).
    pub fn has_buffered(&self) -> bool {
        !self.buf.is_empty()
    }

    /// Starts counting [`Reader::read_any`] again (before a new request
    /// on a kept connection).
    pub fn mark(&mut self) {
        self.read_any = false;
    }

    /// Whether a byte came since the mark: a kept connection that the
    /// peer closed before answering has none.
    pub fn read_any(&self) -> bool {
        self.read_any
    }
}

impl<S: AsyncRead + Unpin> Reader<S> {
    /// More bytes into the buffer; at the stream's end, `eof` is set.
    async fn fill(&mut self) -> Result<(), String> {
        let mut chunk = [0u8; 8192];
        let n = self
            .s
            .read(&mut chunk)
            .await
            .map_err(|e| format!("read: {e}"))?;
        self.read_any |= n > 0;
        if n == 0 {
            self.eof = true;
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    /// The next response's head.
    pub async fn response_head(&mut self) -> Result<ResponseHead, String> {
        loop {
            if let Some((head, n)) = codec::response_head(&self.buf, &self.limits)? {
                self.buf.drain(..n);
                return Ok(head);
            }
            if self.eof {
                return Err("closed early".into());
            }
            self.fill().await?;
        }
    }

    /// The next request's head.
    pub async fn request_head(&mut self) -> Result<RequestHead, String> {
        loop {
            if let Some((head, n)) = codec::request_head(&self.buf, &self.limits)? {
                self.buf.drain(..n);
                return Ok(head);
            }
            if self.eof {
                return Err("closed before the end of the head".into());
            }
            self.fill().await?;
        }
    }

    /// The next piece of `body` (a whole chunk, or the whole body of the
    /// other framings); `None` at its end.
    pub async fn next(&mut self, body: &mut Body) -> Result<Option<Vec<u8>>, String> {
        loop {
            match body.step(&mut self.buf, self.eof)? {
                Step::Data(d) => return Ok(Some(d)),
                Step::End => return Ok(None),
                Step::More => self.fill().await?,
            }
        }
    }

    /// A whole body, every chunk joined (at most the body's bound).
    pub async fn body(&mut self, framing: Framing) -> Result<Vec<u8>, String> {
        let mut body = Body::new(framing, self.limits);
        let mut all = Vec::new();
        while let Some(d) = self.next(&mut body).await? {
            all.extend_from_slice(&d);
        }
        Ok(all)
    }
}

/// The bytes of a request with a `Content-Length` body. A header value
/// with a line break in it is refused (it would start another header).
pub fn request_bytes(
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Vec<u8>, String> {
    if path
        .bytes()
        .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err(format!(
            "a request path with a space or control byte: {path:?}"
        ));
    }
    message(format!("{method} {path} HTTP/1.1\r\n"), headers, body)
}

/// The bytes of a response with a `Content-Length` body, closing the
/// connection after it. The headers are the server's own: one with a line
/// break (a bug) makes it a bare 500.
pub fn response_bytes(code: u16, reason: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut all = headers.to_vec();
    all.push(("Connection", "close"));
    message(format!("HTTP/1.1 {code} {reason}\r\n"), &all, body).unwrap_or_else(|e| {
        debug_assert!(false, "{e}");
        b"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
            .to_vec()
    })
}

fn message(start: String, headers: &[(&str, &str)], body: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = start.into_bytes();
    for (k, v) in headers {
        if k.bytes().chain(v.bytes()).any(|b| b == b'\r' || b == b'\n') {
            return Err(format!("header {k} with a line break"));
        }
        out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    out.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        head: 1024,
        body: 4096,
    };

    #[tokio::test]
    async fn a_kept_connection_reads_message_after_message() {
        let two = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\naHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nb\r\n0\r\n\r\n";
        let mut r = Reader::new(&two[..], L);
        let h = r.response_head().await.unwrap();
        assert_eq!(r.body(h.framing).await.unwrap(), b"a");
        let h = r.response_head().await.unwrap();
        assert_eq!(h.code, 201);
        assert_eq!(r.body(h.framing).await.unwrap(), b"b");
        assert!(!r.has_buffered());
        assert_eq!(r.response_head().await.unwrap_err(), "closed early");
    }

    #[test]
    fn written_messages_read_back_and_line_breaks_are_refused() {
        let req = request_bytes(
            "PUT",
            "/cluster",
            &[("Host", "h:1"), ("Authorization", "Bearer x")],
            b"size 4",
        )
        .unwrap();
        let (h, n) = codec::request_head(&req, &L).unwrap().unwrap();
        assert_eq!(
            (h.method.as_str(), h.path.as_str(), h.length),
            ("PUT", "/cluster", 6)
        );
        assert_eq!(&req[n..], b"size 4");
        assert!(request_bytes("GET", "/", &[("X", "a\r\nInjected: 1")], b"").is_err());
        assert!(request_bytes("GET", "/a b", &[], b"").is_err());
        let resp = response_bytes(404, "Not Found", &[("Content-Type", "text/plain")], b"none");
        let (h, body) = codec::whole_response(&resp, &L).unwrap();
        assert_eq!(
            (h.code, h.keep_alive, body.as_slice()),
            (404, false, &b"none"[..])
        );
    }
}
