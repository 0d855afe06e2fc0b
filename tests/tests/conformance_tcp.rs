//! The conformance suite on TCP over loopback.

kungfu_transport::conformance_tests!(kungfu_transport::conformance::clusters::Tcp);
