//! The conformance suite on the in-memory network, plain and with seeded
//! delays that reorder frames.

kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::Mem);

mod delayed {
    kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::MemDelayed);
}
