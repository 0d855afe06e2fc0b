//! Blocking and in-place helpers, for callers outside the runtime.
//!
//! They submit an op and wait on the calling thread, so they must not be
//! called from a thread that drives the tokio runtime.

use kungfu_transport::Transport;

use crate::{CollectiveError, Element, ReduceOp, Session};

/// Allreduces `buf` in place across all ranks.
pub fn allreduce_in_place<T: Transport, E: Element>(
    s: &Session<T>,
    name: &str,
    buf: &mut [E],
    op: ReduceOp,
) -> Result<(), CollectiveError> {
    let out = s.allreduce(name, buf, op).wait()?;
    buf.copy_from_slice(&out);
    Ok(())
}

/// Broadcasts `buf` in place from `root`.
pub fn broadcast_in_place<T: Transport, E: Element>(
    s: &Session<T>,
    name: &str,
    buf: &mut [E],
    root: kungfu_topology::Rank,
) -> Result<(), CollectiveError> {
    let out = s.broadcast(name, buf, root).wait()?;
    buf.copy_from_slice(&out);
    Ok(())
}

/// Allreduces `input` into `output` (out of place).
pub fn allreduce_into<T: Transport, E: Element>(
    s: &Session<T>,
    name: &str,
    input: &[E],
    output: &mut [E],
    op: ReduceOp,
) -> Result<(), CollectiveError> {
    if output.len() != input.len() {
        return Err(CollectiveError::InvalidArgument {
            name: name.into(),
            reason: format!(
                "output has {} elements, input {}",
                output.len(),
                input.len()
            ),
        });
    }
    let out = s.allreduce(name, input, op).wait()?;
    output.copy_from_slice(&out);
    Ok(())
}
