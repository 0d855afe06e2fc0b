//! The etcd client's connections: HTTP/1.1 ([`crate::http`]) over TCP or
//! TLS, kept open between unary calls. A member's idle connections wait
//! in its [`Pool`] (at most [`POOL`] of them, each at most [`IDLE`] old),
//! so that a lease's keepalive every second or two costs no new TCP or TLS
//! handshake; a watch has a connection of its own.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::access::Tls;
use super::{MAX_BODY, MAX_HEAD};
use crate::http::{Body, Framing, Limits, Reader};

/// The most idle connections kept per member.
const POOL: usize = 4;

/// How long a connection may wait idle before it is closed rather than
/// used (well under any server's idle time-out).
const IDLE: Duration = Duration::from_secs(30);

const LIMITS: Limits = Limits {
    head: MAX_HEAD,
    body: MAX_BODY,
};

/// A connection to etcd, plain or in TLS.
pub(super) enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Stream {
    /// Whether nothing is waiting to be read: on the socket (see [`quiet`])
    /// and, in TLS, among the records already taken off it (a stray byte
    /// of either would be read as the next request's answer).
    fn quiet(&mut self) -> bool {
        match self {
            Stream::Plain(s) => quiet(s),
            Stream::Tls(s) => {
                let (tcp, tls) = s.get_mut();
                quiet(tcp)
                    && tls
                        .process_new_packets()
                        .is_ok_and(|st| st.plaintext_bytes_to_read() == 0 && !st.peer_has_closed())
            }
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

/// One HTTP/1.1 connection to a member, and the response it is reading.
pub(super) struct Conn {
    r: Reader<Stream>,
    body: Option<Body>,
    keep_alive: bool,
    /// Whether it served a request before this one.
    pub(super) reused: bool,
    pub(super) chunked: bool,
}

impl Conn {
    /// A new connection to `addr`, over TLS where `tls` is given.
    pub(super) async fn connect(addr: &str, tls: Option<&Tls>) -> Result<Conn, String> {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        // requests are small and answered at once: no Nagle delay
        let _ = tcp.set_nodelay(true);
        let s = match tls {
            None => Stream::Plain(tcp),
            Some(t) => Stream::Tls(Box::new(
                tokio_rustls::TlsConnector::from(t.config.clone())
                    .connect(t.name.clone(), tcp)
                    .await
                    .map_err(|e| format!("TLS: {e}"))?,
            )),
        };
        Ok(Conn {
            r: Reader::new(s, LIMITS),
            body: None,
            keep_alive: false,
            reused: false,
            chunked: false,
        })
    }

    /// Sends `POST path` with `body` (and etcd's auth `token`, if any).
    /// Every request asks a member without a leader to refuse it at once
    /// (the gateway's `Grpc-Metadata-Hasleader: true`), rather than to wait
    /// for one, and a watch to end when its member loses the leader.
    pub(super) async fn send(
        &mut self,
        addr: &str,
        path: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<(), String> {
        let body = body.to_string();
        let mut headers = vec![
            ("Host", addr),
            ("Content-Type", "application/json"),
            ("Grpc-Metadata-Hasleader", "true"),
        ];
        if let Some(t) = token {
            headers.push(("Authorization", t));
        }
        let req = crate::http::request_bytes("POST", path, &headers, body.as_bytes())?;
        self.r.mark();
        let s = self.r.get_mut();
        let written = match s {
            Stream::Plain(s) => s.write_all(&req).await,
            Stream::Tls(s) => match s.write_all(&req).await {
                // TLS buffers records
                Ok(()) => s.flush().await,
                e => e,
            },
        };
        written.map_err(|e| format!("write: {e}"))
    }

    /// Reads the response head: its status code.
    pub(super) async fn head(&mut self) -> Result<u16, String> {
        let head = self.r.response_head().await?;
        self.chunked = head.framing == Framing::Chunked;
        self.keep_alive = head.keep_alive;
        self.body = Some(Body::new(head.framing, LIMITS));
        Ok(head.code)
    }

    /// Whether a kept connection failed before any byte of an answer:
    /// the member closed it while it was idle, so the request it carried
    /// went nowhere unless the member died just after taking it.
    pub(super) fn closed_unanswered(&self) -> bool {
        self.reused && !self.r.read_any()
    }

    /// The next chunk of a chunked body, or the whole of another (`None`
    /// at its end).
    pub(super) async fn chunk(&mut self) -> Result<Option<Vec<u8>>, String> {
        let body = self.body.as_mut().ok_or("no response head read")?;
        self.r.next(body).await
    }

    /// The whole body, of whatever framing.
    pub(super) async fn body(&mut self) -> Result<Vec<u8>, String> {
        let mut all = Vec::new();
        while let Some(c) = self.chunk().await? {
            all.extend_from_slice(&c);
            if all.len() > MAX_BODY {
                return Err(format!("a body over {MAX_BODY} bytes"));
            }
        }
        Ok(all)
    }

    /// Whether it may carry another request: the response was read to
    /// its end, the member did not ask to close, sent nothing more, and
    /// has not closed it since.
    fn reusable(&mut self) -> bool {
        self.keep_alive
            && self.body.as_ref().is_some_and(Body::is_done)
            && !self.r.has_buffered()
            && self.r.get_mut().quiet()
    }
}

/// Whether nothing can be read from `tcp` now: not closed, no error, no
/// stray byte (a TLS close_notify included).
#[allow(unsafe_code)]
fn quiet(tcp: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    // SAFETY: a peek of at most one byte into `b`, which outlives the
    // call, on a socket `tcp` keeps open.
    let n = unsafe {
        libc::recv(
            tcp.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
}

/// A member's idle connections, newest last.
#[derive(Default)]
pub(super) struct Pool {
    idle: Mutex<Vec<(Conn, Instant)>>,
}

impl Pool {
    /// An idle connection that may carry a request, if one is kept.
    pub(super) fn take(&self) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((mut conn, since)) = idle.pop() {
            if since.elapsed() < IDLE && conn.r.get_mut().quiet() {
                conn.reused = true;
                conn.body = None;
                return Some(conn);
            }
        }
        None
    }

    /// Keeps `conn` for a later request, if it may carry one.
    pub(super) fn give(&self, mut conn: Conn) {
        if !conn.reusable() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.retain(|(_, since)| since.elapsed() < IDLE);
        if idle.len() < POOL {
            idle.push((conn, Instant::now()));
        }
    }
}
