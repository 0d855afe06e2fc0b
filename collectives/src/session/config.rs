//! A session's settings ([`SessionConfig`]), and which ops of one host
//! take the fast path's lanes or cross-memory attach ([`FastLarge`],
//! [`LARGE_ALLREDUCE_FROM`], [`DEFAULT_FAST_MAX_BYTES`]).

use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::{AutoThresholds, Strategy};

use crate::OpKind;

/// Settings of a [`Session`](super::Session).
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// The strategy every op uses (`AUTO` chooses per op size).
    pub strategy: Strategy,
    /// Where `AUTO` switches algorithms by message size.
    pub auto: AutoThresholds,
    /// Ops are cut into chunks of at most this many bytes, which pipeline.
    pub chunk_bytes: usize,
    /// An op fails when it makes no progress for this long.
    pub op_timeout: Duration,
    /// Bytes of one op's frames in flight at most (at least one frame is
    /// always allowed). Sends that a backend makes later copy their bytes,
    /// so this bounds the extra memory a large op takes at once.
    ///
    /// Memory: an op's working buffer ([`OpSpec::work_len`](crate::OpSpec::work_len) bytes) and
    /// those copies come from the transport's buffer pool
    /// ([`Transport::pool`](kungfu_transport::Transport::pool)), which the transport's received payloads come
    /// from too. Buffers go back to it when dropped (an [`OpOutput`](super::OpOutput) when
    /// the caller drops it), and it keeps at most its budget of them idle
    /// ([`kungfu_transport::pool`]; the runtime reads
    /// `KUNGFU_BUFFER_POOL_BYTES`, 256 MiB by default), so ops in the
    /// steady state allocate no buffer.
    pub max_inflight_bytes: usize,
    /// Allreduce, broadcast and allgather of at most this many bytes per
    /// rank take the host fast path when every rank is on this host and
    /// reached through shared memory (`session/fast.rs`): broadcast and
    /// allgather up to a lane's slot (256 KiB), allreduce up to a slot per
    /// rank (split, `session/fast/split.rs`); [`DEFAULT_FAST_MAX_BYTES`]
    /// by default; 0: never. Every rank must use the same value.
    pub fast_max_bytes: usize,
    /// Which larger ops (above what the lanes take) of one host move their
    /// bytes with one cross-memory copy from the peers' buffers
    /// (`session/fast/large.rs`), where the host permits it
    /// (`kungfu_transport::shm::cma::available`), instead of through the
    /// rings: broadcast and allgather by default, and allreduce from
    /// [`LARGE_ALLREDUCE_FROM`]. Every rank must use the same value.
    pub fast_large: FastLarge,
    /// Where ops record their phases ([`crate::timeline`]); `None`: off.
    pub timeline: Option<Arc<crate::timeline::Timeline>>,
}

impl Default for SessionConfig {
    /// `AUTO`, 1 MiB chunks, 60 s without progress, 64 MiB in flight,
    /// the fast path up to 1 MiB, larger ops through the rings.
    fn default() -> SessionConfig {
        SessionConfig {
            strategy: Strategy::Auto,
            auto: AutoThresholds::default(),
            chunk_bytes: 1 << 20,
            op_timeout: Duration::from_secs(60),
            max_inflight_bytes: 64 << 20,
            fast_max_bytes: DEFAULT_FAST_MAX_BYTES,
            fast_large: FastLarge::default(),
            timeline: None,
        }
    }
}

/// Which larger ops of one host take cross-memory attach
/// ([`SessionConfig::fast_large`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FastLarge {
    /// None: they go through the rings.
    Off,
    /// Broadcast and allgather, and allreduce from [`LARGE_ALLREDUCE_FROM`]
    /// (the default). One copy from the root's or the owner's buffer beats
    /// the rings' two or more per hop for the copies, measured here at 1 to
    /// 16 MiB (busbw against Open MPI 0.92-0.99 where the rings give
    /// 0.59-0.70 at 2 ranks; 0.50-0.62 against 0.25-0.41 at 4). For
    /// allreduce the one-copy reduction only wins on larger buffers; see
    /// [`LARGE_ALLREDUCE_FROM`].
    #[default]
    Copies,
    /// Allreduce of every size above the lanes too.
    All,
}

/// Allreduce buffers of at least this many bytes (and above what the
/// lanes take) go by cross-memory attach under [`FastLarge::Copies`].
/// Measured here (2-core machine, kungfu-bench out of place, medians of 5
/// alternating rounds, time of the one-copy way over the rings'): at 2
/// ranks 0.88/0.86/0.87 at 1/2/4 MiB, at 4 ranks 0.78/0.68 at 2/4 MiB
/// (1 MiB there fits the lanes), the same at 8 MiB. Before the one-copy
/// way stopped copying its whole buffer for nothing (issue 36), it lost
/// below 8 MiB, and this was 8 MiB.
pub const LARGE_ALLREDUCE_FROM: usize = 1 << 20;

impl FastLarge {
    /// Whether ops of `kind` with `bytes` per rank's block take it.
    pub fn takes(self, kind: OpKind, bytes: usize) -> bool {
        match self {
            FastLarge::Off => false,
            FastLarge::Copies => match kind {
                OpKind::Broadcast { .. } | OpKind::Allgather => true,
                OpKind::Allreduce(_) => bytes >= LARGE_ALLREDUCE_FROM,
                _ => false,
            },
            FastLarge::All => true,
        }
    }
}

/// [`SessionConfig::fast_max_bytes`] by default: 1 MiB (an allreduce of
/// 4 ranks whose slices fill a slot each).
pub const DEFAULT_FAST_MAX_BYTES: usize = 4 * kungfu_transport::shm::lane::SLOT_BYTES;
