//! The conformance suite on the in-memory network, plain and with seeded
//! delays that reorder frames.

kungfu_transport::conformance_tests!(kungfu_transport::conformance::clusters::Mem);

mod delayed {
    kungfu_transport::conformance_tests!(kungfu_transport::conformance::clusters::MemDelayed);
}
