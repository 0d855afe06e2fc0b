//! The config server's credential: every request proves the job secret
//! over itself and a fresh nonce, and every answer proves it back.
//!
//! A request carries
//!
//! ```text
//! Authorization: KungFu-HMAC t=<unix ms>,n=<32 hex digits>,m=<64 hex digits>
//! ```
//!
//! where `m` is the HMAC-SHA256, under the job secret and a label of its
//! own, of the method, the path, `t`, `n` and the body (each with its
//! length). The server takes it only if `m` is right, `t` is within
//! [`WINDOW_MS`] of its own clock, and it has not seen `(t, n)` before:
//! it remembers each nonce it took for as long as its time is in the
//! window (a replay after that is out of the window), at most
//! [`MAX_REMEMBERED`] at once (then it answers 503 until some age out). So a
//! request seen on the wire can be neither sent again nor altered, and a
//! `GET`, signed the same way, shows the config only to the job.
//!
//! Its answer carries `X-KungFu-Signature: <64 hex digits>`, the HMAC of
//! the request's nonce, the status code and the body: a client takes a
//! 200, 404 or 409 only with it, so nobody on the path can answer in the
//! server's name (a forged 409 would read as a conflict; a forged 200, as
//! a config).
//!
//! What this does not give: privacy (plain HTTP: the configs, which are
//! worker addresses, can be read on the path), and delivery (requests and
//! answers can be dropped or delayed, within the window).

use std::collections::{BTreeSet, HashSet};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use kungfu_transport::auth::{hex, random, JobSecret};

/// The scheme of the `Authorization` header.
pub const SCHEME: &str = "KungFu-HMAC";
/// The header that signs an answer.
pub const SIGNATURE_HEADER: &str = "X-KungFu-Signature";
/// How far a request's time may be from the server's clock, either way
/// (hosts of a job need clocks within this of each other).
pub const WINDOW_MS: u64 = 30_000;
/// The most nonces remembered at once (each for the window).
pub const MAX_REMEMBERED: usize = 1 << 18;

const REQUEST_LABEL: &[u8] = b"kungfu config request v1";
const RESPONSE_LABEL: &[u8] = b"kungfu config answer v1";
/// Bytes of a nonce.
const NONCE: usize = 16;

/// Milliseconds since the Unix epoch, by this host's clock.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Each part with its length first, so that no two inputs run together.
fn framed<'a>(parts: &[&'a [u8]], lens: &'a mut Vec<[u8; 8]>) -> Vec<&'a [u8]> {
    lens.clear();
    lens.extend(parts.iter().map(|p| (p.len() as u64).to_le_bytes()));
    let mut out = Vec::with_capacity(parts.len() * 2);
    for (p, l) in parts.iter().zip(lens.iter()) {
        out.push(&l[..]);
        out.push(*p);
    }
    out
}

fn request_mac(
    secret: &JobSecret,
    method: &str,
    path: &str,
    t: u64,
    n: &str,
    body: &[u8],
) -> String {
    let t = t.to_string();
    let mut lens = Vec::new();
    let parts = framed(
        &[
            method.as_bytes(),
            path.as_bytes(),
            t.as_bytes(),
            n.as_bytes(),
            body,
        ],
        &mut lens,
    );
    hex(&secret.mac(REQUEST_LABEL, &parts))
}

/// The signature of an answer (`code`, `body`) to the request whose nonce
/// was `nonce`.
pub fn answer_signature(secret: &JobSecret, nonce: &str, code: u16, body: &[u8]) -> String {
    let code = code.to_string();
    let mut lens = Vec::new();
    let parts = framed(&[nonce.as_bytes(), code.as_bytes(), body], &mut lens);
    hex(&secret.mac(RESPONSE_LABEL, &parts))
}

/// A signed request's `Authorization` value and its nonce (the answer is
/// signed over it).
pub struct Signed {
    pub authorization: String,
    pub nonce: String,
}

/// Signs a request at time `t` (unix ms) with a fresh random nonce.
pub fn sign(
    secret: &JobSecret,
    method: &str,
    path: &str,
    body: &[u8],
    t: u64,
) -> Result<Signed, String> {
    let n: [u8; NONCE] = random().map_err(|e| e.to_string())?;
    let n = hex(&n);
    let m = request_mac(secret, method, path, t, &n, body);
    Ok(Signed {
        authorization: format!("{SCHEME} t={t},n={n},m={m}"),
        nonce: n,
    })
}

/// Whether an answer's signature (`given`) is the server's for the
/// request of `nonce`: `Err` says why not.
pub fn check_answer(
    secret: &JobSecret,
    nonce: &str,
    code: u16,
    body: &[u8],
    given: Option<&str>,
) -> Result<(), String> {
    let given = given.ok_or("unsigned (no X-KungFu-Signature)")?;
    let want = answer_signature(secret, nonce, code, body);
    if kungfu_transport::auth::eq_constant_time(given.as_bytes(), want.as_bytes()) {
        Ok(())
    } else {
        Err("signed with another secret, or altered".into())
    }
}

/// The server's side: checks requests and remembers the nonces it took.
pub struct Verifier {
    secret: JobSecret,
    seen: Mutex<Seen>,
}

/// The `(t, n)` taken whose `t` is still in the window: by time (to forget
/// the old ones first) and the nonces as a set.
#[derive(Default)]
struct Seen {
    by_time: BTreeSet<(u64, String)>,
    nonces: HashSet<String>,
}

/// The parts of an `Authorization: KungFu-HMAC ...` value.
struct Parts<'a> {
    t: u64,
    n: &'a str,
    m: &'a str,
}

fn parse(value: &str) -> Result<Parts<'_>, (u16, String)> {
    let want = || {
        (
            401,
            format!("this server wants the job's credential (Authorization: {SCHEME} t=..,n=..,m=..; `kungfu-run --resize N --config-server URL` signs a resize)"),
        )
    };
    let (scheme, rest) = value.split_once(' ').ok_or_else(want)?;
    if !scheme.eq_ignore_ascii_case(SCHEME) {
        return Err(want());
    }
    let bad = |why: &str| (403, format!("bad credential: {why}"));
    let (mut t, mut n, mut m) = (None, None, None);
    for field in rest.trim().split(',') {
        let (k, v) = field
            .trim()
            .split_once('=')
            .ok_or_else(|| bad("a field without ="))?;
        let slot = match k {
            "t" => &mut t,
            "n" => &mut n,
            "m" => &mut m,
            _ => return Err(bad("an unknown field")),
        };
        if slot.replace(v).is_some() {
            return Err(bad("a field twice"));
        }
    }
    let (t, n, m) = match (t, n, m) {
        (Some(t), Some(n), Some(m)) => (t, n, m),
        _ => return Err(bad("t, n and m are all needed")),
    };
    let is_hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    if t.is_empty() || t.len() > 20 || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("t is not a time in milliseconds"));
    }
    if !is_hex(n, 2 * NONCE) || !is_hex(m, 64) {
        return Err(bad("n or m is not hex of its length"));
    }
    let t = t
        .parse()
        .map_err(|_| bad("t is not a time in milliseconds"))?;
    Ok(Parts { t, n, m })
}

impl Verifier {
    pub fn new(secret: JobSecret) -> Verifier {
        Verifier {
            secret,
            seen: Mutex::new(Seen::default()),
        }
    }

    pub fn secret(&self) -> &JobSecret {
        &self.secret
    }

    /// Checks a request (its `Authorization` value, method, path and body)
    /// at time `now` (unix ms): its nonce, to sign the answer with, or
    /// (status code, why): 401 without the credential, 403 for a wrong,
    /// altered, stale or replayed one, 503 when too many are remembered.
    pub fn check(
        &self,
        authorization: Option<&str>,
        method: &str,
        path: &str,
        body: &[u8],
        now: u64,
    ) -> Result<String, (u16, String)> {
        let p = parse(authorization.unwrap_or(""))?;
        if p.t.abs_diff(now) > WINDOW_MS {
            return Err((
                403,
                format!(
                    "bad credential: its time is {} ms from this server's clock (at most {WINDOW_MS}: \
                     the hosts' clocks must agree)",
                    p.t.abs_diff(now)
                ),
            ));
        }
        let want = request_mac(&self.secret, method, path, p.t, p.n, body);
        if !kungfu_transport::auth::eq_constant_time(p.m.as_bytes(), want.as_bytes()) {
            return Err((
                403,
                "bad credential: another secret, or the request was altered".into(),
            ));
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let Seen {
            by_time,
            nonces: set,
        } = &mut *seen;
        // forget what is out of the window: a replay of it is refused by time
        while let Some(first) = by_time.first() {
            if first.0.saturating_add(WINDOW_MS) >= now {
                break;
            }
            let (_, n) = by_time.pop_first().expect("a first");
            set.remove(&n);
        }
        if set.contains(p.n) {
            return Err((403, "bad credential: replayed (its nonce was used)".into()));
        }
        if set.len() >= MAX_REMEMBERED {
            return Err((503, "too many requests in the window; try again".into()));
        }
        set.insert(p.n.to_string());
        by_time.insert((p.t, p.n.to_string()));
        Ok(p.n.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> JobSecret {
        JobSecret::new(b"the job").unwrap()
    }

    #[test]
    fn a_signed_request_is_taken_once() {
        let v = Verifier::new(job());
        let now = 1_800_000_000_000;
        let s = sign(&job(), "PUT", "/cluster", b"size 3", now).unwrap();
        let a = Some(s.authorization.as_str());
        assert_eq!(
            v.check(a, "PUT", "/cluster", b"size 3", now + 5),
            Ok(s.nonce.clone())
        );
        let e = v
            .check(a, "PUT", "/cluster", b"size 3", now + 6)
            .unwrap_err();
        assert_eq!(e.0, 403);
        assert!(e.1.contains("replayed"), "{}", e.1);
        // another nonce is another request
        let s2 = sign(&job(), "PUT", "/cluster", b"size 3", now).unwrap();
        assert!(v
            .check(Some(&s2.authorization), "PUT", "/cluster", b"size 3", now)
            .is_ok());
    }

    #[test]
    fn an_altered_request_or_another_secret_is_refused() {
        let v = Verifier::new(job());
        let now = 1_800_000_000_000;
        let s = sign(&job(), "PUT", "/cluster", b"size 3", now).unwrap();
        let a = Some(s.authorization.as_str());
        for (m, p, b) in [
            ("GET", "/cluster", &b"size 3"[..]),
            ("PUT", "/cluster/1", b"size 3"),
            ("PUT", "/cluster", b"size 4"),
            ("PUT", "/cluster", b""),
        ] {
            let e = v.check(a, m, p, b, now).unwrap_err();
            assert_eq!(e.0, 403, "{m} {p} {b:?}: {}", e.1);
        }
        let other = JobSecret::new(b"another job").unwrap();
        let s = sign(&other, "PUT", "/cluster", b"size 3", now).unwrap();
        let e = v
            .check(Some(&s.authorization), "PUT", "/cluster", b"size 3", now)
            .unwrap_err();
        assert_eq!(e.0, 403);
        // the time is signed too
        let forged = s
            .authorization
            .replace(&format!("t={now}"), &format!("t={}", now + 1));
        assert_eq!(
            v.check(Some(&forged), "PUT", "/cluster", b"size 3", now)
                .unwrap_err()
                .0,
            403
        );
    }

    #[test]
    fn a_time_outside_the_window_is_refused_both_ways() {
        let v = Verifier::new(job());
        let now = 1_800_000_000_000;
        for t in [now - WINDOW_MS - 1, now + WINDOW_MS + 1] {
            let s = sign(&job(), "GET", "/cluster", b"", t).unwrap();
            let e = v
                .check(Some(&s.authorization), "GET", "/cluster", b"", now)
                .unwrap_err();
            assert_eq!(e.0, 403);
            assert!(e.1.contains("clock"), "{}", e.1);
        }
        for t in [now - WINDOW_MS, now + WINDOW_MS] {
            let s = sign(&job(), "GET", "/cluster", b"", t).unwrap();
            assert!(v
                .check(Some(&s.authorization), "GET", "/cluster", b"", now)
                .is_ok());
        }
    }

    #[test]
    fn malformed_headers_are_refused_without_a_panic() {
        let v = Verifier::new(job());
        let now = 1_800_000_000_000;
        let n = "0".repeat(32);
        let m = "0".repeat(64);
        let cases = [
            String::new(),
            "Bearer abc".into(),
            SCHEME.into(),
            format!("{SCHEME} t={now}"),
            format!("{SCHEME} t={now},n={n}"),
            format!("{SCHEME} t=x,n={n},m={m}"),
            format!("{SCHEME} t={now},n=zz,m={m}"),
            format!("{SCHEME} t={now},n={n},m={m},m={m}"),
            format!("{SCHEME} t={now},n={n},m={m},q=1"),
            format!("{SCHEME} t=99999999999999999999999,n={n},m={m}"),
            format!("{SCHEME} t={now},n={n},m={m}"),
        ];
        for c in &cases {
            let a = (!c.is_empty()).then_some(c.as_str());
            let e = v.check(a, "GET", "/cluster", b"", now).unwrap_err();
            assert!(e.0 == 401 || e.0 == 403, "{c:?}: {e:?}");
        }
    }

    #[test]
    fn old_nonces_are_forgotten_once_out_of_the_window() {
        let v = Verifier::new(job());
        let t0 = 1_800_000_000_000;
        for i in 0..10 {
            let s = sign(&job(), "GET", "/cluster", b"", t0 + i).unwrap();
            v.check(Some(&s.authorization), "GET", "/cluster", b"", t0 + i)
                .unwrap();
        }
        assert_eq!(v.seen.lock().unwrap().nonces.len(), 10);
        let later = t0 + 10 + WINDOW_MS + 1;
        let s = sign(&job(), "GET", "/cluster", b"", later).unwrap();
        v.check(Some(&s.authorization), "GET", "/cluster", b"", later)
            .unwrap();
        let seen = v.seen.lock().unwrap();
        assert_eq!((seen.by_time.len(), seen.nonces.len()), (1, 1));
    }

    #[test]
    fn answers_are_checked() {
        let s = answer_signature(&job(), "ab", 200, b"version 1\n");
        assert!(check_answer(&job(), "ab", 200, b"version 1\n", Some(&s)).is_ok());
        assert!(check_answer(&job(), "ab", 409, b"version 1\n", Some(&s)).is_err());
        assert!(check_answer(&job(), "ac", 200, b"version 1\n", Some(&s)).is_err());
        assert!(check_answer(&job(), "ab", 200, b"version 2\n", Some(&s)).is_err());
        assert!(check_answer(&job(), "ab", 200, b"version 1\n", None).is_err());
        let other = JobSecret::new(b"x").unwrap();
        assert!(check_answer(&other, "ab", 200, b"version 1\n", Some(&s)).is_err());
    }
}
