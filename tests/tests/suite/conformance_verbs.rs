//! The conformance suite on the verbs wire over its in-process fake fabric
//! (`cargo test -p kungfu-tests --features verbs --test suite conformance_verbs`;
//! this machine has no RDMA device).

kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::VerbsFake);
