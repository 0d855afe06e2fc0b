//! The conformance suite on shared memory, with 4 KiB rings (frames wrap
//! and stream through them).

kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::Shm);
