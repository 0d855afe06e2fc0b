//! The conformance suite on QUIC over loopback (mutual TLS, a stream per frame).

kungfu_transport::conformance_tests!(kungfu_transport::conformance::clusters::Quic);
