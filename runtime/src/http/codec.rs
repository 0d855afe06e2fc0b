//! HTTP/1.1 framing without I/O: heads parsed by `httparse` into what the
//! config server, its client and the etcd client use, and a body decoder
//! for `Content-Length`, chunked and read-to-close bodies. Every size is
//! bounded by [`Limits`]; anything malformed, ambiguous or too large is an
//! error naming what was wrong.

/// The bounds of one message.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// The head: start line and header lines, with the blank line.
    pub head: usize,
    /// The body, decoded; also the largest chunk.
    pub body: usize,
}

/// The most header lines a head may have.
const MAX_HEADERS: usize = 64;

/// The longest chunk-size line (the size in hex and any extensions).
const MAX_CHUNK_LINE: usize = 1024;

/// How a body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// This many bytes.
    Length(usize),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// To the end of the connection (a response without either).
    ToClose,
}

/// A response's head.
#[derive(Debug, PartialEq, Eq)]
pub struct ResponseHead {
    pub code: u16,
    pub framing: Framing,
    /// Whether the connection may carry another request after this
    /// response's body.
    pub keep_alive: bool,
    /// The `X-KungFu-Signature` header, if any (the config server signs
    /// its answers: see `elastic::credential`).
    pub signature: Option<String>,
}

/// A request's head, with the one header the config server reads.
#[derive(Debug, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
    /// Its body's length (a request here never has a chunked body).
    pub length: usize,
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
}

/// What the headers say of the body and the connection.
struct Headers {
    length: Option<usize>,
    chunked: bool,
    close: bool,
    keep_alive: bool,
    authorization: Option<String>,
    signature: Option<String>,
}

fn headers_of(list: &[httparse::Header<'_>], limits: &Limits) -> Result<Headers, String> {
    let mut h = Headers {
        length: None,
        chunked: false,
        close: false,
        keep_alive: false,
        authorization: None,
        signature: None,
    };
    for header in list {
        let value = std::str::from_utf8(header.value)
            .map_err(|_| format!("header {} is not UTF-8", header.name))?
            .trim();
        if header.name.eq_ignore_ascii_case("content-length") {
            // digits only: no sign, no list, no spaces inside
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("bad Content-Length {value:?}"));
            }
            let n: usize = value
                .parse()
                .map_err(|_| format!("bad Content-Length {value:?}"))?;
            if h.length.is_some_and(|m| m != n) {
                return Err("two different Content-Length headers".into());
            }
            if n > limits.body {
                return Err(format!("a body of {n} bytes; at most {}", limits.body));
            }
            h.length = Some(n);
        } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
            // chunked, last, and no other coding (none is asked for)
            if h.chunked || !value.eq_ignore_ascii_case("chunked") {
                return Err(format!("Transfer-Encoding {value:?}: only chunked is read"));
            }
            h.chunked = true;
        } else if header.name.eq_ignore_ascii_case("connection") {
            for token in value.split(',').map(str::trim) {
                h.close |= token.eq_ignore_ascii_case("close");
                h.keep_alive |= token.eq_ignore_ascii_case("keep-alive");
            }
        } else if header.name.eq_ignore_ascii_case("authorization") {
            if h.authorization.is_some() {
                return Err("two Authorization headers".into());
            }
            h.authorization = Some(value.to_string());
        } else if header.name.eq_ignore_ascii_case("x-kungfu-signature") {
            if h.signature.is_some() {
                return Err("two X-KungFu-Signature headers".into());
            }
            h.signature = Some(value.to_string());
        }
    }
    if h.chunked && h.length.is_some() {
        // which one frames it is how requests are smuggled: neither
        return Err("both Content-Length and Transfer-Encoding".into());
    }
    Ok(h)
}

/// What `httparse` said, as this module says it: `None` while the head is
/// incomplete and still within its bound.
fn parsed(
    status: Result<httparse::Status<usize>, httparse::Error>,
    buf: &[u8],
    limits: &Limits,
    what: &str,
) -> Result<Option<usize>, String> {
    match status {
        Ok(httparse::Status::Complete(n)) if n > limits.head => Err(head_too_long(limits)),
        Ok(httparse::Status::Complete(n)) => Ok(Some(n)),
        Ok(httparse::Status::Partial) if buf.len() > limits.head => Err(head_too_long(limits)),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            Err(format!("more than {MAX_HEADERS} header lines"))
        }
        Err(e) => Err(format!("bad {what}: {e}")),
    }
}

fn head_too_long(limits: &Limits) -> String {
    format!("a head over {} bytes", limits.head)
}

/// Parses a response head at the start of `buf`: the head and its length
/// in bytes, `None` if more bytes are needed.
pub fn response_head(buf: &[u8], limits: &Limits) -> Result<Option<(ResponseHead, usize)>, String> {
    let mut list = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut r = httparse::Response::new(&mut list);
    let status = r.parse(buf);
    let Some(n) = parsed(status, buf, limits, "response")? else {
        return Ok(None);
    };
    let code = r.code.ok_or("a response without a status code")?;
    if (100..200).contains(&code) {
        return Err(format!("an interim response ({code}); none was asked for"));
    }
    let h = headers_of(r.headers, limits)?;
    let framing = match (h.chunked, h.length) {
        (true, _) => Framing::Chunked,
        (false, Some(n)) => Framing::Length(n),
        _ if code == 204 || code == 304 => Framing::Length(0),
        (false, None) => Framing::ToClose,
    };
    let keep_alive =
        framing != Framing::ToClose && !h.close && (r.version == Some(1) || h.keep_alive);
    Ok(Some((
        ResponseHead {
            code,
            framing,
            keep_alive,
            signature: h.signature,
        },
        n,
    )))
}

/// Parses a request head at the start of `buf`, as [`response_head`].
pub fn request_head(buf: &[u8], limits: &Limits) -> Result<Option<(RequestHead, usize)>, String> {
    let mut list = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut r = httparse::Request::new(&mut list);
    let status = r.parse(buf);
    let Some(n) = parsed(status, buf, limits, "request")? else {
        return Ok(None);
    };
    let h = headers_of(r.headers, limits)?;
    if h.chunked {
        return Err("a chunked request body: send Content-Length".into());
    }
    Ok(Some((
        RequestHead {
            method: r.method.ok_or("a request without a method")?.to_string(),
            path: r.path.ok_or("a request without a path")?.to_string(),
            length: h.length.unwrap_or(0),
            authorization: h.authorization,
        },
        n,
    )))
}

/// One step of a body's decoding.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Decoded bytes: a whole chunk, or the whole body of the other
    /// framings.
    Data(Vec<u8>),
    /// More bytes are needed.
    More,
    /// The body ended; what follows in the buffer is the next message's.
    End,
}

#[derive(Clone, Copy, Debug)]
enum State {
    /// A chunk-size line, next.
    Size,
    /// A chunk of this many bytes, and its CRLF.
    Chunk(usize),
    /// The trailer lines after the last chunk, up to a blank one.
    Trailers,
    /// A body of the other framings, not yet returned.
    Whole,
    Done,
}

/// Decodes one body out of a buffer that the caller fills: each call
/// takes what it decodes off the front of the buffer.
#[derive(Debug)]
pub struct Body {
    framing: Framing,
    state: State,
    limits: Limits,
    /// Decoded so far.
    total: usize,
}

impl Body {
    pub fn new(framing: Framing, limits: Limits) -> Body {
        let state = match framing {
            Framing::Chunked => State::Size,
            _ => State::Whole,
        };
        Body {
            framing,
            state,
            limits,
            total: 0,
        }
    }

    /// The next step over `buf`, whose bytes after it the connection's
    /// end (`eof`) follows or not.
    pub fn step(&mut self, buf: &mut Vec<u8>, eof: bool) -> Result<Step, String> {
        loop {
            match self.state {
                State::Done => return Ok(Step::End),
                State::Whole => return self.whole(buf, eof),
                State::Size => {
                    let Some(end) = line_end(buf) else {
                        if buf.len() > MAX_CHUNK_LINE {
                            return Err("bad chunk size line".into());
                        }
                        return self.more(eof);
                    };
                    let size = std::str::from_utf8(&buf[..end])
                        .ok()
                        .map(|l| l.split(';').next().unwrap_or("").trim())
                        .filter(|s| !s.is_empty() && s.len() <= 16)
                        .and_then(|s| usize::from_str_radix(s, 16).ok())
                        .ok_or("bad chunk size")?;
                    self.account(size)?;
                    buf.drain(..end + 2);
                    self.state = match size {
                        0 => State::Trailers,
                        n => State::Chunk(n),
                    };
                }
                State::Chunk(n) => {
                    if buf.len() < n + 2 {
                        return self.more(eof);
                    }
                    if &buf[n..n + 2] != b"\r\n" {
                        return Err("a chunk not ended by CRLF".into());
                    }
                    let data = buf[..n].to_vec();
                    buf.drain(..n + 2);
                    self.state = State::Size;
                    return Ok(Step::Data(data));
                }
                State::Trailers => match line_end(buf) {
                    Some(0) => {
                        buf.drain(..2);
                        self.state = State::Done;
                    }
                    Some(i) => {
                        self.account_trailer(i + 2)?;
                        buf.drain(..i + 2);
                    }
                    None if buf.len() > self.limits.head => {
                        return Err("trailers too long".into());
                    }
                    None => return self.more(eof),
                },
            }
        }
    }

    /// The body of a length or read-to-close framing, whole.
    fn whole(&mut self, buf: &mut Vec<u8>, eof: bool) -> Result<Step, String> {
        match self.framing {
            Framing::Length(n) if buf.len() >= n => {
                self.state = State::Done;
                Ok(Step::Data(buf.drain(..n).collect()))
            }
            Framing::ToClose if buf.len() > self.limits.body => {
                Err(format!("a body over {} bytes", self.limits.body))
            }
            Framing::ToClose if eof => {
                self.state = State::Done;
                Ok(Step::Data(std::mem::take(buf)))
            }
            _ => self.more(eof),
        }
    }

    fn more(&self, eof: bool) -> Result<Step, String> {
        match eof {
            true => Err("closed early".into()),
            false => Ok(Step::More),
        }
    }

    fn account(&mut self, size: usize) -> Result<(), String> {
        self.total = self.total.saturating_add(size);
        if size > self.limits.body || self.total > self.limits.body {
            return Err(format!("a body over {} bytes", self.limits.body));
        }
        Ok(())
    }

    fn account_trailer(&mut self, len: usize) -> Result<(), String> {
        // trailers count against the head's bound, not the body's
        self.limits.head = self
            .limits
            .head
            .checked_sub(len)
            .ok_or("trailers too long")?;
        Ok(())
    }

    /// Whether the body has ended.
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }
}

/// Where the first CRLF starts.
fn line_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n")
}

/// A whole response out of `bytes` (followed by the connection's end):
/// its head and its body, every chunk joined.
pub fn whole_response(bytes: &[u8], limits: &Limits) -> Result<(ResponseHead, Vec<u8>), String> {
    let (head, n) = response_head(bytes, limits)?.ok_or("closed early")?;
    let mut buf = bytes[n..].to_vec();
    let mut body = Body::new(head.framing, *limits);
    let mut all = Vec::new();
    loop {
        match body.step(&mut buf, true)? {
            Step::Data(d) => all.extend_from_slice(&d),
            Step::End => return Ok((head, all)),
            Step::More => unreachable!("at the end of the bytes a step needs no more"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        head: 1024,
        body: 4096,
    };

    #[test]
    fn framings_are_read_and_the_next_message_is_left() {
        let (h, n) = response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}rest", &L)
            .unwrap()
            .unwrap();
        assert_eq!(
            h,
            ResponseHead {
                code: 200,
                framing: Framing::Length(2),
                keep_alive: true,
                signature: None,
            }
        );
        assert_eq!(n, 38);
        let mut buf = b"{}rest".to_vec();
        let mut b = Body::new(h.framing, L);
        assert_eq!(b.step(&mut buf, false), Ok(Step::Data(b"{}".to_vec())));
        assert_eq!(b.step(&mut buf, false), Ok(Step::End));
        assert_eq!(buf, b"rest");

        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;x=y\r\nab\r\n1\r\nc\r\n0\r\nT: 1\r\n\r\nnext";
        let (h, n) = response_head(chunked, &L).unwrap().unwrap();
        assert_eq!(h.framing, Framing::Chunked);
        let mut buf = chunked[n..].to_vec();
        let mut b = Body::new(h.framing, L);
        let mut got = Vec::new();
        // a byte at a time: every split point
        let mut fed = Vec::new();
        for &byte in buf.iter() {
            fed.push(byte);
            while let Step::Data(d) = b.step(&mut fed, false).unwrap() {
                got.push(d);
            }
            if b.is_done() {
                break;
            }
        }
        assert_eq!(got, vec![b"ab".to_vec(), b"c".to_vec()]);
        buf.clear();
        assert!(b.is_done());

        let (h, body) = whole_response(b"HTTP/1.0 200 OK\r\n\r\nto the end", &L).unwrap();
        assert_eq!((h.framing, h.keep_alive), (Framing::ToClose, false));
        assert_eq!(body, b"to the end");
        let (h, _) = response_head(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            &L,
        )
        .unwrap()
        .unwrap();
        assert!(!h.keep_alive);
    }

    #[test]
    fn bad_or_outsized_messages_are_errors() {
        let cases: [(&[u8], &str); 11] = [
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
                "bad Content-Length",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 1, 1\r\n\r\n",
                "bad Content-Length",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                "two different",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 99999\r\n\r\n",
                "at most 4096",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                "only chunked",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n",
                "both",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                "bad chunk size",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX",
                "CRLF",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffff\r\n",
                "a body over",
            ),
            (b"HTTP/1.1 100 Continue\r\n\r\n", "interim"),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab",
                "closed early",
            ),
        ];
        for (bytes, want) in cases {
            let e = whole_response(bytes, &L).unwrap_err();
            assert!(
                e.contains(want),
                "{:?}: {e}",
                String::from_utf8_lossy(bytes)
            );
        }
        let long = [b"HTTP/1.1 200 OK\r\nX: ".as_slice(), &[b'a'; 2000]].concat();
        assert!(response_head(&long, &L).unwrap_err().contains("head over"));
        assert!(response_head(b"HTTP/1.1 200 OK\r\nX: a", &L)
            .unwrap()
            .is_none());
        let many: String = (0..70).map(|i| format!("X{i}: a\r\n")).collect();
        let many = format!("HTTP/1.1 200 OK\r\n{many}\r\n");
        assert!(response_head(
            many.as_bytes(),
            &Limits {
                head: 4096,
                body: 1
            }
        )
        .unwrap_err()
        .contains("header lines"));
        assert!(whole_response(b"garbage\r\n\r\n", &L)
            .unwrap_err()
            .contains("bad"));
    }

    #[test]
    fn requests_carry_their_length_and_credential() {
        let req = b"PUT /cluster HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\nContent-Length: 6\r\n\r\nsize 4";
        let (h, n) = request_head(req, &L).unwrap().unwrap();
        assert_eq!(
            h,
            RequestHead {
                method: "PUT".into(),
                path: "/cluster".into(),
                length: 6,
                authorization: Some("Bearer t".into()),
            }
        );
        assert_eq!(&req[n..], b"size 4");
        for (bytes, want) in [
            (
                &b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
                "chunked request",
            ),
            (
                b"GET / HTTP/1.1\r\nAuthorization: a\r\nAuthorization: b\r\n\r\n",
                "two Authorization",
            ),
            (b"GET /\x01 HTTP/1.1\r\n\r\n", "bad"),
        ] {
            let e = request_head(bytes, &L).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }
}
