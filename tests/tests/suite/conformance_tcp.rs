//! The conformance suite on TCP over loopback.

kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::Tcp);
