//! The conformance suite on the hybrid transport: shared memory inside a
//! host, TCP across, with two hosts on loopback (127.0.0.1, 127.0.0.2).

kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::Hybrid);
