//! The config server's client: one request, the config of the current
//! or of a given version, a put, and a watch that polls from another host.

use std::time::Duration;

use kungfu_transport::auth::JobSecret;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::credential;
use super::message::{read_response, split_url, Url};
use super::server::HISTORY;
use super::tls;
use super::ClusterConfig;

/// Follows the config server at `url` from another host: every version
/// after `after`, in order, as a poll every `period` finds it (each
/// version between two polls is fetched from the server's history; one it
/// forgot already is skipped). A server unreachable for `give_up` ends it
/// with the error.
pub fn follow(
    url: String,
    secret: Option<JobSecret>,
    after: u32,
    period: Duration,
    give_up: Duration,
) -> mpsc::UnboundedReceiver<Result<ClusterConfig, String>> {
    let (tx, out) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut seen = after;
        let mut reached = Instant::now();
        loop {
            let deadline = Instant::now() + period.max(Duration::from_secs(2));
            match get_config(&url, secret.as_ref(), deadline).await {
                Ok(latest) => {
                    reached = Instant::now();
                    // the server keeps the last HISTORY versions: older
                    // ones are gone anyway
                    seen = seen.max(latest.version.saturating_sub(HISTORY as u32));
                    while seen < latest.version {
                        let v = seen + 1;
                        let c = if v == latest.version {
                            Some(latest.clone())
                        } else {
                            match get_version(&url, v, secret.as_ref(), deadline).await {
                                Ok(c) => c,
                                // not skipped: tried again at the next poll
                                Err(_) => break,
                            }
                        };
                        seen = v;
                        if let Some(c) = c {
                            if tx.send(Ok(c)).is_err() {
                                return;
                            }
                        }
                    }
                }
                Err(e) if reached.elapsed() > give_up => {
                    let _ = tx.send(Err(format!(
                        "the config server {url} is unreachable for {give_up:?}: {e}"
                    )));
                    return;
                }
                Err(_) => {}
            }
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(period).await;
        }
    });
    out
}

/// One HTTP request to the config server; the status code and the body.
/// With the job's `secret`, the request is signed ([`credential`]) and an
/// answer that claims the server's authority (200, 404, 409) is taken
/// only with the server's signature: else an error that says "an answer
/// refused".
pub async fn request(
    method: &str,
    url: &str,
    body: &str,
    secret: Option<&JobSecret>,
    deadline: Instant,
) -> Result<(u16, String), String> {
    let Url {
        tls: over_tls,
        addr,
        path,
    } = split_url(url)?;
    let signed = secret
        .map(|k| credential::sign(k, method, path, body.as_bytes(), credential::now_ms()))
        .transpose()?;
    let connector = match (over_tls, secret) {
        (false, _) => None,
        (true, Some(k)) => Some(tls::connector(k)?),
        (true, None) => {
            return Err(format!(
                "{url}: a config server over TLS is trusted through the job's secret, and there is none (KUNGFU_JOB_SECRET)"
            ))
        }
    };
    let io = async {
        let s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect to {addr}: {e}"))?;
        let mut headers = vec![("Host", addr), ("Connection", "close")];
        if let Some(sg) = &signed {
            headers.push(("Authorization", &sg.authorization));
        }
        let req = crate::http::request_bytes(method, path, &headers, body.as_bytes())?;
        match connector {
            None => exchange(s, &req).await,
            Some(c) => {
                let s = c
                    .connect(tls::server_name(), s)
                    .await
                    .map_err(|e| format!("TLS with {addr}: {e} (not the job's config server?)"))?;
                exchange(s, &req).await
            }
        }
    };
    let (code, answer, signature) = tokio::time::timeout_at(deadline, io)
        .await
        .map_err(|_| format!("{method} {url}: timed out"))??;
    if let (Some(k), Some(sg)) = (secret, &signed) {
        if matches!(code, 200 | 404 | 409) {
            credential::check_answer(k, &sg.nonce, code, answer.as_bytes(), signature.as_deref())
                .map_err(|why| {
                format!("{method} {url}: an answer refused ({code}, {why}): not the job's server")
            })?;
        }
    }
    Ok((code, answer))
}

/// Writes one request and reads its response (see [`read_response`]).
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    req: &[u8],
) -> Result<(u16, String, Option<String>), String> {
    s.write_all(req).await.map_err(|e| format!("write: {e}"))?;
    s.flush().await.map_err(|e| format!("write: {e}"))?;
    read_response(&mut s).await
}

/// Gets the current config (signed with `secret`, see [`request`]).
pub async fn get_config(
    url: &str,
    secret: Option<&JobSecret>,
    deadline: Instant,
) -> Result<ClusterConfig, String> {
    match request("GET", url, "", secret, deadline).await? {
        (200, body) => ClusterConfig::parse(&body),
        (code, body) => Err(format!("GET {url}: {code} {}", body.trim())),
    }
}

/// Gets version `v` of the config, if the server made it (and still
/// keeps it): the successor a recovery decided, whatever came after it.
pub async fn get_version(
    url: &str,
    v: u32,
    secret: Option<&JobSecret>,
    deadline: Instant,
) -> Result<Option<ClusterConfig>, String> {
    match request("GET", &format!("{url}/{v}"), "", secret, deadline).await? {
        (200, body) => ClusterConfig::parse(&body).map(Some),
        (404, _) => Ok(None),
        (code, body) => Err(format!("GET {url}/{v}: {code} {}", body.trim())),
    }
}

/// Puts `body` (`size N` or a whole config), with the job's credential if
/// `secret` is given; the new config.
pub async fn put_config(
    url: &str,
    body: &str,
    secret: Option<&JobSecret>,
    deadline: Instant,
) -> Result<ClusterConfig, String> {
    match request("PUT", url, body, secret, deadline).await? {
        (200, body) => ClusterConfig::parse(&body),
        (code, body) => Err(format!("PUT {url}: {code} {}", body.trim())),
    }
}
