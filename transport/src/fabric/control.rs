//! The control links of a fabric wire (the bootstrap links, kept open):
//! heartbeats and loss notices written on them as `FRM!` frames and read
//! into the matcher, and the goodbye or the end of a link, which is the
//! end of its peer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::Rank;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;

use super::core::Core;
use super::FabricWire;
use crate::endpoint::{Matcher, CLOSED_BY_PEER, MAX_BEACON};
use crate::{FrameKind, Header, TransportError, HEADER_LEN};

/// The largest payload of a frame on a control link.
const MAX_CONTROL_FRAME: usize = MAX_BEACON;

/// Whether `header` travels on the control link rather than the fabric.
pub(super) fn on_control_link(header: &Header) -> bool {
    matches!(header.kind, FrameKind::Heartbeat | FrameKind::Lost)
}

/// Reads the control frames of `peer` (heartbeats, loss notices: see the
/// module docs) into the matcher until the link ends; returns the first
/// four bytes of what is not one, or the read's error.
async fn control_frames(
    rd: &mut OwnedReadHalf,
    peer: Rank,
    matcher: &Matcher,
) -> Result<[u8; 4], String> {
    loop {
        let mut magic = [0u8; 4];
        rd.read_exact(&mut magic)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => CLOSED_BY_PEER.to_string(),
                _ => format!("control link: {e}"),
            })?;
        if magic != *b"FRM!" {
            return Ok(magic);
        }
        let mut hb = [0u8; HEADER_LEN];
        rd.read_exact(&mut hb)
            .await
            .map_err(|e| format!("control link: {e}"))?;
        let header = Header::decode(&hb, MAX_CONTROL_FRAME)
            .map_err(|e| format!("protocol violation on the control link: {e}"))?;
        if !on_control_link(&header) {
            return Err(format!(
                "protocol violation on the control link: a {:?} frame",
                header.kind
            ));
        }
        let mut payload = vec![0u8; header.len as usize]; // at most MAX_CONTROL_FRAME
        rd.read_exact(&mut payload)
            .await
            .map_err(|e| format!("control link: {e}"))?;
        // heartbeats and notices never wait for room
        let _ = matcher.deliver_now(peer, header, payload.into());
    }
}

/// Watches the control link of `peer`: its goodbye (then waits until its
/// frames all arrived), or its end, is the end of the peer; heartbeats and
/// loss notices on the way go to the matcher.
pub(super) async fn watch(mut rd: OwnedReadHalf, peer: Rank, core: Arc<Core>) {
    let magic = control_frames(&mut rd, peer, &core.matcher).await;
    let mut b = [0u8; 12];
    let read = match magic {
        Ok(m) => {
            b[..4].copy_from_slice(&m);
            rd.read_exact(&mut b[4..]).await.map(drop)
        }
        Err(why) => return core.matcher.fail_peer(peer, why),
    };
    let why = match read {
        Ok(_) if b[..4] == *b"BYE!" => {
            let sent = u64::from_le_bytes(b[4..].try_into().expect("8 bytes"));
            // its frames may still be in flight: wait for them (the close
            // that reads this bounds the wait)
            while core.received[peer.idx()].load(Ordering::Relaxed) < sent {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            CLOSED_BY_PEER.to_string()
        }
        Ok(_) => "protocol violation: bad goodbye on the control link".to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => CLOSED_BY_PEER.to_string(),
        Err(e) => format!("control link: {e}"),
    };
    core.matcher.fail_peer(peer, why);
}

impl FabricWire {
    /// Writes a heartbeat or a loss notice on `to`'s control link.
    pub(super) async fn send_control(
        &self,
        to: Rank,
        mut header: Header,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let lost = |why: String| TransportError::PeerLost {
            peer: to,
            reason: why.into(),
        };
        if payload.len() > MAX_CONTROL_FRAME {
            return Err(TransportError::FrameTooLarge {
                len: payload.len(),
                max: MAX_CONTROL_FRAME,
            });
        }
        header.len = payload.len() as u64;
        let mut msg = Vec::with_capacity(4 + HEADER_LEN + payload.len());
        msg.extend_from_slice(b"FRM!");
        msg.extend_from_slice(&header.encode());
        msg.extend_from_slice(payload);
        let link = self.links.get(to.idx()).ok_or(TransportError::NoSuchPeer {
            peer: to,
            size: self.size,
        })?;
        let mut w = link.lock().await;
        let w = w
            .as_mut()
            .ok_or_else(|| lost("its control link is closed".into()))?;
        w.write_all(&msg)
            .await
            .map_err(|e| lost(format!("control link: {e}")))
    }
}
