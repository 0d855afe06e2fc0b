//! The conformance suite on QUIC over loopback (mutual TLS, a stream per frame).

kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::Quic);
