//! TLS for the config server across hosts, trusted through the job's
//! secret: the server presents a certificate issued by the job's CA (the
//! one every holder of the secret derives, [`JobCa::from_secret`], as the
//! QUIC wire does), and a client trusts that CA only. No PKI of the user's
//! is involved, and a server without the secret cannot pass as the job's.
//!
//! Clients present no certificate: every request already proves the
//! secret by its signature ([`super::credential`]). TLS adds what the
//! signature cannot: the cluster's addresses and the requests are not
//! readable on the network.

use std::sync::{Arc, Mutex};

use kungfu_transport::auth::{JobSecret, MAC_LEN};
use kungfu_transport::quic::tls::SERVER_NAME;
use kungfu_transport::quic::JobCa;
use rustls::pki_types::ServerName;

/// The server's TLS settings: TLS 1.3 only, a certificate issued now from
/// the job's CA.
pub(super) fn server_config(secret: &JobSecret) -> Result<Arc<rustls::ServerConfig>, String> {
    let issued = JobCa::from_secret(secret)
        .and_then(|ca| ca.issue("config server"))
        .map_err(|e| format!("the config server's certificate: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let c = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(issued.chain, issued.key)
        .map_err(|e| format!("the config server's certificate: {e}"))?;
    Ok(Arc::new(c))
}

/// The connectors made, by a MAC of the secret: a follower asks the
/// config server every 100 ms, and deriving the CA each time was repeated
/// work. A few secrets at most (a process is in one job, tests in more).
static CONNECTORS: Mutex<Vec<([u8; MAC_LEN], tokio_rustls::TlsConnector)>> = Mutex::new(Vec::new());
const CACHED: usize = 4;

/// A client's TLS connector: it trusts the job's CA and nothing else
/// (made once per secret in a process).
pub(super) fn connector(secret: &JobSecret) -> Result<tokio_rustls::TlsConnector, String> {
    let key = secret.mac(b"kungfu config-server connector cache", &[]);
    let cached = |c: &Vec<([u8; MAC_LEN], tokio_rustls::TlsConnector)>| {
        c.iter().find(|(k, _)| *k == key).map(|(_, t)| t.clone())
    };
    if let Some(t) = cached(&CONNECTORS.lock().unwrap_or_else(|e| e.into_inner())) {
        return Ok(t);
    }
    let t = make_connector(secret)?;
    let mut c = CONNECTORS.lock().unwrap_or_else(|e| e.into_inner());
    if c.len() >= CACHED {
        c.remove(0);
    }
    c.push((key, t.clone()));
    Ok(t)
}

fn make_connector(secret: &JobSecret) -> Result<tokio_rustls::TlsConnector, String> {
    let ca = JobCa::from_secret(secret).map_err(|e| format!("the job's CA: {e}"))?;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(ca.cert_der().clone())
        .map_err(|e| format!("the job's CA: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let c = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(c)))
}

/// The name the server's certificate carries, as a client checks it.
pub(super) fn server_name() -> ServerName<'static> {
    ServerName::try_from(SERVER_NAME).expect("a valid DNS name")
}
