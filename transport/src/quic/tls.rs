//! Mutual TLS for the QUIC wire: a job's certificate authority, a
//! certificate per worker, and the rustls and quinn settings built on them.
//!
//! Every worker holds the job's CA certificate and its own certificate and
//! key, signed by that CA. Both sides of a connection check the other's
//! certificate against the CA (mutual TLS, TLS 1.3 only, one crypto
//! provider: ring), so a process without a certificate of the job is
//! refused before it sends a frame. Which rank a peer is comes after, from
//! the shared handshake ([`crate::handshake`]) on the connection's first
//! stream, as on TCP: the certificate proves membership of the job, the
//! handshake the rank.
//!
//! By default `kungfu-run` makes a fresh CA per job ([`JobCa`]) and hands
//! each worker its PEM files in a directory only the user can read
//! (`KUNGFU_QUIC_CA`, `KUNGFU_QUIC_CERT`, `KUNGFU_QUIC_KEY`); the CA's own
//! key never leaves the launcher. Users with their own PKI give the three
//! paths instead ([`QuicTls::from_pem_files`]).

use std::path::Path;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::auth::JobSecret;
use crate::TransportError;

/// The name every worker certificate carries (as a DNS name), and the
/// name a dialer expects: ranks are proven by the handshake, not by names.
pub const SERVER_NAME: &str = "kungfu";

/// The ALPN protocol of the wire.
pub const ALPN: &[u8] = b"kungfu/1";

/// What a worker needs for mutual TLS: the CA to check peers against, and
/// its own certificate chain and key.
pub struct QuicTls {
    pub ca: Vec<CertificateDer<'static>>,
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for QuicTls {
    fn clone(&self) -> QuicTls {
        QuicTls {
            ca: self.ca.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl std::fmt::Debug for QuicTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the key
        f.debug_struct("QuicTls")
            .field("ca", &self.ca.len())
            .field("chain", &self.chain.len())
            .finish_non_exhaustive()
    }
}

fn tls_error(what: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(what.to_string())
}

impl QuicTls {
    /// Certificates from the job's secret alone: the CA every holder of
    /// the secret derives ([`JobCa::from_secret`]), and a certificate of
    /// this worker (`who`, for logs) issued from it with a fresh key.
    pub fn from_secret(secret: &JobSecret, who: &str) -> Result<QuicTls, TransportError> {
        JobCa::from_secret(secret)?.issue(who)
    }

    /// Reads the CA certificates, this worker's certificate chain and its
    /// private key from PEM files.
    pub fn from_pem_files(ca: &Path, cert: &Path, key: &Path) -> Result<QuicTls, TransportError> {
        let certs = |p: &Path| -> Result<Vec<CertificateDer<'static>>, TransportError> {
            let v: Vec<_> = CertificateDer::pem_file_iter(p)
                .map_err(|e| tls_error(format!("{}: {e}", p.display())))?
                .collect::<Result<_, _>>()
                .map_err(|e| tls_error(format!("{}: {e}", p.display())))?;
            if v.is_empty() {
                return Err(tls_error(format!("{}: no certificate in it", p.display())));
            }
            Ok(v)
        };
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| tls_error(format!("{}: {e}", key.display())))?;
        Ok(QuicTls {
            ca: certs(ca)?,
            chain: certs(cert)?,
            key,
        })
    }

    /// The server side: presents this worker's certificate and requires
    /// one signed by the CA from every client.
    pub(crate) fn server_config(&self) -> Result<rustls::ServerConfig, TransportError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            self.roots()?,
            provider.clone(),
        )
        .build()
        .map_err(tls_error)?;
        let mut c = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls_error)?;
        c.alpn_protocols = vec![ALPN.to_vec()];
        c.max_early_data_size = 0;
        Ok(c)
    }

    /// The client side: checks the server against the CA, and presents
    /// this worker's certificate.
    pub(crate) fn client_config(&self) -> Result<rustls::ClientConfig, TransportError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut c = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls_error)?;
        c.alpn_protocols = vec![ALPN.to_vec()];
        Ok(c)
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, TransportError> {
        let mut roots = rustls::RootCertStore::empty();
        for c in &self.ca {
            roots
                .add(c.clone())
                .map_err(|e| tls_error(format!("the CA certificate: {e}")))?;
        }
        Ok(Arc::new(roots))
    }
}

/// A job's certificate authority: made fresh per job by the launcher,
/// which keeps its key in memory and issues one certificate per worker.
pub struct JobCa {
    issuer: Issuer<'static, KeyPair>,
    cert: CertificateDer<'static>,
    pem: String,
}

impl JobCa {
    /// A new CA with a new ECDSA P-256 key.
    pub fn new() -> Result<JobCa, TransportError> {
        JobCa::with_key(KeyPair::generate().map_err(tls_error)?)
    }

    /// The CA of the job whose secret is `secret`: its Ed25519 key is
    /// derived from the secret (an HMAC under a label of its own), so every
    /// holder of the secret, on any host, makes the same CA, and nobody
    /// else can issue a certificate it accepts. Workers that share a secret
    /// need no PKI of the user's: each issues its own certificate from it
    /// ([`QuicTls::from_secret`]). A certificate from any other CA, one the
    /// user trusts included, is refused.
    pub fn from_secret(secret: &JobSecret) -> Result<JobCa, TransportError> {
        let seed = secret.mac(b"kungfu quic job ca v1", &[]);
        // PKCS#8 v1 of an Ed25519 private key (RFC 8410): a fixed prefix,
        // then the 32-byte seed
        let mut der = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        der.extend_from_slice(&seed);
        JobCa::with_key(KeyPair::try_from(&der[..]).map_err(tls_error)?)
    }

    fn with_key(key: KeyPair) -> Result<JobCa, TransportError> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_error)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params
            .distinguished_name
            .push(DnType::CommonName, "KungFu-rs job CA");
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).map_err(tls_error)?;
        Ok(JobCa {
            issuer: Issuer::new(params, key),
            cert: cert.der().clone(),
            pem: cert.pem(),
        })
    }

    /// The CA certificate (PEM), for every worker.
    pub fn cert_pem(&self) -> &str {
        &self.pem
    }

    /// The CA certificate (DER), to trust.
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// A certificate and key for worker `who` (named in the subject, for
    /// logs), as PEM: (certificate, private key).
    pub fn issue_pem(&self, who: &str) -> Result<(String, String), TransportError> {
        let (cert, key) = self.issue_inner(who)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// [`JobCa::issue_pem`], ready to use in this process.
    pub fn issue(&self, who: &str) -> Result<QuicTls, TransportError> {
        let (cert, key) = self.issue_inner(who)?;
        let key = PrivateKeyDer::try_from(key.serialize_der()).map_err(tls_error)?;
        Ok(QuicTls {
            ca: vec![self.cert.clone()],
            chain: vec![cert.der().clone()],
            key,
        })
    }

    fn issue_inner(&self, who: &str) -> Result<(rcgen::Certificate, KeyPair), TransportError> {
        let mut params =
            CertificateParams::new(vec![SERVER_NAME.to_string()]).map_err(tls_error)?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("KungFu-rs worker {who}"));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(tls_error)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(tls_error)?;
        Ok((cert, key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_make_both_sides_configs() {
        let ca = JobCa::new().unwrap();
        let w = ca.issue("0").unwrap();
        w.server_config().unwrap();
        w.client_config().unwrap();
        let (cert, key) = ca.issue_pem("1").unwrap();
        assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(key.contains("PRIVATE KEY"));
        assert!(ca.cert_pem().starts_with("-----BEGIN CERTIFICATE-----"));
    }

    /// Two workers that hold the secret trust each other's certificates;
    /// one from a CA of another secret (or the user's) is not trusted.
    #[test]
    fn certificates_from_the_secret_are_trusted_by_its_holders_only() {
        use rustls::client::danger::ServerCertVerifier;
        use rustls::pki_types::{ServerName, UnixTime};
        let job = JobSecret::new(b"the job").unwrap();
        let a = QuicTls::from_secret(&job, "0").unwrap();
        let b = QuicTls::from_secret(&job, "1").unwrap();
        // the same CA, made apart from the same secret
        assert_eq!(
            JobCa::from_secret(&job)
                .unwrap()
                .issuer
                .key()
                .public_key_raw(),
            JobCa::from_secret(&job)
                .unwrap()
                .issuer
                .key()
                .public_key_raw()
        );
        let other = QuicTls::from_secret(&JobSecret::new(b"another job").unwrap(), "1").unwrap();
        let users = JobCa::new().unwrap().issue("1").unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            a.roots().unwrap(),
            provider,
        )
        .build()
        .unwrap();
        let name = ServerName::try_from(SERVER_NAME).unwrap();
        let check = |t: &QuicTls| {
            verifier.verify_server_cert(&t.chain[0], &[], &name, &[], UnixTime::now())
        };
        assert!(check(&b).is_ok(), "{:?}", check(&b));
        assert!(check(&other).is_err());
        assert!(check(&users).is_err());
        a.server_config().unwrap();
        a.client_config().unwrap();
    }

    #[test]
    fn bad_files_are_named_in_the_error() {
        let dir = std::env::temp_dir().join(format!("kf-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let missing = dir.join("missing.pem");
        let e = QuicTls::from_pem_files(&empty, &empty, &missing).unwrap_err();
        assert!(e.to_string().contains("missing.pem"), "{e}");
        let ca = JobCa::new().unwrap();
        let key = dir.join("key.pem");
        std::fs::write(&key, ca.issue_pem("0").unwrap().1).unwrap();
        let e = QuicTls::from_pem_files(&empty, &empty, &key).unwrap_err();
        assert!(e.to_string().contains("no certificate"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
