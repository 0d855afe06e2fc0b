//! The HTTP/1.1 of the client: one request per connection (`Connection:
//! close`), over TCP or TLS, its response read with every length bounded.

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::access::Tls;
use super::{MAX_BODY, MAX_HEAD};

/// A connection to etcd, plain or in TLS.
enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Stream {
    async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf).await,
            Stream::Tls(s) => s.read(buf).await,
        }
    }

    /// Writes `b` and flushes it (TLS buffers records).
    async fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        match self {
            Stream::Plain(s) => s.write_all(b).await,
            Stream::Tls(s) => {
                s.write_all(b).await?;
                s.flush().await
            }
        }
    }
}

/// One HTTP/1.1 request's connection, and what of its response was read.
pub(super) struct Conn {
    s: Stream,
    buf: Vec<u8>,
    pub(super) chunked: bool,
    length: Option<usize>,
}

impl Conn {
    /// Sends `POST path` with `body` (and etcd's auth `token`, if any) to
    /// `addr`, over TLS where `tls` is given. Every request asks a member
    /// without a leader to refuse it at once (the gateway's
    /// `Grpc-Metadata-Hasleader: true`), rather than to wait for one, and
    /// a watch to end when its member loses the leader.
    pub(super) async fn open(
        addr: &str,
        tls: Option<&Tls>,
        path: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<Conn, String> {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut s = match tls {
            None => Stream::Plain(tcp),
            Some(t) => Stream::Tls(Box::new(
                tokio_rustls::TlsConnector::from(t.config.clone())
                    .connect(t.name.clone(), tcp)
                    .await
                    .map_err(|e| format!("TLS: {e}"))?,
            )),
        };
        let body = body.to_string();
        let auth = match token {
            Some(t) => format!("Authorization: {t}\r\n"),
            None => String::new(),
        };
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{auth}Grpc-Metadata-Hasleader: true\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
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
    pub(super) async fn head(&mut self) -> Result<u16, String> {
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
    pub(super) async fn chunk(&mut self) -> Result<Option<Vec<u8>>, String> {
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
    pub(super) async fn body(&mut self) -> Result<Vec<u8>, String> {
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
