//! An op's working memory: a plain pooled buffer while no wire needs a
//! range of it, or a [`Region`] whose ranges are lent (receives posted
//! into it, sends that go straight from it, or the caller's memory).
//!
//! Lending costs a share per access (a lock, an entry in the region's
//! table), which the shared-memory path, where nothing is lent, does not
//! pay: the driver lends only when a wire of the op's peers needs it.

use std::ops::Range;
use std::sync::Arc;

use kungfu_transport::wire::Caps;
use kungfu_transport::{Mem, MemMut, Region};

use super::output::Output;
use crate::plan::Work;
use crate::pool::PooledBuf;

pub(super) enum OpMem {
    Plain(PooledBuf),
    Lent {
        region: Arc<Region>,
        /// The caller's memory ([`super::Session::submit_in`]): the output
        /// stays in it.
        callers: bool,
    },
}

/// Whether a wire needs ranges of an op's memory lent to it: it does not
/// lend frames in place (receives are posted), it sends straight from the
/// op's memory, or it delivers some frames only into posted receives.
pub(super) fn lends_to(caps: &Caps) -> bool {
    !caps.lends || caps.borrows_sends || caps.eager_max < caps.max_frame
}

impl OpMem {
    /// The caller's memory.
    pub(super) fn callers(region: Arc<Region>) -> OpMem {
        OpMem::Lent {
            region,
            callers: true,
        }
    }

    pub(super) fn is_lent(&self) -> bool {
        matches!(self, OpMem::Lent { .. })
    }

    /// From now on ranges may be lent.
    pub(super) fn lend(&mut self) {
        if let OpMem::Plain(b) = self {
            let b = std::mem::replace(b, PooledBuf::unpooled(Vec::new()));
            *self = OpMem::Lent {
                region: Region::from_pooled(b),
                callers: false,
            };
        }
    }

    /// Runs `f` on `range`, readable; None if the range is lent out for
    /// writing (a plan that sends a range it receives into at once).
    pub(super) fn read<R>(&self, range: Range<usize>, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        match self {
            OpMem::Plain(b) => Some(f(&b[range])),
            OpMem::Lent { region, .. } => region.read(range).ok().map(|m| f(m.as_slice())),
        }
    }

    /// A read share of `range`, to lend to a send (lent memory only).
    pub(super) fn share(&self, range: Range<usize>) -> Option<Mem> {
        match self {
            OpMem::Plain(_) => None,
            OpMem::Lent { region, .. } => region.read(range).ok(),
        }
    }

    /// A write share of `range`, to post a receive into (lent memory only).
    pub(super) fn share_mut(&self, range: Range<usize>) -> Option<MemMut> {
        match self {
            OpMem::Plain(_) => None,
            OpMem::Lent { region, .. } => region.write(range).ok(),
        }
    }

    /// Where a finished op's output is: the working buffer taken back (no
    /// copy: at the end no range of it is lent out, so the op holds it
    /// alone), or a read share of the caller's memory.
    pub(super) fn output(&mut self, range: Option<Range<usize>>) -> Output {
        // The caller's memory stays held by the op too, until the op is
        // dropped after its completion ran: a region's release may be how
        // the caller learns that the op ended (the C ABI's hook).
        if let OpMem::Lent {
            region,
            callers: true,
        } = self
        {
            return Output::Shared(range.and_then(|r| region.read(r).ok()));
        }
        let taken = std::mem::replace(self, OpMem::Plain(PooledBuf::unpooled(Vec::new())));
        let region = match taken {
            OpMem::Plain(b) => return Output::Owned(b, range),
            OpMem::Lent { region, .. } => region,
        };
        let buf = match Region::into_pooled(region) {
            Ok(b) => b,
            // Held elsewhere still (a share not yet dropped): copy it out.
            Err(region) => PooledBuf::unpooled(
                region
                    .read(0..region.len())
                    .map(|m| m.as_slice().to_vec())
                    .unwrap_or_default(),
            ),
        };
        Output::Owned(buf, range)
    }
}

impl Work for OpMem {
    fn write(&mut self, range: Range<usize>, f: &mut dyn FnMut(&mut [u8])) -> bool {
        match self {
            OpMem::Plain(b) => Work::write(&mut **b, range, f),
            OpMem::Lent { region, .. } => Work::write(region, range, f),
        }
    }
}
