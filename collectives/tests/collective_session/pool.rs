//! Buffers: an op's working buffer comes from its transport's pool.

use kungfu_transport::pool::BufferPool;
use kungfu_transport::Transport;

use super::*;

/// The working buffer of an op is taken from the pool of the session's
/// transport (the one its wires fill payloads from), held by the output,
/// and given back to that pool when the output is dropped; the next op of
/// the size takes it again.
#[test]
fn working_buffers_come_from_the_transports_pool() {
    rt().block_on(async {
        let pool = BufferPool::new(1 << 20);
        let mem = MemConfig {
            pool: Some(pool.clone()),
            ..MemConfig::default()
        };
        let ss = Session::local_cluster(1, mem, SessionConfig::default());
        let s = &ss[0];
        assert!(Arc::ptr_eq(s.transport().pool(), &pool));
        // 40000 bytes: a working buffer of the 64 KiB class
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::F32,
            count: 10_000,
            check: 0,
        };
        let input = vec![0u8; 40_000];
        let out = s.submit("w", spec, &input).await.unwrap();
        assert_eq!(pool.idle_bytes(), 0, "the output holds it");
        drop(out);
        assert_eq!(pool.idle_bytes(), 64 << 10, "back in the transport's pool");
        let out = s.submit("w", spec, &input).await.unwrap();
        assert_eq!(pool.idle_bytes(), 0, "taken again");
        assert_eq!(out.bytes().map(<[u8]>::len), Some(40_000));
    });
}
