//! The conformance suite on shared memory, with 4 KiB rings (frames wrap
//! and stream through them).

kungfu_transport::conformance_tests!(kungfu_transport::conformance::clusters::Shm);
