//! Consensus: whether every rank passed the same bytes, run as two
//! allreduce-max ops under internal names; the swap runs it too, while it
//! holds the gate.

use kungfu_transport::Transport;
use tokio::sync::oneshot;

use super::output::{Memory, Start};
use super::{OpHandle, OpOutput, Session};
use crate::names::check_name;
use crate::{CollectiveError, DType, OpKind, OpSpec, ReduceOp};

impl<T: Transport> Session<T> {
    /// Whether every rank passed the same bytes (length included).
    pub fn consensus(&self, name: &str, data: &[u8]) -> OpHandle<bool> {
        let (tx, h) = OpHandle::pair();
        if let Err(reason) = check_name(name) {
            drop(tx.send(Err(self.invalid_err(name, reason))));
            return h;
        }
        self.consensus_with(name, data, false, tx);
        h
    }

    /// Runs a consensus; `gated`: the caller holds the swap gate (its ops
    /// must not wait for it).
    pub(super) fn consensus_with(
        &self,
        name: &str,
        data: &[u8],
        gated: bool,
        tx: oneshot::Sender<Result<bool, CollectiveError>>,
    ) {
        // max(x) == min(x) across ranks, computed as one allreduce-max of
        // [x, !x]: the second half yields !min(x). First on the lengths,
        // then, if they agree, on the bytes. Internal names end in NUL so
        // they cannot collide with a caller's.
        let len = data.len() as u64;
        let session = self.clone();
        let data = data.to_vec();
        let name = name.to_string();
        self.inner.runtime.spawn(async move {
            let r = async {
                let spec = |count| OpSpec {
                    kind: OpKind::Allreduce(ReduceOp::Max),
                    dtype: DType::U64,
                    count,
                    check: 0,
                };
                let lens = [len, !len];
                let out = session
                    .start_internal(
                        gated,
                        &format!("{name}\0len"),
                        spec(2),
                        bytemuck::cast_slice(&lens),
                    )
                    .await?;
                let v: Vec<u64> = out.to_vec();
                if v[0] != !v[1] {
                    return Ok(false);
                }
                let mut both = data.clone();
                both.extend(data.iter().map(|b| !b));
                let spec = OpSpec {
                    kind: OpKind::Allreduce(ReduceOp::Max),
                    dtype: DType::U8,
                    count: both.len(),
                    check: 0,
                };
                let out = session
                    .start_internal(gated, &format!("{name}\0data"), spec, &both)
                    .await?;
                let b = out.bytes().unwrap_or_default();
                let (max, notmin) = b.split_at(data.len());
                Ok(max.iter().zip(notmin).all(|(a, b)| *a == !*b))
            }
            .await;
            drop(tx.send(r));
        });
    }

    /// Starts an op under an internal name (not checked); `gated`: the
    /// swap that holds the gate starts it, so it does not wait for it.
    fn start_internal(
        &self,
        gated: bool,
        name: &str,
        spec: OpSpec,
        input: &[u8],
    ) -> OpHandle<OpOutput> {
        let (tx, h) = OpHandle::pair();
        let done = Box::new(move |r| drop(tx.send(r)));
        let s = Start::new(name, spec, Memory::Input(input), done).internal();
        let d = if gated {
            // the gate is the whole session's: a swap holds it
            debug_assert!(self.scope.is_none());
            self.start_now(s)
        } else {
            self.start(s)
        };
        h.driven(d)
    }
}
