//! The conformance suite on libfabric (shm).

kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::FabricShm);
