//! The config server's messages in the crate's one HTTP/1.1
//! ([`crate::http`]): a request as the server reads it, a response as the
//! client reads it, both within [`LIMITS`]; and the parts of an
//! `http://` or `https://` URL.

use tokio::io::AsyncRead;

use crate::http::{Framing, Limits, Reader, RequestHead};

/// The longest head (request or response) and body (a peer list of ~16k
/// entries) accepted.
pub(super) const LIMITS: Limits = Limits {
    head: 8 << 10,
    body: 1 << 20,
};

/// A request, as the server reads it.
pub(super) struct Request {
    pub(super) head: RequestHead,
    pub(super) body: String,
}

/// Reads one request: its head and a body of `Content-Length` bytes (none
/// if absent). The server answers one request per connection: bytes after
/// the body are refused.
pub(super) async fn read_request<S: AsyncRead + Unpin>(s: S) -> Result<Request, String> {
    let mut r = Reader::new(s, LIMITS);
    let head = r.request_head().await?;
    let body = r
        .body(Framing::Length(head.length))
        .await
        .map_err(|e| match e.as_str() {
            "closed early" => "closed before the end of the body".to_string(),
            _ => e,
        })?;
    if r.has_buffered() {
        return Err("more bytes than Content-Length".into());
    }
    let body = String::from_utf8(body).map_err(|_| "body is not UTF-8".to_string())?;
    Ok(Request { head, body })
}

/// Reads one response: its status code, its body, and its signature
/// (`X-KungFu-Signature`), if any.
pub(super) async fn read_response<S: AsyncRead + Unpin>(
    s: S,
) -> Result<(u16, String, Option<String>), String> {
    let mut r = Reader::new(s, LIMITS);
    let head = r.response_head().await?;
    let body = r.body(head.framing).await?;
    let body = String::from_utf8(body).map_err(|_| "body is not UTF-8".to_string())?;
    Ok((head.code, body, head.signature))
}

/// A config server's URL, split: over TLS or not, the address, the path.
pub(super) struct Url<'a> {
    pub(super) tls: bool,
    pub(super) addr: &'a str,
    pub(super) path: &'a str,
}

/// Splits `http://host:port/path` (or `https://`) into its parts.
pub(super) fn split_url(url: &str) -> Result<Url<'_>, String> {
    let (tls, rest) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
        (Some(rest), _) => (false, rest),
        (_, Some(rest)) => (true, rest),
        _ => {
            return Err(format!(
                "{url:?}: only http:// and https:// URLs are served"
            ))
        }
    };
    let (addr, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    Ok(Url { tls, addr, path })
}
