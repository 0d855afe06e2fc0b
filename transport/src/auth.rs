//! The job's secret and what is made of it: the MACs of the handshake's
//! challenge-response ([`crate::handshake`]), the seal of a shared-memory
//! ring's identity, and the bearer token of a job's config server.
//!
//! Every worker of a job holds the same secret (`KUNGFU_JOB_SECRET`, which
//! `kungfu-run` sets for its workers). It never goes on the wire: peers
//! prove they hold it with HMAC-SHA256 over fresh nonces, and whatever
//! else is derived from it (the config server's token) is an HMAC of a
//! fixed label, from which the secret cannot be recovered.

use std::fmt;
use std::sync::Arc;

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

/// Bytes of a MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// The longest secret accepted, in bytes.
pub const MAX_SECRET: usize = 1024;

/// A job's shared secret, as an HMAC-SHA256 key. Cloning shares it. Its
/// `Debug` shows nothing of it.
#[derive(Clone)]
pub struct JobSecret {
    key: Arc<hmac::Key>,
    /// A MAC of a fixed label: equal secrets have equal fingerprints, so
    /// two secrets compare without comparing the secrets themselves.
    fingerprint: [u8; MAC_LEN],
}

/// Why a secret was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("the job secret is empty")]
    Empty,
    #[error("the job secret is {0} bytes; at most {MAX_SECRET}")]
    TooLong(usize),
    #[error("no system randomness: {0}")]
    Random(String),
}

impl JobSecret {
    /// The secret `bytes` (any bytes; `kungfu-run` makes 32 random bytes
    /// written in hex, and uses a `KUNGFU_JOB_SECRET` as its bytes).
    pub fn new(bytes: &[u8]) -> Result<JobSecret, SecretError> {
        if bytes.is_empty() {
            return Err(SecretError::Empty);
        }
        if bytes.len() > MAX_SECRET {
            return Err(SecretError::TooLong(bytes.len()));
        }
        let key = hmac::Key::new(hmac::HMAC_SHA256, bytes);
        let mut fingerprint = [0u8; MAC_LEN];
        fingerprint.copy_from_slice(hmac::sign(&key, b"kungfu job secret fingerprint").as_ref());
        Ok(JobSecret {
            key: Arc::new(key),
            fingerprint,
        })
    }

    /// A fresh secret: 32 random bytes in hex (64 characters), as a
    /// launcher hands it to its workers.
    pub fn generate_hex() -> Result<String, SecretError> {
        let b: [u8; 32] = random()?;
        Ok(hex(&b))
    }

    /// HMAC-SHA256 of the concatenation of `parts`, under a domain label
    /// (each use of the secret has its own, so a MAC made for one purpose
    /// is worth nothing for another).
    pub fn mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(&(label.len() as u32).to_le_bytes());
        ctx.update(label);
        for p in parts {
            ctx.update(p);
        }
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(ctx.sign().as_ref());
        out
    }

    /// Whether `tag` is [`JobSecret::mac`] of the same input, compared in
    /// constant time.
    pub fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
        eq_constant_time(&self.mac(label, parts), tag)
    }
}

impl PartialEq for JobSecret {
    fn eq(&self, other: &JobSecret) -> bool {
        eq_constant_time(&self.fingerprint, &other.fingerprint)
    }
}

impl Eq for JobSecret {}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobSecret(..)")
    }
}

/// Whether `a == b`, in time that depends on their lengths only.
pub fn eq_constant_time(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `N` bytes from the system's secure random source.
pub fn random<const N: usize>() -> Result<[u8; N], SecretError> {
    let mut b = [0u8; N];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| SecretError::Random("the system random source failed".into()))?;
    Ok(b)
}

/// Lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_depend_on_secret_label_and_input() {
        let a = JobSecret::new(b"one").unwrap();
        let b = JobSecret::new(b"two").unwrap();
        let m = a.mac(b"l", &[b"x", b"y"]);
        assert!(a.verify(b"l", &[b"xy"], &m), "parts are concatenated");
        assert!(!a.verify(b"k", &[b"xy"], &m), "another label");
        assert!(!a.verify(b"l", &[b"xz"], &m), "another input");
        assert!(!b.verify(b"l", &[b"xy"], &m), "another secret");
        assert!(!a.verify(b"l", &[b"xy"], &m[..31]), "truncated");
        // the label's length is part of the input: no sliding bytes across
        assert_ne!(a.mac(b"ab", &[b"c"]), a.mac(b"a", &[b"bc"]));
        assert_eq!(a, JobSecret::new(b"one").unwrap());
        assert_ne!(a, b);
        assert_eq!(format!("{a:?}"), "JobSecret(..)");
    }

    #[test]
    fn secrets_are_checked_and_generated() {
        assert_eq!(JobSecret::new(b"").unwrap_err(), SecretError::Empty);
        let long = vec![1u8; MAX_SECRET + 1];
        assert!(matches!(
            JobSecret::new(&long),
            Err(SecretError::TooLong(_))
        ));
        let (x, y) = (
            JobSecret::generate_hex().unwrap(),
            JobSecret::generate_hex().unwrap(),
        );
        assert_eq!(x.len(), 64);
        assert!(x.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(x, y);
    }
}
