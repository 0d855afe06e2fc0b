//! The two sides of the handshake over a byte stream: [`dial`] says hello
//! and, with a secret, checks the answerer's proof and gives its own;
//! [`answer`] checks a hello ([`check`]) and answers it. Each says why it
//! refused; the dialer also whether the link is worth another attempt.

use kungfu_topology::Rank;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::messages::{
    check_prefix, message, Ack, Hello, Status, ACK_LEN, HELLO_LEN, KIND_ACK, KIND_HELLO,
    KIND_PROOF, KIND_VERDICT, PREFIX_LEN, PROOF_LEN, VERDICT_LEN,
};
use super::{check, Identity};
use crate::auth::{JobSecret, NONCE_LEN};

const LABEL_ANSWERER: &[u8] = b"kungfu handshake v3: answerer";
const LABEL_DIALER: &[u8] = b"kungfu handshake v3: dialer";

/// Reads a message of `kind` of `N` bytes: its prefix first, checked.
async fn read_message<S, const N: usize>(
    s: &mut S,
    kind: u8,
    what: &str,
) -> Result<[u8; N], Refusal>
where
    S: AsyncRead + Unpin,
{
    let mut b = [0u8; N];
    s.read_exact(&mut b[..PREFIX_LEN])
        .await
        .map_err(|e| Refusal::Link(format!("read {what}: {e}")))?;
    check_prefix(&b, kind, what).map_err(Refusal::Final)?;
    s.read_exact(&mut b[PREFIX_LEN..])
        .await
        .map_err(|e| Refusal::Link(format!("read {what}: {e}")))?;
    Ok(b)
}

/// Why a step of the handshake failed.
enum Refusal {
    /// The link failed (worth another attempt).
    Link(String),
    /// The peer said something this side refuses (final).
    Final(String),
}

impl Refusal {
    fn reason(self) -> String {
        match self {
            Refusal::Link(r) | Refusal::Final(r) => r,
        }
    }
}

/// A fresh nonce, if `secret` asks for one (zeros otherwise).
fn nonce(secret: &Option<JobSecret>) -> Result<[u8; NONCE_LEN], String> {
    match secret {
        Some(_) => crate::auth::random().map_err(|e| e.to_string()),
        None => Ok([0; NONCE_LEN]),
    }
}

/// Why the presence of secrets differs, if it does: `we` and `peer` hold
/// one or not.
fn secrets_differ(we: bool, peer: bool) -> Option<&'static str> {
    match (we, peer) {
        (true, false) => {
            Some("bad credential: the peer holds no job secret (KUNGFU_JOB_SECRET), we do")
        }
        (false, true) => {
            Some("bad credential: the peer holds a job secret (KUNGFU_JOB_SECRET), we do not")
        }
        _ => None,
    }
}

fn refusal_text(ack: &Ack, me: &Identity) -> String {
    match ack.status {
        Status::Ok => "accepted".into(),
        Status::Cluster => format!(
            "refused: cluster id differs (peer {:#x}, ours {:#x})",
            ack.cluster_id, me.cluster_id
        ),
        Status::Version => format!(
            "refused: cluster version differs (peer at {}, we are at {})",
            ack.version, me.version
        ),
        Status::Epoch => format!(
            "refused: epoch differs (peer at {}, we are at {}, both of {})",
            ack.epoch, me.epoch, me.version
        ),
        Status::NotMe => format!(
            "refused: that address is {}, not the rank we dialed",
            ack.rank
        ),
        Status::PeerList => "refused: the peer lists differ".into(),
        Status::BadRank => format!("refused: {} may not dial that peer", me.rank),
        Status::Malformed => "refused: malformed hello".into(),
        Status::Credential => match secrets_differ(me.secret.is_some(), ack.secret) {
            Some(why) => format!("refused: {why}"),
            None => {
                "refused: bad credential (the peer does not accept our proof of the job secret)"
                    .into()
            }
        },
    }
}

/// Why [`dial`] failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DialError {
    /// The link failed (worth another attempt), rather than the peer
    /// refusing (final: retrying will not change its mind).
    pub retry: bool,
    pub reason: String,
}

/// The dialer's side: says hello to `to`, reads its answer, and with a
/// secret checks the answerer's proof and gives its own.
pub async fn dial<S>(s: &mut S, me: &Identity, to: Rank) -> Result<(), DialError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let link = |what: &str, e: std::io::Error| DialError {
        retry: true,
        reason: format!("{what}: {e}"),
    };
    let refused = |reason: String| DialError {
        retry: false,
        reason,
    };
    let from_step = |r: Refusal| match r {
        Refusal::Link(reason) => DialError {
            retry: true,
            reason,
        },
        Refusal::Final(reason) => refused(reason),
    };
    let hello = Hello::of(me, to, nonce(&me.secret).map_err(refused)?).encode();
    s.write_all(&hello)
        .await
        .map_err(|e| link("send hello", e))?;
    let b: [u8; ACK_LEN] = read_message(s, KIND_ACK, "answer to hello")
        .await
        .map_err(from_step)?;
    let ack = Ack::decode(&b).ok_or_else(|| refused("malformed answer to hello".into()))?;
    if ack.status != Status::Ok {
        // A peer at an older cluster version has not moved to ours yet:
        // worth another attempt until the deadline (a replacement that
        // `kungfu-run --on-failure replace` starts as soon as a recovery
        // is decided dials survivors still connecting the version before).
        // Every other refusal is final.
        let behind = ack.status == Status::Version && ack.version < me.version;
        return Err(DialError {
            retry: behind,
            reason: refusal_text(&ack, me),
        });
    }
    let Some(secret) = &me.secret else {
        return match ack.secret {
            true => Err(refused(format!(
                "refused: {}",
                secrets_differ(false, true).unwrap_or_default()
            ))),
            false => Ok(()),
        };
    };
    if !secret.verify(LABEL_ANSWERER, &[&hello, &ack.nonce], &ack.mac) {
        // Tell the answerer why (best effort), with no MAC of ours.
        let no: [u8; PROOF_LEN] = message(KIND_PROOF, &[Status::Credential as u8]);
        let _ = s.write_all(&no).await;
        return Err(refused(
            "refused: bad credential (the peer's proof of the job secret is wrong)".into(),
        ));
    }
    let mac = secret.mac(LABEL_DIALER, &[&hello, &ack.nonce]);
    let proof: [u8; PROOF_LEN] = message(KIND_PROOF, &[&[0u8; 4][..], &mac].concat());
    s.write_all(&proof)
        .await
        .map_err(|e| link("send proof", e))?;
    let v: [u8; VERDICT_LEN] = read_message(s, KIND_VERDICT, "verdict")
        .await
        .map_err(from_step)?;
    match Status::from_u8(v[4]) {
        Some(Status::Ok) => Ok(()),
        Some(status) => Err(refused(refusal_text(&Ack { status, ..ack }, me))),
        None => Err(refused("malformed verdict".into())),
    }
}

/// The answerer's side: reads a hello, checks it ([`check`]) and answers;
/// with a secret it proves it holds the secret and checks the dialer's
/// proof. The dialer's rank if accepted. A refusal is answered (best
/// effort) and returned as this side's error.
pub async fn answer<S>(
    s: &mut S,
    me: &Identity,
    may_dial: impl Fn(Rank) -> bool,
) -> Result<Rank, String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b[..PREFIX_LEN])
        .await
        .map_err(|e| format!("read hello: {e}"))?;
    if let Err(why) = check_prefix(&b, KIND_HELLO, "hello") {
        // The rest may never come (another hello version is another
        // length): answer now. Best effort, as below.
        let _ = s.write_all(&Ack::of(me, Status::Malformed).encode()).await;
        return Err(why);
    }
    s.read_exact(&mut b[PREFIX_LEN..])
        .await
        .map_err(|e| format!("read hello: {e}"))?;
    let verdict = Hello::decode(&b)
        .map_err(|e| (Status::Malformed, e))
        .and_then(|h| check(me, &h, may_dial).map(|()| h))
        .and_then(|h| match secrets_differ(me.secret.is_some(), h.secret) {
            Some(why) => Err((Status::Credential, why.to_string())),
            None => Ok(h),
        });
    let h = match verdict {
        Ok(h) => h,
        Err((status, why)) => {
            // Best effort: the refusal is reported here either way.
            let _ = s.write_all(&Ack::of(me, status).encode()).await;
            return Err(why);
        }
    };
    let mut ack = Ack::of(me, Status::Ok);
    if let Some(secret) = &me.secret {
        ack.nonce = nonce(&me.secret)?;
        ack.mac = secret.mac(LABEL_ANSWERER, &[&b, &ack.nonce]);
    }
    s.write_all(&ack.encode())
        .await
        .map_err(|e| format!("send answer: {e}"))?;
    let Some(secret) = &me.secret else {
        return Ok(h.from);
    };
    let proof: [u8; PROOF_LEN] = read_message(s, KIND_PROOF, "proof").await.map_err(|r| {
        format!(
            "{} (from {}, which did not prove the job secret)",
            r.reason(),
            h.from
        )
    })?;
    if proof[4] != Status::Ok as u8 {
        return Err(format!(
            "bad credential: a dialer claiming to be {} refused our proof of the job secret (the secrets differ)",
            h.from
        ));
    }
    if !secret.verify(LABEL_DIALER, &[&b, &ack.nonce], &proof[8..]) {
        let v: [u8; VERDICT_LEN] = message(KIND_VERDICT, &[Status::Credential as u8]);
        let _ = s.write_all(&v).await;
        return Err(format!(
            "bad credential: the proof of the job secret of a dialer claiming to be {} is wrong",
            h.from
        ));
    }
    let v: [u8; VERDICT_LEN] = message(KIND_VERDICT, &[Status::Ok as u8]);
    s.write_all(&v)
        .await
        .map_err(|e| format!("send verdict: {e}"))?;
    Ok(h.from)
}
